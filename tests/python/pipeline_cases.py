"""Training cases for the pipeline tests: a model, its batches, its forward call and its loss,
with a single-process reference trained on the same global batch."""

from __future__ import annotations

import copy

import models
import torch
import torch.nn.functional as F

LR = 1e-3


def gpt_case(layers: int = 4):
    model = models.GPT(layers=layers)

    def batch(step, n):
        g = torch.Generator().manual_seed(1000 + step)
        return {"ids": torch.randint(0, 64, (n, 16), generator=g)}

    return model, batch, lambda m, b: m(b["ids"]), lambda out, b: models.lm_loss(out, b["ids"])


def _regression_batch(step, n, keys=("x",)):
    g = torch.Generator().manual_seed(2000 + step)
    out = {k: torch.randn(n, 16, generator=g) for k in keys}
    out["y"] = torch.randn(n, 1, generator=g)
    return out


def _regression_case(model):
    return model, _regression_batch, lambda m, b: m(b["x"]), lambda out, b: F.mse_loss(out, b["y"])


def dict_case():
    def batch(step, n):
        return _regression_batch(step, n, keys=("x", "gate"))

    def loss(out, b):
        pred, aux = out
        return F.mse_loss(pred, b["y"]) + 0.1 * aux.mean()

    return models.DictInTupleOut(), batch, lambda m, b: m({"x": b["x"], "gate": b["gate"]}), loss


CASES = {
    "gpt": gpt_case,
    "twice": lambda: _regression_case(models.TwiceCalled()),
    "skip": lambda: _regression_case(models.LongSkip()),
    "normed": lambda: _regression_case(models.Normed()),
    "dict": dict_case,
    "returns_twice": lambda: (
        models.ReturnsTwice(),
        _regression_batch,
        lambda m, b: m(b["x"]),
        lambda out, b: F.mse_loss(out[0], b["y"]) + F.mse_loss(out[1]["again"], 2 * b["y"]),
    ),
}


def reference(case: str, steps: int, global_batch: int):
    """Losses per step and final parameters of one process training the unsplit model."""
    torch.manual_seed(0)
    model, batch, forward, loss_fn = CASES[case]()
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for s in range(steps):
        b = batch(s, global_batch)
        opt.zero_grad()
        loss = loss_fn(forward(model, b), b)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def train_smp(rank, world_size, case, configs, steps, global_batch, options=None):
    """Trains the case with smp under each config in turn (one smp.init each) on this rank.

    Returns, per config, the losses' and final parameters' errors against one process
    training the unsplit model on the same global batch.
    """
    import smp

    ref_losses, ref_params = reference(case, steps, global_batch)
    results = []
    for config in [configs] if isinstance(configs, dict) else configs:
        smp.init(config)
        results.append(_train_once(smp, case, steps, global_batch, options or {}, ref_losses, ref_params))
        smp.core.reset()
    return results[0] if isinstance(configs, dict) else results


def _train_once(smp, case, steps, global_batch, options, ref_losses, ref_params):
    # SMP v1 advised seeding with 42 + dp_rank; smp makes replicas equal by broadcasting from the first.
    torch.manual_seed(smp.dp_rank() if options.get("seed_by_dp_rank") else 0)
    model, batch, forward, loss_fn = CASES[case]()
    for module_path, part in options.get("manual", {}).items():
        smp.set_partition(model.get_submodule(module_path), part)
    dmodel = smp.DistributedModel(model, **options.get("model_kwargs", {}))
    if options.get("track_activations"):
        dmodel.track_saved_activations()
    opt = smp.DistributedOptimizer(torch.optim.Adam(dmodel.parameters(), lr=LR))

    @smp.step
    def train_step(b):
        out = forward(dmodel, b)
        loss = loss_fn(out, b)
        dmodel.backward(loss)
        return loss

    losses = []
    per = global_batch // smp.dp_size()
    for s in range(steps):
        b = batch(s, global_batch)
        local = {k: v[smp.dp_rank() * per : (smp.dp_rank() + 1) * per] for k, v in b.items()}
        opt.zero_grad()
        loss = train_step(local).reduce_mean()
        opt.step()
        torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
        losses.append(loss.item() / smp.dp_size())
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    local = dict(dmodel.local_named_parameters())
    param_err = max((local[n] - ref_params[n]).abs().max().item() for n in local)
    return {
        "config": smp.core.state().config,
        "loss_err": loss_err,
        "param_err": param_err,
        "local": sorted(local),
        "shared": sorted(dmodel.partition_plan.shared_parameters) if dmodel.partition_plan else [],
        "activation_peak": dmodel.saved_activation_bytes()["peak"],
    }
