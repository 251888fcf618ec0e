"""Checkpoint save and load: smp against plain torch.save/torch.load and DCP used directly, in the same run.

    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint.py --layout rdp2
    torchrun --standalone --nproc_per_node=4 benchmarks/checkpoint.py --layout pp2tp2
        [--dim 768 --layers 12 --vocab 8192] [--repeats 3] [--dir DIR] [--json FILE]

(with the package installed, or PYTHONPATH=python from the repository root)

The model is the tests' GPT (tests/python/models.py; tied embedding and head) at about 100M
parameters with the defaults, trained one Adam step so that the optimizer holds its moments.
rdp2 shards the optimizer state over the two replicas (ZeRO-1); pp2tp2 is two pipeline stages of
two tensor-parallel ranks. Each measurement is taken `--repeats` times after a barrier; a
collective operation lasts until its slowest rank is done, so each time is the maximum over ranks,
and the table shows the median over repeats. Bytes are what the folder holds on disk.

  smp partial   smp.save_checkpoint(partial=True): a DCP folder, each rank writing its own slices in
                global coordinates; resume = smp.resume_from_checkpoint on the same layout (each rank
                reads only the chunks its slices overlap).
  smp full      smp.save_checkpoint(partial=False): slices gathered to rank 0, written as whole
                tensors in two torch.save files; resume = every rank memory-maps them, copies its slices.
  torch.save    each rank torch.saves its own local state (model.local_state_dict() and
                optimizer.local_state_dict()) to a file of its own, fsynced; load = torch.load and
                load_state_dict. Resumes only on the same layout: the floor for the I/O.
  dcp direct    torch.distributed.checkpoint.save of the same per-rank local state dicts under
                rank-prefixed keys (nothing tells DCP which tensors are replicas or slices of one
                another, so every rank writes all it holds); load = dcp.load and load_state_dict.
  smp async     smp.save_checkpoint(partial=True, async_save=True): the pause is the time until the
                call returns (the state copied to host memory); then training steps run while a
                background thread writes, and the step time is compared with steps without a save.

The files go to --dir (default: a fresh folder under /tmp); the page cache is not dropped, so loads
read from memory unless the machine is short of it: these are the costs of smp's own work
(planning, gathering, copying), not of the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import smp
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import models  # noqa: E402  (the tests' GPT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_background as background  # noqa: E402  (the async_save part)

LAYOUTS = {
    "one": {},
    "rdp2": {"shard_optimizer_state": True},
    "pp2tp2": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="rdp2")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per replica and step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--part",
        choices=("all", "formats", "background"),
        default="all",
        help="formats: the four contestants' saves and loads; background: async_save against a "
        "synchronous save of the same state",
    )
    p.add_argument(
        "--launch-bound",
        type=int,
        default=0,
        metavar="N",
        help="background part: time 'steps' of N tiny tensor ops instead of training steps (a GPU "
        "host's training thread, which only launches kernels: what a writer holding the "
        "interpreter delays)",
    )
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a fresh folder in /tmp)")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    return p.parse_args()


def timed(fn) -> float:
    """Seconds `fn` takes on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def folder_bytes(path: str) -> int:
    return int(subprocess.run(["du", "-sb", path], capture_output=True, text=True).stdout.split()[0])


def main() -> None:
    args = parse_args()
    smp.init(LAYOUTS[args.layout])
    rank = smp.rank()
    torch.manual_seed(0)
    with smp.tensor_parallelism(smp.tp_size() > 1):
        module = models.GPT(args.vocab, args.dim, args.heads, args.layers, args.seq)
    n_params = sum(p.numel() for p in module.parameters())
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(ids):
        loss = models.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    def step() -> None:
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        opt.zero_grad()
        train_step(ids)
        opt.step()

    step()
    base = args.dir or (tempfile.mkdtemp(prefix="smp_ckpt_bench_") if rank == 0 else None)
    holder = [base]
    dist.broadcast_object_list(holder, src=0)
    base = holder[0]
    result: dict = {"layout": args.layout, "params": n_params}
    if args.part in ("all", "formats"):
        result |= measure_formats(args, base, model, opt)
    if args.part in ("all", "background"):
        steps = background.launches(args.launch_bound) if args.launch_bound else step
        result["background"] = background.measure(args.repeats, f"{base}/smp", model, opt, steps, timed)
    if rank == 0:
        print(
            f"layout {args.layout}, world {smp.size()}, {n_params / 1e6:.1f}M parameters, Adam, "
            f"{args.repeats} repeats (median; max over ranks); load average {os.getloadavg()[0]:.1f}"
        )
        if "median_s" in result:
            report_formats(result["median_s"], result["bytes"])
        if "background" in result:
            background.report(result["background"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    smp.barrier()


def measure_formats(args, base: str, model, opt) -> dict:
    """Each contestant's save and load, `args.repeats` times (rank 0's result holds the bytes)."""
    rank = smp.rank()
    times: dict[str, list[float]] = {}

    def measure(name: str, fn) -> None:
        times.setdefault(name, []).append(timed(fn))

    def local_state() -> dict:
        return {"model": model.local_state_dict(), "optimizer": opt.local_state_dict()}

    def torch_save() -> None:
        with open(f"{base}/torch/rank{rank}.pt", "wb") as f:
            torch.save(local_state(), f)
            f.flush()
            os.fsync(f.fileno())

    def torch_load() -> None:
        state = torch.load(f"{base}/torch/rank{rank}.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    def dcp_save() -> None:
        dcp.save({f"rank{rank}": local_state()}, storage_writer=dcp.FileSystemWriter(f"{base}/dcp"))

    def dcp_load() -> None:
        state = {f"rank{rank}": local_state()}
        dcp.load(state, storage_reader=dcp.FileSystemReader(f"{base}/dcp"))
        model.load_state_dict(state[f"rank{rank}"]["model"])
        opt.load_state_dict(state[f"rank{rank}"]["optimizer"])

    if rank == 0:
        os.makedirs(f"{base}/torch", exist_ok=True)
    for _ in range(args.repeats):
        measure(
            "smp partial save", lambda: smp.save_checkpoint(f"{base}/smp", "p", model=model, optimizer=opt)
        )
        measure("smp partial load", lambda: smp.resume_from_checkpoint(f"{base}/smp", tag="p"))
        measure(
            "smp full save",
            lambda: smp.save_checkpoint(f"{base}/smp", "f", partial=False, model=model, optimizer=opt),
        )
        measure("smp full load", lambda: smp.resume_from_checkpoint(f"{base}/smp", tag="f", partial=False))
        measure("torch.save save", torch_save)
        measure("torch.save load", torch_load)
        measure("dcp direct save", dcp_save)
        measure("dcp direct load", dcp_load)
    sizes = {}
    if rank == 0:
        sizes = {
            "smp partial": folder_bytes(f"{base}/smp/p_partial"),
            "smp full": folder_bytes(f"{base}/smp/f"),
            "torch.save": folder_bytes(f"{base}/torch"),
            "dcp direct": folder_bytes(f"{base}/dcp"),
        }
    return {"median_s": {k: statistics.median(v) for k, v in times.items()}, "bytes": sizes}


def report_formats(median: dict, sizes: dict) -> None:
    print(f"{'':16} {'save s':>8} {'load s':>8} {'MB':>8}   save vs torch.save / dcp direct")
    for name in ("smp partial", "smp full", "torch.save", "dcp direct"):
        save, load = median[f"{name} save"], median[f"{name} load"]
        ratio = f"{save / median['torch.save save']:.2f}x / {save / median['dcp direct save']:.2f}x"
        print(f"{name:16} {save:8.3f} {load:8.3f} {sizes[name] / 1e6:8.1f}   {ratio}")


if __name__ == "__main__":
    main()
