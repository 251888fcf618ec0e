"""The planner's memory model against real smp runs on CPU (test_plan.py runs it as a test,
benchmarks/plan_memory.py prints the table for docs/benchmarks.md).

A small Hugging Face GPT-2 trains two steps under each layout for one step; each rank measures
- the bytes of every distinct storage held by its parameters, their gradients (the fp32
  accumulation buffer beside bf16/fp16 ones too), the optimizer's state and its parameters
  (fp32 masters) and their gradients, and the module's buffers, after the last optimizer step
  (gradients not yet zeroed: every gradient copy is alive);
- the peak bytes autograd saved for backward on its stage (smp's saved-tensor meter,
  `model.track_saved_activations()`, or the same meter around the model call where smp runs the
  model whole; a storage counts once, parameters never). Tensors that checkpointed regions save
  while they are recomputed in backward are not seen by either.
CPU has no max_memory_allocated, and the profiler records no allocations made on smp's microbatch
threads, so the measured quantity is this sum of the two peaks, and the planner's `validated`
estimate is the same sum (parameters, gradients, optimizer state and masters, saved activations).
The planner's working memory, communication buffers and margin are not part of it.
"""

from __future__ import annotations

import contextlib

import torch
from smp.services.activation_meter import SavedActivationMeter

SEQ = 64
GLOBAL_BATCH = 8
GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 512,
    "n_positions": SEQ,
    "n_embd": 128,
    "n_layer": 4,
    "n_head": 4,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
# (name, smp config plus "activation_checkpointing"), for 2 ranks.
LAYOUTS = (
    ("pp2", {"pipeline_parallel_degree": 2, "microbatches": 2}),
    ("pp2 each", {"pipeline_parallel_degree": 2, "microbatches": 2, "activation_checkpointing": "each"}),
    ("tp2", {"tensor_parallel_degree": 2}),
    ("rdp2 sharded", {"shard_optimizer_state": True}),
    ("rdp2 sharded bf16", {"shard_optimizer_state": True, "bf16": True}),
)


def build_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**{k: v for k, v in GPT2.items() if k != "model_type"}))


def measure_layouts(rank: int, world_size: int, layouts=LAYOUTS) -> list[dict]:
    """Per layout, this rank's measured bytes (see the module's docstring)."""
    import smp

    torch.set_num_threads(1)
    results = []
    for name, layout in layouts:
        config = {k: v for k, v in layout.items() if k != "activation_checkpointing"}
        smp.init({**config, "ddp": True})
        results.append({"layout": name, **_train_and_measure(smp, layout)})
        smp.parallel_state.reset()
    return results


def distributed_gpt2(smp, layout: dict, build=build_gpt2):
    """A Hugging Face GPT-2 from `build` as smp runs it in `layout` (built under tensor parallelism
    where tp > 1; the layout's "activation_checkpointing" applied to its blocks)."""
    torch.manual_seed(0)
    with smp.tensor_parallelism(smp.tp_size() > 1):
        model = smp.DistributedModel(build())
    strategy = layout.get("activation_checkpointing", "none")
    if strategy != "none":
        smp.set_activation_checkpointing(model.get_module().transformer.h, strategy=strategy)
    return model


def _train_and_measure(smp, layout: dict) -> dict:
    model = distributed_gpt2(smp, layout)
    model.track_saved_activations()
    # smp's meter counts what its pipeline stages save; a model run whole (no pipeline, no TP)
    # has no stage, so the same meter class is wrapped around the call there.
    whole = SavedActivationMeter(model.parameters)
    run_whole = smp.pp_size() == 1 and smp.tp_size() == 1
    inner = torch.optim.Adam(model.parameters(), lr=1e-4)
    opt = smp.DistributedOptimizer(inner)

    @smp.step
    def train_step(ids):
        with whole.track() if run_whole else contextlib.nullcontext():
            out = model(input_ids=ids, labels=ids)
        model.backward(out.loss)
        return out.loss

    # No layout here prescales its batch: each data-parallel rank (TP ranks too) reads its own.
    per, index = GLOBAL_BATCH // smp.dp_size(), smp.dp_rank()
    for step in range(1):  # one step: the optimizer state exists after it, the gradients too
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, GPT2["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
        opt.zero_grad()
        train_step(ids[index * per : (index + 1) * per])
        opt.step()
    held = _held_bytes(smp, model, inner)
    saved = max(model.saved_activation_bytes()["peak"], whole.peak_bytes)
    return {**held, "activations": saved, "stage": smp.pp_rank()}


def _held_bytes(smp, model, inner) -> dict:
    """Bytes of distinct storages, by what holds them (a storage counts for the first holder)."""
    seen: set[int] = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                n += storage.nbytes()
        return n

    params = list(model.local_parameters())
    masters = [p for group in inner.param_groups for p in group["params"]]
    state = [
        v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return {
        "parameters": total(params) + total(model.get_module().buffers()),
        "gradients": total([p.grad for p in params])
        + total([smp.params.grad32(p) for p in params])
        + total([p.grad for p in masters]),
        "optimizer": total(state) + total(masters),
    }


def predict(model, layout: dict):
    """The planner's breakdown for `layout` on this validation's job (2 GPUs)."""
    import smp

    job = {"seq_len": SEQ, "global_batch": GLOBAL_BATCH, "gpus": 2, "gpus_per_node": 2, "gpu_memory": "1GiB"}
    return smp.plan(model, **job, layout=layout, precision="fp32").evaluated.breakdown


def run(rank: int, world_size: int) -> dict:
    """The launch test_plan.py makes: both ranks measure every layout; then, so that the test
    process itself never imports transformers, rank 0 asks the planner for its predictions (from
    the module and from its config) and rank 1 counts the parameters of the Hugging Face test
    models against the planner's counts from their configs."""
    out = {"measured": measure_layouts(rank, world_size)}
    if rank == 0:
        config = build_gpt2().config.to_dict()
        out["predicted"] = {
            name: {
                "module": predict(build_gpt2, layout).validated,
                "config": predict(config, layout).validated,
            }
            for name, layout in LAYOUTS
        }
        out["facts"] = {
            source: _facts(model) for source, model in (("module", build_gpt2), ("config", config))
        }
    else:
        out["parameters"] = _hf_parameter_counts()
    return out


def _facts(model) -> dict:
    import smp

    facts = smp.plan(model, seq_len=SEQ, global_batch=GLOBAL_BATCH, gpus=2).facts
    return {"source": facts.source, "parameters": facts.parameters, "tied": facts.tied.total}


def _hf_parameter_counts() -> dict:
    """{model: (the planner's count from its config, the real model's)} for GPT-2, Llama, BERT."""
    import hf_cases
    import smp

    counts = {}
    for build in (hf_cases.gpt2, hf_cases.llama, hf_cases.bert):
        model = build()
        facts = smp.plan(model.config.to_dict(), seq_len=16, global_batch=2, gpus=1).facts
        counts[type(model).__name__] = (facts.parameters, sum(p.numel() for p in model.parameters()))
    return counts
