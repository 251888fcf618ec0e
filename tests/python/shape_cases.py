"""Training with inputs whose shapes change between steps (issue 16): the GPT test model and
Hugging Face Llama/BERT with right-padded masks, against one process training the unsplit model
on the same batches; plus the signature cache's warning and bound."""

from __future__ import annotations

import copy
import warnings

import hf_cases
import models
import pipeline_cases
import torch
import torch.nn.functional as F

# (rows, sequence length) of the global batch per step: 4 lengths, a smaller last batch.
STEPS = ((8, 16), (8, 12), (8, 7), (8, 12), (4, 10))
EVAL_SHAPE = (8, 5)  # an eval step's rows and length, unlike any training step's
TOKENS = 16  # every loss is a sum over tokens / (rows * TOKENS): microbatch means average exactly


def gpt_batch(step, rows, seq):
    g = torch.Generator().manual_seed(7000 + step)
    return {"ids": torch.randint(0, 64, (rows, seq), generator=g)}


def padded_batch(step, rows, seq, vocab=hf_cases.VOCAB):
    """Right-padded rows of random lengths in [seq // 2, seq], at least one of length seq."""
    g = torch.Generator().manual_seed(8000 + step)
    ids = torch.randint(1, vocab, (rows, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
    lengths[0] = seq
    mask = (torch.arange(seq) < lengths[:, None]).long()
    return {"ids": ids * mask, "mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _summed_ce(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")


def gpt_loss(out, b):
    ids = b["ids"]
    return _summed_ce(out[:, :-1], ids[:, 1:]) / (ids.shape[0] * TOKENS)


def hf_loss(out, b):
    return _summed_ce(out.logits, b["labels"]) / (b["ids"].shape[0] * TOKENS)


def hf_causal_loss(out, b):
    return _summed_ce(out.logits[:, :-1], b["labels"][:, 1:]) / (b["ids"].shape[0] * TOKENS)


CASES = {
    "gpt": (lambda: models.GPT(layers=4), gpt_batch, lambda m, b: m(b["ids"]), gpt_loss),
    "gpt_small": (lambda: models.GPT(layers=2), gpt_batch, lambda m, b: m(b["ids"]), gpt_loss),
    "hf_llama": (
        hf_cases.llama,
        padded_batch,
        lambda m, b: m(input_ids=b["ids"], attention_mask=b["mask"]),
        hf_causal_loss,
    ),
    "hf_bert": (
        hf_cases.bert,
        padded_batch,
        lambda m, b: m(input_ids=b["ids"], attention_mask=b["mask"]),
        hf_loss,
    ),
}


def make_optimizer(kind, params):
    """Adam by default; SGD where Adam would turn a compiler's rounding noise on near-zero gradients
    into lr-sized parameter differences (it normalizes every gradient element)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    return torch.optim.Adam(params, lr=pipeline_cases.LR)


def reference(case, steps=STEPS, eval_between=None, optimizer="adam"):
    """Losses, final parameters and eval losses of one process training the unsplit model."""
    torch.manual_seed(0)
    build, batch, forward, loss_fn = CASES[case]
    model = copy.deepcopy(build())
    opt = make_optimizer(optimizer, model.parameters())
    losses, evals = [], []
    for s, (rows, seq) in enumerate(steps):
        if s == eval_between:
            model.eval()
            with torch.no_grad():
                b = batch(99, *EVAL_SHAPE)
                evals.append(loss_fn(forward(model, b), b).item())
            model.train()
        b = batch(s, rows, seq)
        opt.zero_grad()
        loss = loss_fn(forward(model, b), b)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, evals


def train(smp, case, ref, steps=STEPS, eval_between=None, optimizer="adam"):
    """Trains `case` under the current smp config on this rank's share of each step's batch;
    returns loss and parameter errors against `ref` (and what eval_between's eval step returned)."""
    ref_losses, ref_params, ref_evals = ref
    build, batch, forward, loss_fn = CASES[case]
    torch.manual_seed(0)
    with smp.tensor_parallelism(smp.tp_size() > 1):
        model = build()
    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(make_optimizer(optimizer, dmodel.parameters()))

    @smp.step
    def train_step(b):
        loss = loss_fn(forward(dmodel, b), b)
        dmodel.backward(loss)
        return loss

    @smp.step
    def eval_step(b):
        return loss_fn(forward(dmodel, b), b)

    prescaled = smp.parallel_state.state().config.prescaled_batch
    shards, shard = (smp.rdp_size(), smp.rdp_rank()) if prescaled else (smp.dp_size(), smp.dp_rank())
    losses, evals = [], []
    for s, (rows, seq) in enumerate(steps):
        if eval_between is not None and s == eval_between:
            dmodel.eval()
            with torch.no_grad():
                evals.append(_local_mean(smp, eval_step, batch(99, *EVAL_SHAPE), shards, shard))
            dmodel.train()
        opt.zero_grad()
        losses.append(_local_mean(smp, train_step, batch(s, rows, seq), shards, shard))
        opt.step()
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses + evals, ref_losses + ref_evals, strict=True))
    full = dmodel.state_dict() if smp.tp_size() > 1 else dict(dmodel.local_named_parameters())
    param_err = max((full[n] - ref_params[n]).abs().max().item() for n in full if n in ref_params)
    cache = dmodel.engine.signature_cache if hasattr(dmodel, "engine") else None
    return {"loss_err": loss_err, "param_err": param_err, "evals": evals, "cache": _cache_facts(cache)}


def _local_mean(smp, step, b, shards, shard):
    per = b["ids"].shape[0] // shards
    local = {k: v[shard * per : (shard + 1) * per] for k, v in b.items()}
    loss = step(local).reduce_mean().detach()
    torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
    return loss.item() / smp.dp_size()


def _cache_facts(cache):
    if cache is None:
        return None
    return {"seen": cache.signatures_seen, "cached": len(cache), "evictions": cache.evictions}


def catch_warnings():
    caught = warnings.catch_warnings(record=True)
    log = caught.__enter__()
    warnings.simplefilter("always")
    return caught, log
