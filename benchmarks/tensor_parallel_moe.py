"""Tensor parallelism on a mixture-of-experts model: smp against torch-native plans, same run.

    torchrun --standalone --nproc_per_node=2 benchmarks/tensor_parallel_moe.py [--steps 10] [--json FILE]

(with the package installed, or PYTHONPATH=python from the repository root)

The model is Hugging Face's Mixtral as transformers builds it (expert banks stored as 3-D
parameters and applied with a grouped matmul, top-2 routing), from a small config. Two processes;
every contestant trains its own copy (same seed, same weights, same batches):

  smp      tensor_parallel_degree=2, the model built under smp.tensor_parallelism(): the attention
           and every expert cut as column/row pairs (each expert's gate/up by output features, its
           down by input features), the router whole, prescaled batch (both ranks read it).
  dtensor  torch.distributed.tensor.parallel on what its styles can cut: ColwiseParallel on q, k, v,
           RowwiseParallel on o (transformers infers the local head count); the expert banks and
           the router stay whole on both ranks: DTensor's Linear styles do not apply to 3-D banks
           used by a grouped matmul.
  ddp      DistributedDataParallel: the whole model on each rank, each on half the batch.

Reported per contestant: the median step time over rounds (one step of each in rotating order,
started after a barrier, the slower rank's time), its ratio to smp, and the parameter bytes one
rank holds. The losses are checked against one process on the same batch.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import smp
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

# LR, build and batch are expert_parallel_moe.py's too (it imports them): both benchmarks train
# the same Mixtral on the same batches.
LR = 1e-3


def build(args):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=args.seq,
        router_aux_loss_coef=0.0,
    )
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def batch(step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def smp_run(model):
    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.Adam(dmodel.parameters(), lr=LR))

    @smp.step
    def train_step(ids):
        loss = loss_of(dmodel, ids)
        dmodel.backward(loss)
        return loss

    def run(ids):
        opt.zero_grad()
        loss = train_step(ids).reduce_mean()
        opt.step()
        return loss.item()

    return dmodel, run


def eager_run(model, rows=None):
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def run(ids):
        opt.zero_grad()
        loss = loss_of(model, ids if rows is None else ids[rows])
        loss.backward()
        opt.step()
        if rows is not None:  # the global batch's loss, as the others report it
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        return loss.item()

    return run


def dtensor_plan(model, mesh):
    for layer in model.model.layers:
        parallelize_module(
            layer.self_attn,
            mesh,
            {
                "q_proj": ColwiseParallel(),
                "k_proj": ColwiseParallel(),
                "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel(),
            },
        )
    return model


def local_bytes(params) -> int:
    total = 0
    for p in params:
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def measure(args) -> dict:
    torch.set_num_threads(1)  # two processes share the machine's cores
    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    rank = smp.rank()
    gloo = dist.new_group(backend="gloo")
    mesh = DeviceMesh.from_group(gloo, "cpu")
    with smp.tensor_parallelism():
        marked = build(args)
    reference = build(args)
    smp_model, smp_step = smp_run(marked)
    ddp = DistributedDataParallel(copy.deepcopy(reference), process_group=gloo)
    half = args.batch // 2
    dtensor_model = dtensor_plan(copy.deepcopy(reference), mesh)
    runs = {
        "smp": smp_step,
        "dtensor": eager_run(dtensor_model),
        "ddp": eager_run(ddp, rows=slice(rank * half, (rank + 1) * half)),
    }
    single = eager_run(reference)
    for run in runs.values():  # warm-up: smp captures and shards on its first step
        run(batch(-1, args))
    single(batch(-1, args))
    times = {name: [] for name in runs}
    losses = {name: [] for name in runs}
    names = list(runs)
    for step in range(args.steps):
        ids = batch(step, args)
        for name in names[step % len(names) :] + names[: step % len(names)]:
            dist.barrier(group=gloo)
            start = time.perf_counter()
            losses[name].append(runs[name](ids))
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=gloo)
            times[name].append(took.item())
    single_losses = [single(batch(step, args)) for step in range(args.steps)]
    param_bytes = {
        "smp": local_bytes(p for _, p in smp_model.local_named_parameters()),
        "dtensor": local_bytes(dtensor_model.parameters()),
        "ddp": local_bytes(ddp.module.parameters()),
    }
    result = {
        "config": vars(args),
        "median_s": {n: statistics.median(t) for n, t in times.items()},
        "param_bytes": param_bytes,
        "loss_err": {
            n: max(abs(a - b) / abs(b) for a, b in zip(ls, single_losses, strict=True))
            for n, ls in losses.items()
        },
        "tp_share": smp_model.tensor_parallel_report().sharded_share,
    }
    return result if rank == 0 else None


def _max_rel_err(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def report(r: dict) -> None:
    base = r["median_s"]["smp"]
    print(f"Mixtral {r['config']}; smp shards {r['tp_share']:.0%} of the marked matrix bytes")
    print(f"{'contestant':<10} {'median step':>12} {'vs smp':>8} {'param MiB/rank':>15} {'loss rel err':>13}")
    for name, seconds in r["median_s"].items():
        print(
            f"{name:<10} {seconds * 1e3:>10.1f}ms {seconds / base:>7.2f}x "
            f"{r['param_bytes'][name] / 2**20:>15.2f} {r['loss_err'][name]:>13.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (one step of each contestant)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--json", help="rank 0 also writes the results to this file")
    args = parser.parse_args()
    result = measure(args)
    if result is not None:
        report(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
