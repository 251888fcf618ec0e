"""How a training runtime spends memory traffic and communication outside the model's own
kernels: accumulating gradients over microbatches, averaging them over replicas, stepping the
optimizer, sending activations between pipeline stages, and the pipeline's bubble.

SMP is smp's runtime (python/smp/data_parallel/grad_sync.py, optim/flat_state.py, schedules/).
The Megatron-LM entries describe the runtime of the published measurements the step-time model
is checked against (tests/python/megatron_table1.json): Megatron-LM as of its SC'21 paper, with
its fused kernels, fp16 gradients and interleaved 1F1B schedule.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RuntimeCosts:
    name: str
    # Bytes moved per parameter and microbatch to add a microbatch's gradient into the kept one.
    accumulate_half: float
    accumulate_fp32: float
    # Bytes per parameter the data-parallel average reduces.
    averaged_half: float
    averaged_fp32: float
    # Bytes moved per parameter the optimizer steps (on the rank's chunk where it is sharded).
    optimizer_half: float
    optimizer_fp32: float
    # Whether the average runs in buckets during the last microbatch's backward (overlapped where
    # the hardware runs communication beside compute), or after the backward.
    overlapped_average: bool
    # Pipeline messages cut over the tensor-parallel ranks, each sending its part across nodes,
    # then all-gathered inside the node (Megatron's scatter/gather), or sent whole by every rank.
    scatter_gather: bool = False
    # Megatron's interleaved schedule: model chunks per rank (its bubble is (pp - 1) / (v m)); 0
    # for smp, whose bubble is read off its own schedule's timeline.
    virtual_stages: int = 0
    # The logits leave the model whole (gathered over tp and cp for the script, as smp returns a
    # model's outputs); Megatron's loss reads its vocabulary-parallel logits where they are.
    gathers_logits: bool = True
    # Under tp, collectives bringing the tp group's inputs together per microbatch (smp: one
    # all-gather per input tensor, a causal LM's ids and labels; Megatron's broadcast_data: the
    # sizes, then the data), and the vocabulary-parallel cross-entropy's all-reduces (smp: the
    # maximum, then the sum of exponentials and the target logit together; Megatron SC'21: three).
    input_collectives: int = 2
    loss_all_reduces: int = 2

    def accumulate(self, half: bool) -> float:
        return self.accumulate_half if half else self.accumulate_fp32

    def averaged(self, half: bool) -> float:
        return self.averaged_half if half else self.averaged_fp32

    def optimizer(self, half: bool) -> float:
        return self.optimizer_half if half else self.optimizer_fp32


SMP = RuntimeCosts(
    name="smp",
    # bf16/fp16: the low-precision gradient read (2) and added into its fp32 buffer (read 4, write
    # 4); fp32: autograd adds the new gradient (4) into the buffer in place (4 + 4).
    accumulate_half=10,
    accumulate_fp32=12,
    averaged_half=4,  # one fp32 gradient buffer, averaged in place, in either precision
    averaged_fp32=4,
    # Adam(W) on the flat fp32 chunk: read gradient, master, two moments (16), write master and
    # moments (12); under bf16/fp16 the master written back to the parameter (2).
    optimizer_half=30,
    optimizer_fp32=28,
    overlapped_average=True,
)

# Megatron-LM (SC'21): fp16 gradients accumulated in the parameters' dtype (read 2 + 2, write 2)
# and averaged in fp16; the fp16 optimizer copies them to fp32 (6), unscales and checks them
# (8), takes their norm (4), steps Adam (28) and copies the fp32 weights back to fp16 (6).
_MEGATRON = dict(
    accumulate_half=6,
    accumulate_fp32=12,
    averaged_half=2,
    averaged_fp32=4,
    optimizer_half=52,
    optimizer_fp32=28,
    scatter_gather=True,
    gathers_logits=False,
    loss_all_reduces=3,
)
# --DDP-impl local: the fp16 gradient buffer all-reduced once the backward is done.
MEGATRON_LOCAL_DDP = RuntimeCosts(name="megatron-lm (local DDP)", overlapped_average=False, **_MEGATRON)
# --DDP-impl torch: torch's DistributedDataParallel, buckets averaged during the backward.
MEGATRON_TORCH_DDP = RuntimeCosts(name="megatron-lm (torch DDP)", overlapped_average=True, **_MEGATRON)
