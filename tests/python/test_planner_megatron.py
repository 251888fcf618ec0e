"""The step-time model against published measurements at scale: every row of the Megatron-LM
paper's weak-scaling table (Narayanan et al., SC'21, Table 1: GPT 1.7B to 1T on 32 to 3072 A100s),
predicted from the paper's layout and hardware alone, within 15% of the published TFLOP/s per GPU
(megatron_rows.py builds the inputs; megatron_table1.json holds the rows and their source)."""

from __future__ import annotations

import dataclasses

import megatron_rows
import pytest
from smp.planner.runtime_costs import MEGATRON_LOCAL_DDP

GOAL = 0.15
ROWS = megatron_rows.load()["rows"]


def test_the_data_file_states_its_source_and_is_consistent():
    table = megatron_rows.load()
    assert "arXiv:2104.04473" in table["source"] and "Table 1" in table["source"]
    assert "run_table_1.sh" in table["layout_source"]
    assert [r["name"] for r in ROWS][0] == "1.7B" and ROWS[-1]["gpus"] == 3072 and len(ROWS) == 10
    for row in ROWS:
        replicas, rest = divmod(row["gpus"], row["tp"] * row["pp"])
        assert rest == 0 and row["batch"] % (replicas * row["microbatch"]) == 0
        # The published columns agree with each other: aggregate = per GPU x GPUs, % of 312.
        assert row["tflops_per_gpu"] * row["gpus"] / 1000 == pytest.approx(row["aggregate_pflops"], rel=0.01)
        assert row["tflops_per_gpu"] / 312 == pytest.approx(row["percent_of_peak"] / 100, abs=0.006)
        # The paper's FLOP count is the model's: 4 forwards of the layers (recomputation) and 3 of
        # the head, from the config the row builds.
        facts = megatron_rows.model_facts.from_hf_config(megatron_rows.config(row), megatron_rows.SEQ)
        per_token = 4 * row["layers"] * facts.layer_flops_per_token + 3 * facts.head_flops_per_token
        flops = per_token * row["batch"] * megatron_rows.SEQ
        assert flops == pytest.approx(megatron_rows.paper_flops(row), rel=0.001)  # biases, norms


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_each_row_within_15_percent_of_the_published_tflops(row):
    predicted, step = megatron_rows.predict(row)
    assert abs(predicted / row["tflops_per_gpu"] - 1) <= GOAL, (row["name"], predicted, step.parts())


def test_the_rows_need_what_the_model_counts():
    """The interleaving counts: with one model chunk per rank the 76.1B row's bubble is
    (pp - 1) / m = 3 / 28, not 3 / 84, and its throughput lower."""
    row = next(r for r in ROWS if r["name"] == "76.1B")
    interleaved, _ = megatron_rows.predict(row)
    facts = megatron_rows.model_facts.from_hf_config(megatron_rows.config(row), megatron_rows.SEQ)
    one_chunk = dataclasses.replace(MEGATRON_LOCAL_DDP, virtual_stages=1)
    plain = megatron_rows.step_time.estimate(
        facts, megatron_rows.layout(row), megatron_rows.workload(row), one_chunk
    )
    assert megatron_rows.paper_flops(row) / plain.total / row["gpus"] / 1e12 < interleaved
    assert plain.bubble / plain.total > 2 * (3 / 84)  # (pp - 1) / m = 3 / 28 against 3 / 84
