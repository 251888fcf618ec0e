"""Two-process demo of the "smp" c10d backend (docs/backend.md; the main job is train_gpt2.py).

    torchrun --standalone --nproc_per_node=2 examples/backend_demo.py

Initializes torch.distributed with backend="smp", runs a tour of collectives on
CPU tensors (Gloo inside) and, where a GPU is visible, on CUDA tensors (NCCL
inside, throttled), checks every result against a locally computed reference
and prints the backend's throttle statistics.
"""

from __future__ import annotations

import os

import smp
import torch
import torch.distributed as dist


def check(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected)
    if dist.get_rank() == 0:
        print(f"  {name:<24} ok  {actual.flatten()[:4].tolist()}")


def tour(device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = torch.arange(world, dtype=torch.float32, device=device)

    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    check("all_reduce(SUM)", t, torch.full_like(t, float((ranks + 1).sum())))

    t = torch.full((4,), float(rank), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    check("all_reduce(MAX)", t, torch.full_like(t, float(world - 1)))

    out = torch.empty(world * 2, device=device)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=device))
    check("all_gather_into_tensor", out, ranks.repeat_interleave(2))

    out = torch.empty(1, device=device)
    dist.reduce_scatter_tensor(out, torch.ones(world, device=device) * (rank + 1))
    check("reduce_scatter_tensor", out, torch.full_like(out, float((ranks + 1).sum())))

    send = torch.arange(world, dtype=torch.float32, device=device) + 10 * rank
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    check("all_to_all_single", recv, ranks * 10 + rank)

    works = [dist.all_reduce(torch.ones(1024, device=device), async_op=True) for _ in range(32)]
    for w in works:
        w.wait()
    objs = [{"hello": "from rank 0"} if rank == 0 else None]
    dist.broadcast_object_list(objs, src=0)
    assert objs[0] == {"hello": "from rank 0"}
    dist.barrier()


def main() -> None:
    if "RANK" not in os.environ:
        raise SystemExit("run me under torchrun: torchrun --standalone --nproc_per_node=2 " + __file__)
    dist.init_process_group(backend="smp")
    rank = dist.get_rank()
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local % torch.cuda.device_count())
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    for device in devices:
        if rank == 0:
            print(f"smp backend, {dist.get_world_size()} processes, {device.type} tensors:")
        tour(device)
    if rank == 0:
        for device, stats in smp.backend_stats().items():
            print(f"throttle stats ({device}): {stats}")
        print("demo finished: every collective matched its reference")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
