"""The planner's hardware descriptions: the presets, a user's JSON file, and every mistake in
them as a clear error naming the value and the fix (smp/planner/hardware.py)."""

from __future__ import annotations

import json

import pytest
import smp
from smp.planner import hardware
from smp.planner.hardware_presets import PRESETS
from test_plan import REFERENCE, _cli

TEN_B = REFERENCE["10B"][0]
JOB = ("--seq-len", "512", "--global-batch", "1280")


@pytest.fixture
def ten_b_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TEN_B))
    return str(path)


def test_presets_carry_the_datasheets_figures():
    """Spec figures as the datasheets state them (hardware_presets.py cites each), per direction."""
    a100_40, a100_80 = hardware.load("a100-40gb"), hardware.load("a100-80gb")
    h100, h200 = hardware.load("h100-sxm"), hardware.load("h200")
    assert a100_40.peak_tflops == a100_80.peak_tflops == {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}
    assert h100.peak_tflops == h200.peak_tflops == {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}
    assert (a100_40.memory_bandwidth_gbps, a100_80.memory_bandwidth_gbps) == (1555, 2039)
    assert (h100.memory_bandwidth_gbps, h200.memory_bandwidth_gbps) == (3350, 4800)
    assert (a100_40.memory, a100_80.memory) == (40 * 2**30, 80 * 2**30)
    assert (h100.memory, h200.memory) == (80 * 10**9, 141 * 10**9)
    assert a100_40.intra_node_gbps == 600 / 2 and h200.intra_node_gbps == 900 / 2  # NVLink, both ways
    # The node's network per GPU: p4d 400 Gbps over 8 GPUs; DGX A100 200 Gbps per GPU; DGX H100/H200
    # 400 Gbps per GPU (Gbps / 8 = GB/s).
    assert (a100_40.inter_node_gbps, a100_80.inter_node_gbps) == (400 / 8 / 8, 200 / 8)
    assert h100.inter_node_gbps == h200.inter_node_gbps == 400 / 8
    assert all(hardware.load(name).gpus_per_node == 8 for name in PRESETS)
    assert all(hardware.load(name).sources for name in PRESETS)


def test_the_default_is_the_seeds_p4d_and_sets_the_jobs_memory():
    assert hardware.load(None) == hardware.load("a100-40gb")
    walked = smp.plan(TEN_B, seq_len=512, global_batch=1280, gpus=128, precision="fp16")
    assert walked.workload.gpu_memory == 40 * 2**30 and walked.workload.hardware.name == "a100-40gb"
    bigger = smp.plan(TEN_B, seq_len=512, global_batch=1280, gpus=128, precision="fp16", hardware="a100-80gb")
    assert bigger.workload.gpu_memory == 80 * 2**30
    # Faster memory and network, the same compute: the same layout steps faster on the 80 GB node.
    layout = {"tensor_parallel_degree": 4, "shard_optimizer_state": True, "fp16": True}
    on = {
        name: smp.plan(TEN_B, seq_len=512, global_batch=1280, gpus=128, layout=layout, hardware=name)
        for name in ("a100-40gb", "a100-80gb", "h100-sxm")
    }
    seconds = {name: r.evaluated.time.total for name, r in on.items()}
    assert seconds["h100-sxm"] < seconds["a100-80gb"] < seconds["a100-40gb"]


def test_a_users_file_round_trips(tmp_path):
    path = tmp_path / "mine.json"
    mine = {**PRESETS["h100-sxm"], "inter_node_gbps": 25.0, "description": "H100 with 200 Gbps per GPU"}
    path.write_text(json.dumps(mine))
    loaded = hardware.load(str(path))
    assert loaded.inter_node_gbps == 25.0 and loaded.name == str(path)
    assert hardware.from_dict(loaded.to_json(), "again") == loaded.__class__(
        **{**loaded.__dict__, "name": "again"}
    )
    rated = hardware.from_dict({**mine, "attention_tflops": {"bf16": 1, "fp16": 1, "fp32": 0.5}}, "cpu")
    assert rated.attention_peak("fp32") == 0.5e12 * rated.sustained_fraction
    assert hardware.from_dict(rated.to_json(), "cpu") == rated
    assert "attention_tflops" not in loaded.to_json()  # optional: absent, the matmul rate


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("a100-40", "unknown hardware 'a100-40'; did you mean 'a100-40gb'? use one of a100-40gb, a100-80gb"),
        (
            "tpu-v5",
            "unknown hardware 'tpu-v5'; use one of a100-40gb, a100-80gb, h100-sxm, h200, or a JSON file",
        ),
        ("missing.json", "cannot read the hardware file 'missing.json'"),
    ],
)
def test_unknown_hardware_is_a_clear_error(spec, message):
    with pytest.raises(ValueError, match="smp.plan: ") as e:
        hardware.load(spec)
    assert message in str(e.value)


def _file(tmp_path, **changes) -> str:
    data = {**PRESETS["a100-80gb"], **changes}
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"memory_bandwidth_gbps": None},
            "is missing the field 'memory_bandwidth_gbps'; add \"memory_bandwidth_gbps\": a number",
        ),
        ({"peak_tflops": None}, 'missing the field \'peak_tflops\'; add "peak_tflops": {"bf16": 312'),
        ({"inter_node_gpbs": 25}, "unknown field 'inter_node_gpbs'; did you mean 'inter_node_gbps'?"),
        (
            {"peak_tflops": {"bf16": 312}},
            "peak_tflops must give a positive number for each of bf16, fp16, fp32",
        ),
        (
            {"attention_tflops": {"bf16": 0.06, "fp32": 0.07}},
            "attention_tflops must give a positive number for each of bf16, fp16, fp32",
        ),
        ({"link_efficiency": 1.5}, "link_efficiency must be a fraction in (0, 1], got 1.5"),
        ({"gpus_per_node": 0}, "gpus_per_node must be a positive integer, got 0"),
        ({"memory": "lots"}, "cannot read the memory size 'lots'"),
        ({"overlap": "yes"}, "overlap must be true or false, got 'yes'"),
        ({"matmul_tiles": [[256]]}, "matmul_tiles must be a list of [rows, columns] pairs"),
    ],
)
def test_a_bad_hardware_file_is_a_clear_error(tmp_path, changes, message):
    path = _file(tmp_path, **changes)
    with pytest.raises(ValueError) as e:
        hardware.load(path)
    assert message in str(e.value) and (path in str(e.value) or "memory size" in message)


def test_a_file_that_is_not_json(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text("{nope")
    with pytest.raises(ValueError, match="is not valid JSON .*give a JSON object of the fields"):
        hardware.load(str(path))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--gpus", "12", "--hardware", "h100-sxm"),
            "12 GPUs do not fill nodes of 8 (h100-sxm); give a multiple of 8, e.g. 8 or 16",
        ),
        (
            ("--gpus", "20", "--gpus-per-node", "8"),
            "20 GPUs do not fill nodes of 8 (a100-40gb); give a multiple of 8, e.g. 16 or 24",
        ),
        (("--gpus", "128", "--hardware", "h300"), "unknown hardware 'h300'; did you mean 'h200'?"),
        (("--gpus", "128", "--hardware", "nowhere.json"), "cannot read the hardware file 'nowhere.json'"),
    ],
)
def test_bad_hardware_on_the_command_line(ten_b_json, args, message):
    code, out, err = _cli("--model", ten_b_json, *JOB, *args)
    assert code == 2 and out == ""
    assert message in err, err


def test_the_gpus_per_node_of_a_file_are_the_jobs(tmp_path, ten_b_json):
    """A node of 4 (the file's): 12 GPUs fill 3 nodes; the same 12 on 8-GPU presets do not."""
    path = _file(tmp_path, gpus_per_node=4)
    code, out, _ = _cli(
        "--model",
        ten_b_json,
        "--seq-len",
        "512",
        "--global-batch",
        "48",
        "--gpus",
        "12",
        "--hardware",
        path,
        "--precision",
        "fp16",
    )
    assert code == 0 and "job: 12 GPUs (4 per node, 80 GiB each)" in out
