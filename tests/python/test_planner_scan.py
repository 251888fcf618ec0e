"""`python -m smp.plan ... --scan-gpus`: the recommended layout and its throughput per cluster size,
weak and strong scaling, the PNG, and the ranking by time it rests on (smp/planner/scan.py)."""

from __future__ import annotations

import json

import pytest
import smp
from smp.planner import scan
from test_plan import REFERENCE, _cli, _job

TEN_B = REFERENCE["10B"][0]
ARGS = ("--seq-len", "512", "--global-batch", "1280", "--gpus", "128", "--precision", "fp16")


@pytest.fixture(scope="module")
def ten_b_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("scan") / "config.json"
    path.write_text(json.dumps(TEN_B))
    return str(path)


@pytest.fixture(scope="module")
def scanned(ten_b_json, tmp_path_factory):
    png = tmp_path_factory.mktemp("plot") / "scan.png"
    code, out, err = _cli("--model", ten_b_json, *ARGS, "--scan-gpus", "8,64,512", "--json")
    assert code == 0, err
    code, text, err = _cli("--model", ten_b_json, *ARGS, "--scan-gpus", "8,64,512", "--plot", str(png))
    assert code == 0, err
    return json.loads(out), text, png


def test_weak_scaling_keeps_the_batch_per_gpu_strong_the_global_batch(scanned):
    points, _, _ = scanned
    weak = {p["gpus"]: p for p in points if p["scaling"] == "weak"}
    strong = {p["gpus"]: p for p in points if p["scaling"] == "strong"}
    assert {g: p["global_batch"] for g, p in weak.items()} == {8: 80, 64: 640, 512: 5120}  # 10 per GPU
    assert {p["global_batch"] for p in strong.values()} == {1280}


def test_each_size_gets_the_plan_a_single_job_gets(scanned):
    points, _, _ = scanned
    for p in points:
        if p["recommended"] is None:
            assert p["gpus"] == 8 and p["why"] == "none fits"  # 10B in fp16 on one node of 40 GB
            continue
        alone = smp.plan(TEN_B, seq_len=512, global_batch=p["global_batch"], gpus=p["gpus"], precision="fp16")
        best = alone.recommended_candidate
        assert p["recommended"] == alone.recommended
        assert p["tokens_per_s_per_gpu"] == pytest.approx(best.time.tokens_per_second_per_gpu, rel=1e-3)
        assert p["step_s"] == pytest.approx(best.time.total, rel=1e-3)
        assert p["speedup_over_first_fit"] == pytest.approx(alone.speedup, rel=1e-3)
    strong = [p for p in points if p["scaling"] == "strong" and p["recommended"]]
    # A fixed batch over more GPUs: each GPU does less, and less efficiently.
    assert strong[0]["tokens_per_s_per_gpu"] > strong[-1]["tokens_per_s_per_gpu"]


def test_the_table_and_the_png(scanned):
    _, text, png = scanned
    assert "weak scaling (batch per GPU kept):" in text and "strong scaling (global batch kept):" in text
    assert "recommended layout" in text and "tok/s/GPU" in text and f"plot: {png}" in text
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_recommendation_is_faster_than_the_seeds_first_fit_where_one_is():
    """The 10B job's batch of 1280 on 512 GPUs: the seed's order stops at its first fit, a deep
    pipeline; ranked by time, a faster layout that also fits is recommended, and by how much."""
    result = smp.plan(**(_job("10B") | {"gpus": 512}), precision="fp16")
    first, best = result.first_fit, result.recommended_candidate
    assert first is not None and best is not first and best.fits
    assert result.speedup == pytest.approx(first.time.total / best.time.total) and result.speedup > 1.2
    assert f"{result.speedup:.2f}x the Best Practices order's first fit" in result.table()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--scan-gpus", "8,sixty"), "--scan-gpus entry 'sixty' is not a positive integer"),
        (
            ("--scan-gpus", "8,12"),
            "12 GPUs do not fill nodes of 8 (a100-40gb); give a multiple of 8, e.g. 8 or 16",
        ),
        (("--scan-gpus", "8", "--layout", "{}"), "--scan-gpus plans each size itself; leave out --layout"),
    ],
)
def test_bad_scans_are_clear_errors(ten_b_json, extra, message):
    code, out, err = _cli("--model", ten_b_json, *ARGS, *extra)
    assert code == 2 and out == ""
    assert message in err, err


def test_weak_scaling_needs_whole_batches():
    assert scan._batch("weak", 1280, 128, 8) == (80, "")
    assert (
        scan._batch("weak", 1000, 128, 8)[1] == "7.8125 samples per GPU do not make a whole batch on 8 GPUs"
    )
    assert scan.parse_sizes("8, 64") == [8, 64]
