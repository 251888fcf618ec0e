"""The main job: train a small Hugging Face GPT-2 with smp on a text corpus shipped in the repo.

    torchrun --standalone --nproc_per_node=4 examples/train_gpt2.py            # pp=2 x tp=2 on CPU
    torchrun --standalone --nproc_per_node=8 examples/train_gpt2.py --pp 2 --tp 2   # + rdp=2
    torchrun --standalone --nproc_per_node=2 examples/train_gpt2.py --model mixtral --pp 1 --tp 1 --ep 2
    torchrun --standalone --nproc_per_node=4 examples/train_gpt2.py --model mixtral --pp 2 --tp 1 --ep 2
    torchrun --standalone --nproc_per_node=2 examples/train_gpt2.py --pp 1 --tp 1 --cp 2 --seq-len 256

The model is transformers' GPT2LMHeadModel, unmodified, built from a small config (no
download). smp captures it, splits it into pipeline stages, shards its Conv1D layers and its
tied embedding over the tensor-parallel group, cuts every sequence over the context-parallel
group (--cp: each rank holds 2 of its 2 x cp chunks, attention passes keys and values around the
ring, or --cp-comm all_gather / a2a), and averages (or shards, with
--shard-optimizer-state) over the reduced-data-parallel replicas. The text is read as bytes:
vocabulary 256, no tokenizer to fetch.

Rank 0 shows a progress bar (loss, tokens/s), writes `<out-dir>/log.csv` (one row per
--log-every steps: the mean loss of those steps, read with one host sync) and
`<out-dir>/loss.png` at the end; with --timeline also `<out-dir>/timeline.json` (a Chrome
trace of a few steps) and `<out-dir>/timeline.png` (the pipeline schedule as it ran). With
--checkpoint-dir the job saves there every --save-every steps and at the end, and resumes from
the newest checkpoint it finds: under `torchrun --max-restarts=N` a job that lost a rank comes
back by itself and goes on from its last checkpoint, and a resume on fewer (or more) processes
keeps the checkpoint's global batch (more microbatches per rank), reading exactly the batches an
uninterrupted run would have read (each step's global batch is a function of the seed and the
step alone, each data-parallel rank taking its rows of it); --async-save writes the checkpoints
in the background. On machines with GPUs every rank
uses its local GPU and the collectives go through NCCL.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time
from pathlib import Path

import smp
import torch
from smp.schedules import SCHEDULES

HERE = Path(__file__).resolve().parent
TIMELINE_START, TIMELINE_STEPS = 11, 3  # a few steps once partitioning and first touches are over


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    layout = p.add_argument_group("layout (pp * tp * cp * rdp must equal the number of processes)")
    layout.add_argument("--pp", type=int, default=2, help="pipeline stages")
    layout.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    layout.add_argument("--rdp", type=int, default=None, help="data-parallel replicas (default: the rest)")
    layout.add_argument("--microbatches", type=int, default=4)
    layout.add_argument("--schedule", choices=SCHEDULES, default="interleaved")
    layout.add_argument("--shard-optimizer-state", action="store_true", help="ZeRO-1 over the replicas")
    layout.add_argument(
        "--sdp",
        type=int,
        default=1,
        help="sharded data parallel degree: parameters, gradients and optimizer state sharded over this "
        "many replicas (FSDP2; divides rdp; --clip is then sdp_gradient_clipping)",
    )
    layout.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert parallel degree (with --model mixtral): each layer's experts divided among this many "
        "replicas, tokens exchanged to them (divides rdp and --experts)",
    )
    layout.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context parallel degree: each sequence cut over this many ranks, which read the same batch "
        "(--seq-len divisible by 2 x cp)",
    )
    layout.add_argument(
        "--cp-comm", choices=["p2p", "all_gather", "a2a"], default="p2p", help="attention across the cp ranks"
    )
    layout.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 master weights")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank and step")
    train.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per step over every data-parallel rank (default: --batch-size x their number; "
        "a resumed run keeps its checkpoint's)",
    )
    train.add_argument(
        "--seq-len",
        type=int,
        default=64,
        help="tokens per sequence (the model's positions are made this many)",
    )
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="steps between loss logs (the only steps that wait for the loss: docs/shapes_and_compile.md)",
    )
    train.add_argument(
        "--dynamic-padding",
        action="store_true",
        help="rows of varied lengths, each batch padded to its longest row (new shapes: see the warning)",
    )
    train.add_argument("--compile", action="store_true", help="torch.compile each stage (inductor)")
    model = p.add_argument_group("model (GPT-2 shape)")
    model.add_argument(
        "--model",
        choices=["gpt2", "mixtral"],
        default="gpt2",
        help="gpt2, or transformers' Mixtral (mixture of experts, top-2, its load-balancing loss on)",
    )
    model.add_argument("--experts", type=int, default=4, help="experts per layer (--model mixtral)")
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--dim", type=int, default=128)
    model.add_argument("--heads", type=int, default=4)
    files = p.add_argument_group("files")
    files.add_argument("--corpus", default=str(HERE / "data" / "corpus.txt"))
    files.add_argument("--out-dir", default="runs/gpt2", help="log.csv and loss.png (rank 0)")
    files.add_argument("--checkpoint-dir", default=None, help="save here, and resume from the newest")
    files.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    files.add_argument(
        "--async-save",
        nargs="?",
        const="thread",
        choices=("thread", "process"),
        help="save in the background while training goes on: a writer thread (the default), or "
        "a writer process per rank",
    )
    files.add_argument(
        "--timeline",
        action="store_true",
        help=f"record {TIMELINE_STEPS} steps after warm-up: <out-dir>/timeline.json and timeline.png",
    )
    return p.parse_args()


def build_model(args):
    if args.model == "mixtral":
        return build_mixtral(args)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256,
        n_positions=args.seq_len,
        n_embd=args.dim,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # what transformers falls back to anyway, without its warning
    return model


def build_mixtral(args):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=256,
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        output_router_logits=True,  # the load-balancing loss, over the global batch under ep
        bos_token_id=0,
        eos_token_id=0,
    )
    model = MixtralForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


def batch_at(data: torch.Tensor, seq_len: int, global_batch: int, seed: int, step: int, rows: slice):
    """Step `step`'s global batch (random windows of the byte stream, a function of the seed and the
    step alone), rows `rows` of it: this data-parallel rank's."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len, (global_batch,), generator=g)[rows]
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()])


def padded_batch_at(
    data: torch.Tensor, seq_len: int, global_batch: int, seed: int, step: int, rows: slice, multiple: int = 1
):
    """As batch_at, rows of varied lengths (seq_len/4 to seq_len, as documents are), the batch
    right-padded to its longest row rounded up to `multiple` (tokenizer padding='longest' with
    pad_to_multiple_of: context parallelism cuts a sequence into 2 x cp chunks): (ids, attention
    mask, labels with -100 on pads). The lengths are the global batch's, the same on every rank: a
    tensor-parallel group runs its ranks' batches concatenated, so they must agree on
    every dim but the batch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (global_batch,), generator=g)
    longest = min(seq_len, -(-int(lengths.max()) // multiple) * multiple)
    # (windows drawn as if full length: the same rows whatever the padding rounds to)
    starts = torch.randint(0, len(data) - seq_len, (global_batch,), generator=g)[rows]
    ids = torch.stack([data[s : s + longest] for s in starts.tolist()])
    mask = (torch.arange(longest) < lengths[rows, None]).long()
    return ids * mask, mask, ids.masked_fill(mask == 0, -100)


def sizes(args, world: int) -> tuple[int, int, int]:
    """(global batch, this rank's batch, microbatches): a resumed run keeps its checkpoint's global
    batch and microbatch size, whatever the number of processes now (more microbatches per rank
    on fewer ranks)."""
    # Data-parallel ranks: the tensor-parallel ones each read their own rows, a cp group one batch.
    dp = world // (args.pp * args.cp)
    saved = smp.checkpoint.newest_user_content(args.checkpoint_dir) if args.checkpoint_dir else None
    if saved is not None:
        global_batch, microbatch = saved["global_batch"], saved["microbatch_size"]
    else:
        global_batch = args.global_batch or args.batch_size * dp
        microbatch = None
    if global_batch % dp:
        raise SystemExit(
            f"the global batch of {global_batch} does not split over {dp} data-parallel ranks "
            f"({world} processes / --pp {args.pp} / --cp {args.cp}); use a number of processes that "
            "divides it"
        )
    batch = global_batch // dp
    microbatches = args.microbatches if microbatch is None else batch // microbatch
    if microbatches < 1 or batch % microbatches or (microbatch and batch % microbatch):
        raise SystemExit(
            f"a rank's batch of {batch} does not split into microbatches of "
            f"{microbatch or batch // max(microbatches, 1)}; change --microbatches or the number of processes"
        )
    return global_batch, batch, microbatches


def layouts_for(world: int) -> str:
    """The --pp/--tp choices that use `world` processes (tp a power of two, pp dividing the rest)."""
    options = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if world % (pp * tp) == 0:
                options.append(
                    f"--pp {pp} --tp {tp}" + (f" --rdp {world // (pp * tp)}" if pp * tp < world else "")
                )
    return "; ".join(options[:6])


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rdp = args.rdp if args.rdp is not None else world // (args.pp * args.tp * args.cp)
    if args.pp * args.tp * args.cp * rdp != world:
        need = args.pp * args.tp * args.cp * rdp
        raise SystemExit(
            f"--pp {args.pp} x --tp {args.tp} x --cp {args.cp} x --rdp {rdp} = {need} processes, but "
            f"torchrun started {world}; set --nproc_per_node={need} or change the degrees (for {world}: "
            f"{layouts_for(world // args.cp)}{' with --cp ' + str(args.cp) if args.cp > 1 else ''})"
        )
    if args.seq_len % (2 * args.cp):
        fit = -(-args.seq_len // (2 * args.cp)) * 2 * args.cp
        raise SystemExit(
            f"--seq-len {args.seq_len} does not cut into 2 x --cp {args.cp} = {2 * args.cp} equal chunks; "
            f"use --seq-len {fit}"
        )
    global_batch, batch_size, microbatches = sizes(args, world)
    smp.init(
        {
            "pipeline_parallel_degree": args.pp,
            "tensor_parallel_degree": args.tp,
            "microbatches": microbatches,
            "pipeline": args.schedule,
            "ddp": True,
            "shard_optimizer_state": args.shard_optimizer_state,
            "sharded_data_parallel_degree": args.sdp,
            "expert_parallel_degree": args.ep,
            "context_parallel_degree": args.cp,
            "cp_comm_type": args.cp_comm,
            "sdp_gradient_clipping": args.clip,  # (used only under sdp, before each optimizer step)
            "bf16": args.bf16,
            "timeline": _timeline(args),
            "compile": args.compile,
        }
    )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    torch.manual_seed(args.seed)
    with smp.tensor_parallelism(args.tp > 1):
        model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        ),
    )

    start = 0
    user = smp.resume_from_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if user is not None:  # (None: nothing saved yet, a fresh start)
        start = user["step"]
        schedule.load_state_dict(user["schedule"])

    @smp.step
    def train_step(ids, mask, labels):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        model.backward(out.loss)
        return out.loss

    data = torch.frombuffer(bytearray(Path(args.corpus).read_bytes()), dtype=torch.uint8).long()
    # This data-parallel rank's rows of each step's global batch (SMP's advice: data by dp_rank).
    rows = slice(smp.dp_rank() * batch_size, (smp.dp_rank() + 1) * batch_size)
    if args.dynamic_padding:
        stream = (
            padded_batch_at(data, args.seq_len, global_batch, args.seed, step, rows, 2 * args.cp)
            for step in range(start, args.steps)
        )
    else:
        stream = (
            (ids, torch.ones_like(ids), ids)
            for ids in (
                batch_at(data, args.seq_len, global_batch, args.seed, s, rows)
                for s in range(start, args.steps)
            )
        )
    log, bar = _open_log(args, start, n_params, rdp)
    # The loss stays on the device between logs: reading it (.item()) waits for the step to finish,
    # so only every --log-every-th step does (and a compiled step is not cut by the read).
    window_loss, window_tokens, window_start = None, 0, time.perf_counter()
    for step in range(start, args.steps):
        ids, mask, labels = (t.to(device) for t in next(stream))
        optimizer.zero_grad()
        loss = train_step(ids, mask, labels).reduce_mean().detach()
        if args.clip and args.sdp == 1:  # (under sdp, smp clips at sdp_gradient_clipping)
            optimizer.clip_master_grads(args.clip)
        optimizer.step()
        schedule.step()
        window_loss = loss if window_loss is None else window_loss + loss
        window_tokens += ids.numel() * smp.dp_size()
        if bar is not None:
            bar.update(1)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            steps_in_window = (step + 1 - start) % args.log_every or args.log_every
            # Every pipeline's last stage computed its loss; average them over the data-parallel ranks.
            torch.distributed.all_reduce(window_loss, group=smp.get_dp_process_group())
            mean = window_loss.item() / smp.dp_size() / steps_in_window
            tokens_per_s = window_tokens / (time.perf_counter() - window_start)
            if bar is not None:
                bar.set_postfix(loss=f"{mean:.3f}", tok_s=f"{tokens_per_s:,.0f}")
                log.writerow(
                    [step + 1, f"{mean:.8f}", f"{schedule.get_last_lr()[0]:.6g}", f"{tokens_per_s:.1f}"]
                )
            window_loss, window_tokens, window_start = None, 0, time.perf_counter()
        done = step + 1
        if args.checkpoint_dir and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            smp.save_checkpoint(
                args.checkpoint_dir,
                tag=f"step_{done}",
                model=model,
                optimizer=optimizer,
                user_content={
                    "step": done,
                    "schedule": schedule.state_dict(),
                    "global_batch": global_batch,
                    "microbatch_size": batch_size // microbatches,
                },
                async_save=args.async_save or False,
            )
    smp.wait_for_checkpoint()  # a background save is complete before the job ends
    smp.barrier()
    if bar is not None:
        bar.close()
        _report_shapes(model)
        _plot(Path(args.out_dir))
        print(
            f"done: {args.steps} steps, log {args.out_dir}/log.csv, curve {args.out_dir}/loss.png", flush=True
        )
        if args.timeline:
            print(f"timeline: {args.out_dir}/timeline.json (ui.perfetto.dev), {args.out_dir}/timeline.png")


def _report_shapes(model) -> None:
    """How many input signatures the run captured (each costs a capture, and a compile)."""
    from smp.engine import compiled

    cache = model.engine.signature_cache
    print(
        f"input signatures: {cache.signatures_seen} seen, {len(cache)} stage graphs cached, "
        f"{cache.evictions} evicted; stage compilations on rank 0: {compiled.compiles()}",
        flush=True,
    )


def _timeline(args) -> dict | None:
    """The timeline's config: TIMELINE_STEPS steps from TIMELINE_START (earlier in a short run),
    written to the out dir by smp once they are done."""
    if not args.timeline:
        return None
    steps = min(TIMELINE_STEPS, args.steps)
    start = max(1, min(TIMELINE_START, args.steps - steps + 1))
    return {"path": args.out_dir, "start": start, "steps": steps}


def _open_log(args, start: int, n_params: int, rdp: int):
    """Rank 0's progress bar and CSV writer (None, None elsewhere)."""
    if smp.rank() != 0:
        return None, None
    from tqdm import tqdm

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"{'Mixtral' if args.model == 'mixtral' else 'GPT-2'} {n_params / 1e6:.2f}M parameters, "
        f"pp={args.pp} tp={args.tp} rdp={rdp} sdp={args.sdp}{f' ep={args.ep}' if args.ep > 1 else ''}"
        f"{f' cp={smp.cp_size()} ({args.cp_comm}), sequence {args.seq_len}' if smp.cp_size() > 1 else ''}, "
        f"{smp.num_microbatches()} microbatches ({args.schedule}), on {device_name()}",
        flush=True,
    )
    handle = open(out / "log.csv", "a" if start else "w", newline="", buffering=1)  # noqa: SIM115
    log = csv.writer(handle)
    if not start:
        log.writerow(["step", "loss", "lr", "tokens_per_s"])
    bar = tqdm(total=args.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    return log, bar


def device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    with open(out / "log.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    losses = [float(r["loss"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (bytes, nats)")
    ax.set_title("GPT-2 on examples/data/corpus.txt")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
