"""A GPT-2 training script in the patterns of AWS's SMP v1 GPT-2 notebook, whose smp lines run
unchanged (the smdistributed imports resolve to smp's alias package): smp.init with the
notebook's config keys, the model built in smp.model_creation, model.get_module(),
smp.set_partition, the pipeline ranks' data handshake over smp.RankType.PP_RANK,
DistributedOptimizer with dynamic-loss-scaling arguments (no effect outside fp16, as in SMP),
optimizer.overflow guarding the LR scheduler, backward_passes_per_step for gradient
accumulation, and smp.save_checkpoint / smp.resume_from_checkpoint.

Run: torchrun --standalone --nproc_per_node=2 examples/v1_gpt2_notebook.py [--bf16 1]
"""

from __future__ import annotations

import argparse
import json

import smdistributed.modelparallel
import smdistributed.modelparallel.torch as smp
import torch
from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2
from transformers import AutoModelForCausalLM, GPT2Config

SEQ, VOCAB = 16, 64


def model_config():
    return GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def token_batches(n: int, batch: int):
    g = torch.Generator().manual_seed(7)
    start = torch.randint(0, VOCAB, (n, batch, 1), generator=g)
    return (start + torch.arange(SEQ)) % VOCAB  # counting sequences: learnable


def batches_for_this_stage(n: int, batch: int):
    """The notebook's handshake: pipeline stage 0 builds the data, later stages receive it."""
    if smp.pp_size() == 1:
        return token_batches(n, batch)
    if smp.pp_rank() == 0:
        data = token_batches(n, batch)
        for stage in range(1, smp.pp_size()):
            smp.send(data, stage, smp.RankType.PP_RANK)
        return data
    return smp.recv_from(0, smp.RankType.PP_RANK)


@smp.step
def train_step(model, input_ids, attention_mask, passes):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss / passes)
    return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline_parallel_degree", type=int, default=2)
    parser.add_argument("--bf16", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)  # optimizer steps
    parser.add_argument("--gradient_accumulation", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--checkpoint_dir", default="")
    parser.add_argument("--resume", type=int, default=0)
    parser.add_argument("--results", default="")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    smp_config = {
        "ddp": True,
        "tensor_parallel_degree": 1,
        "pipeline_parallel_degree": args.pipeline_parallel_degree,
        "microbatches": 2,
        "shard_optimizer_state": False,
        "prescaled_batch": False,
        "fp16": False,
        "bf16": args.bf16 > 0,
        "offload_activations": False,
        "delayed_parameter_initialization": False,
        "optimize": "speed",
        "placement_strategy": "cluster",
        "activation_loading_horizon": 4,
        "skip_tracing": False,
        "auto_partition": False,
        "default_partition": 0,
        "static_mode": True,
        "fast_mode": False,
        "sharded_data_parallel_degree": 1,
        "sdp_hierarchical_allgather": True,
        "sdp_gradient_clipping": 1.0,
        "ddp_dist_backend": "auto",
    }
    smp.init(smp_config)
    if smp.rank() == 0:
        print(f"smdistributed.modelparallel version: {smdistributed.modelparallel.__version__}")

    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.bf16 else torch.get_default_dtype()
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=dtype, attention_in_fp32=False):
        model = AutoModelForCausalLM.from_config(model_config())
    if args.pipeline_parallel_degree > 1:  # the notebook's manual partition: later layers on the last stage
        smp.set_partition(model.transformer.h[-1], args.pipeline_parallel_degree - 1)
        smp.set_partition(model.transformer.ln_f, args.pipeline_parallel_degree - 1)

    model = smp.DistributedModel(model, backward_passes_per_step=args.gradient_accumulation)
    num_params = sum(p.numel() for p in model.get_module().parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    optimizer = smp.DistributedOptimizer(
        optimizer,
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
    )
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if args.resume:
        user_content = smp.resume_from_checkpoint(args.checkpoint_dir, tag=None, partial=True)
        start = user_content["step"]
    else:
        start = 0

    data = batches_for_this_stage((start + args.steps) * args.gradient_accumulation, args.batch)
    losses, overflows = [], []
    model.train()
    for step in range(start, start + args.steps):
        optimizer.zero_grad(set_to_none=True)
        for k in range(args.gradient_accumulation):
            input_ids = data[step * args.gradient_accumulation + k]
            loss_mb = train_step(model, input_ids, torch.ones_like(input_ids), args.gradient_accumulation)
            losses.append(loss_mb.reduce_mean().item())
        optimizer.step()
        overflows.append(optimizer.overflow)
        if not optimizer.overflow:
            lr_scheduler.step()
    if args.checkpoint_dir and not args.resume:
        smp.save_checkpoint(
            args.checkpoint_dir, tag=f"step_{start + args.steps}", partial=True, model=model,
            optimizer=optimizer, user_content={"step": start + args.steps},
        )  # fmt: skip
    full = translate_state_dict_to_hf_gpt2(model.state_dict(), max_seq_len=SEQ)  # a collective
    if smp.rank() == 0:
        print(f"{num_params} parameters, losses {losses}, overflow {overflows}", flush=True)
        if args.results:
            params = {k: v.float().tolist() for k, v in full.items()}
            with open(args.results, "w") as f:
                json.dump({"losses": losses, "overflow": overflows, "params": params}, f)
    smp.barrier()


if __name__ == "__main__":
    main()
