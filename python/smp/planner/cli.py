"""python -m smp.plan --model config.json --seq-len 512 --global-batch 64 --gpus 64
[--hardware a100-40gb|a100-80gb|h100-sxm|h200|FILE.json] [--gpus-per-node 8] [--gpu-memory 40GiB]
[--layout JSON] [--precision bf16] [--json]
[--scan-gpus 8,64,512,4096 [--scaling weak|strong|both] [--plot scan.png]]"""

from __future__ import annotations

import argparse
import json
import sys

from smp.planner import PRECISIONS, check_choices, facts_of, memory, plan, scan
from smp.planner.hardware_presets import DEFAULT, PRESETS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m smp.plan",
        description="Find the fastest smp layout that fits, walking SMP's Best Practices list in order.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a Hugging Face config.json, or a preset: mixtral-8x7b, olmoe-1b-7b, qwen1.5-moe-a2.7b",
    )
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="samples per step over every GPU")
    p.add_argument(
        "--gpus", type=int, help="GPUs of the job (with --scan-gpus: the size the batch is given for)"
    )
    p.add_argument(
        "--hardware",
        default=DEFAULT,
        help=f"a preset ({', '.join(PRESETS)}; default {DEFAULT}) or a JSON file describing the hardware",
    )
    p.add_argument("--gpus-per-node", type=int, help="default: the hardware's")
    p.add_argument("--gpu-memory", help="e.g. 40GiB, 80GB (default: the hardware's)")
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
    p.add_argument("--scan-gpus", help="plan at each of these cluster sizes, e.g. 8,64,512,4096")
    p.add_argument(
        "--scaling",
        choices=("weak", "strong", "both"),
        default="both",
        help="with --scan-gpus: weak (batch per GPU kept), strong (global batch kept) or both",
    )
    p.add_argument("--plot", help="with --scan-gpus: write tokens/s per GPU against GPUs to this PNG")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        text = _scan(args) if args.scan_gpus else _plan(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _plan(args) -> str:
    if args.gpus is None:
        raise ValueError("smp.plan: give --gpus (the job's GPUs), or --scan-gpus to plan several sizes")
    result = plan(
        args.model,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_memory=args.gpu_memory,
        layout=_layout(args.layout),
        precision=args.precision,
        runtime=args.runtime,
        hardware=args.hardware,
    )
    return json.dumps(result.to_json(), indent=1) if args.json else result.table()


def _scan(args) -> str:
    if args.layout is not None:
        raise ValueError("smp.plan: --scan-gpus plans each size itself; leave out --layout")
    sizes = scan.parse_sizes(args.scan_gpus)
    check_choices(args.precision, args.runtime)
    facts = facts_of(args.model, args.seq_len)
    scalings = scan.SCALINGS if args.scaling == "both" else (args.scaling,)
    points = scan.scan(
        facts,
        sizes,
        args.seq_len,
        args.global_batch,
        args.gpus or sizes[0],
        scalings,
        hardware=args.hardware,
        gpus_per_node=args.gpus_per_node,
        gpu_memory=args.gpu_memory,
        precision=args.precision,
        runtime=args.runtime,
    )
    if args.plot:
        title = f"{facts.parameters / 1e9:.1f}B parameters, sequence {args.seq_len}, on {args.hardware}"
        scan.plot(points, args.plot, title)
    if args.json:
        return json.dumps(scan.to_json(points), indent=1)
    reference = args.gpus or sizes[0]
    lines = [
        f"model: {facts.parameters / 1e9:.2f}B parameters{_moe(facts)} ({facts.source}); "
        f"hardware: {args.hardware}; "
        f"global batch {args.global_batch} at {reference} GPUs, sequence {args.seq_len}",
        "",
        scan.table(points),
    ]
    if args.plot:
        lines.append(f"\nplot: {args.plot}")
    return "\n".join(lines)


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


def _moe(facts) -> str:
    if not facts.experts:
        return ""
    return (
        f", {facts.active_parameters / 1e9:.2f}B per token ({facts.experts} experts, top-{facts.top_k}, "
        f"{facts.moe_layers} MoE layers)"
    )
