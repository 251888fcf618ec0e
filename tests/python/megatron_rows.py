"""The Megatron-LM paper's Table 1 (megatron_table1.json) as planner inputs, and the planner's
prediction of each row's TFLOP/s per GPU (test_planner_megatron.py checks it, the table in
docs/planner.md prints it: `python tests/python/megatron_rows.py`).

Each row runs the paper's layout on the paper's hardware (the a100-80gb preset: DGX A100 80GB,
8 x 200 Gbps InfiniBand per node) with Megatron-LM's runtime costs (smp.planner.runtime_costs):
fp16, activation recomputation of every layer, its interleaved schedule's (pp - 1) / (v m)
bubble. Nothing is fitted to the rows: the hardware's figures are the preset's, with their
public sources. The published TFLOP/s count the recomputation (the paper's equation (3)), so the
prediction divides that same count by the predicted step time.
"""

from __future__ import annotations

import dataclasses
import json
import os

from smp.planner import hardware, memory, model_facts, step_time
from smp.planner.layout import Layout
from smp.planner.runtime_costs import MEGATRON_LOCAL_DDP, MEGATRON_TORCH_DDP

HERE = os.path.dirname(os.path.abspath(__file__))
TABLE = os.path.join(HERE, "megatron_table1.json")
SEQ, VOCAB = 2048, 51200


def load() -> dict:
    with open(TABLE) as f:
        return json.load(f)


def config(row: dict) -> dict:
    """A GPT as Megatron-LM built it: tied embeddings, learned positions, MLP 4h with a fused
    GeLU (it saves its input only), dropout 0.1, attention that materializes its scores."""
    return {
        "model_type": "gpt2",
        "n_embd": row["hidden"],
        "n_layer": row["layers"],
        "n_head": row["heads"],
        "vocab_size": VOCAB,
        "n_positions": SEQ,
        "activation_function": "gelu",
        "resid_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_implementation": "eager",
    }


def layout(row: dict) -> Layout:
    replicas = row["gpus"] // (row["tp"] * row["pp"])
    microbatches = row["batch"] // replicas // row["microbatch"]
    return Layout(
        pp=row["pp"], tp=row["tp"], rdp=replicas, checkpointing="each", microbatches=microbatches, fp16=True
    )


def runtime(row: dict):
    costs = MEGATRON_TORCH_DDP if row["ddp"] == "torch" else MEGATRON_LOCAL_DDP
    per_rank = row["layers"] // row["pp"]
    chunks = per_rank // row["layers_per_virtual_stage"] if row["layers_per_virtual_stage"] else 1
    return dataclasses.replace(costs, virtual_stages=chunks)


def workload(row: dict) -> memory.Workload:
    hw = hardware.load(load()["facts"]["hardware_preset"])
    return memory.Workload(SEQ, row["batch"], row["gpus"], hw.gpus_per_node, hw.memory, hw)


def paper_flops(row: dict) -> float:
    """FLOPs per iteration as the paper counts them (its equation (3), recomputation included)."""
    b, s, layers, h, v = row["batch"], SEQ, row["layers"], row["hidden"], VOCAB
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def predict(row: dict) -> tuple[float, step_time.StepTime]:
    """(predicted TFLOP/s per GPU as the paper counts them, the step's breakdown)."""
    facts = model_facts.from_hf_config(config(row), SEQ)
    step = step_time.estimate(facts, layout(row), workload(row), runtime(row))
    return paper_flops(row) / step.total / row["gpus"] / 1e12, step


def table() -> str:
    lines = [
        "| model | GPUs | TP | PP | batch | published TFLOP/s | predicted | error | step s | bubble | "
        "TP comm | memory-bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in load()["rows"]:
        tflops, step = predict(row)
        t = step.total
        lines.append(
            f"| {row['name']} | {row['gpus']} | {row['tp']} | {row['pp']} | {row['batch']} | "
            f"{row['tflops_per_gpu']} | {tflops:.1f} | {tflops / row['tflops_per_gpu'] - 1:+.1%} | {t:.2f} | "
            f"{step.bubble / t:.1%} | {step.tp_comm / t:.1%} | {step.memory / t:.1%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
