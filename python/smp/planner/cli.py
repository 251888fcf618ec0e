"""python -m smp.plan --model config.json --seq-len 512 --global-batch 64 --gpus 64
[--gpus-per-node 8] [--gpu-memory 40GiB] [--layout JSON] [--precision bf16] [--json]"""

from __future__ import annotations

import argparse
import json
import sys

from smp.planner import PRECISIONS, memory, plan


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m smp.plan",
        description="Find the first smp layout that fits, following SMP's Best Practices list in order.",
    )
    p.add_argument("--model", required=True, help="a Hugging Face config.json")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="samples per step over every GPU")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", default="40GiB", help="e.g. 40GiB, 80GB")
    p.add_argument("--layout", help="evaluate one smp config (JSON), e.g. '{\"tensor_parallel_degree\": 4}'")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="for the walk (default bf16); a --layout is read as smp.init reads it (fp32 unless fp16/bf16)",
    )
    p.add_argument(
        "--runtime",
        choices=tuple(memory.RUNTIMES),
        default="smp",
        help="whose buffers to model: smp's (default) or SMP v1's (the seed's reference table)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        layout = _layout(args.layout)
        result = plan(
            args.model,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            gpu_memory=args.gpu_memory,
            layout=layout,
            precision=args.precision,
            runtime=args.runtime,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=1) if args.json else result.table())
    return 0


def _layout(text: str | None):
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"smp.plan: --layout is not valid JSON ({e}): {text!r}; pass an object such as "
            '\'{"pipeline_parallel_degree": 2, "activation_checkpointing": "each"}\''
        ) from e
