"""Training cases for the pipeline tests: a model, its batches, its forward call and its loss,
with a single-process reference trained on the same global batch."""

from __future__ import annotations

import copy

import hf_architectures
import hf_cases
import models
import torch
import torch.nn.functional as F

LR = 1e-3
# Under bf16 a parity test trains with SGD (Adam's first steps move a parameter by ~lr whatever its
# gradient, so bf16's rounding of a tiny gradient moves it as far as training does) and asks the
# error that tells (trained_error) to be under 1/30 of how far training moved the parameters:
# measured 1/88 to 1/180 (bf16 computes gradients within about 1%); an untrained model is 1/1 off.
BF16_MOVED_PER_ERROR = 30


def gpt_case(layers: int = 4, **shape):
    model = models.GPT(layers=layers, **shape)

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


def counting_case():
    """The GPT on sequences that count up (mod the vocabulary): learnable, so the loss falls."""
    model = models.GPT(layers=2)

    def batch(step, n):
        g = torch.Generator().manual_seed(4000 + step)
        return {"ids": (torch.randint(0, 64, (n, 1), generator=g) + torch.arange(16)) % 64}

    return model, batch, lambda m, b: m(b["ids"]), lambda out, b: models.lm_loss(out, b["ids"])


def gqa_case(kv_heads: int = 4):
    model = models.GQALM(kv_heads=kv_heads)

    def batch(step, n):
        g = torch.Generator().manual_seed(3000 + step)
        ids = torch.randint(0, 64, (n, 16), generator=g)
        return {"ids": ids, "labels": ids}

    return model, batch, lambda m, b: m(b["ids"], b["labels"]), lambda out, b: out


def frozen_case():
    """The GPT fine-tuned with parts frozen (requires_grad off): the tied embedding/head and the
    positions, the whole first block, and in later blocks one MLP linear and one norm whose inputs
    still need gradients (the gradient flows through them to the trainable layers before)."""
    model, batch, forward, loss = gpt_case()
    for module in (model.tok, model.pos, model.blocks[0], model.blocks[2].mlp[0], model.blocks[3].ln2):
        module.requires_grad_(False)
    return model, batch, forward, loss


CASES = {
    "gpt": gpt_case,
    "frozen": frozen_case,
    "gqa": gqa_case,
    # Multi-query attention: one key/value head, fewer than any tensor-parallel degree.
    "mqa": lambda: gqa_case(kv_heads=1),
    "counting": counting_case,
    # Three heads: attention cannot split over 2 ranks (stays replicated), the MLPs can.
    "gpt_3heads": lambda: gpt_case(layers=2, dim=24, heads=3),
    "qknorm": lambda: gpt_case(layers=2, attention=models.QKNormAttention),
    # Linears spelled x @ W.T + b, einsum, and matmul on a [in, out] weight.
    "forms": lambda: gpt_case(layers=2, attention=models.RawLinearAttention, mlp=models.EinsumMLP),
    "twice": lambda: _regression_case(models.TwiceCalled()),
    "skip": lambda: _regression_case(models.LongSkip()),
    # ... also returning a middle layer's output and the first's: earlier stages send model outputs.
    "skip_middle_outputs": lambda: (
        models.LongSkip(middle_outputs=True),
        _regression_batch,
        lambda m, b: m(b["x"]),
        lambda out, b: F.mse_loss(out[0], b["y"]) + 0.1 * out[1].pow(2).mean() + 0.1 * out[2].pow(2).mean(),
    ),
    "normed": lambda: _regression_case(models.Normed()),
    "dict": dict_case,
    "returns_twice": lambda: (
        models.ReturnsTwice(),
        _regression_batch,
        lambda m, b: m(b["x"]),
        lambda out, b: F.mse_loss(out[0], b["y"]) + F.mse_loss(out[1]["again"], 2 * b["y"]),
    ),
}
CASES.update(hf_cases.CASES)
CASES.update(hf_architectures.CASES)


def make_optimizer(kind: str, named_parameters):
    """The optimizer (and LR scheduler, or None) a test trains with, for the reference and smp alike."""
    named = list(named_parameters)
    if kind == "sgd":
        return torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9), None
    if kind == "adamw_groups":  # two param groups and a scheduler
        decay = [p for n, p in named if p.dim() >= 2]
        rest = [p for n, p in named if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=LR
        )
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return torch.optim.Adam([p for _, p in named], lr=LR), None


def reference(case: str, steps: int, global_batch: int, options=None):
    """Losses per step, final parameters, first gradients, first gradient norm and final optimizer
    state (by parameter name) of one process training the unsplit model."""
    options = options or {}
    torch.manual_seed(0)
    model, batch, forward, loss_fn = CASES[case]()
    model = copy.deepcopy(model)
    opt, scheduler = make_optimizer(options.get("optimizer", "adam"), model.named_parameters())
    start = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    losses, norm0 = [], None
    for s in range(steps):
        b = batch(s, global_batch)
        opt.zero_grad()
        loss = loss_fn(forward(model, b), b)
        loss.backward()
        if s == 0:  # Adam hides a wrong gradient scale: the tests also compare the first gradients
            grads = {  # a frozen parameter's gradient: none, compared as zeros
                n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in model.named_parameters(remove_duplicate=False)
            }
        if "clip" in options:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), options["clip"])
            norm0 = norm.item() if norm0 is None else norm0
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: dict(v) for p, v in opt.state.items()}
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    moved = max((params[n] - p).abs().max().item() for n, p in start.items())  # how far training went
    return {
        "losses": losses,
        "params": params,
        "grads": grads,
        "norm0": norm0,
        "state": state,
        "moved": moved,
        "start": start,
    }


def train_smp(rank, world_size, case, configs, steps, global_batch, options=None):
    """Trains the case with smp under each config in turn (one smp.init each) on this rank.

    A config may come as (config, options) to add options for that run only. Returns, per
    config, the losses' and final parameters' errors against one process training the unsplit
    model on the same global batch.
    """
    import smp

    refs = {}  # per optimizer and clipping (the options the reference reads)
    results = []
    for config in [configs] if isinstance(configs, dict) else configs:
        config, extra = config if isinstance(config, tuple) else (config, {})
        merged = (options or {}) | extra
        key = (merged.get("optimizer"), merged.get("clip"))
        if key not in refs:
            refs[key] = reference(case, steps, global_batch, merged)
        smp.init(config)
        results.append(_train_once(smp, case, steps, global_batch, merged, refs[key]))
        smp.parallel_state.reset()
    return results[0] if isinstance(configs, dict) else results


def _train_once(smp, case, steps, global_batch, options, ref):
    ref_losses, ref_params, ref_grads = ref["losses"], ref["params"], ref["grads"]
    # SMP v1 advised seeding with 42 + dp_rank; smp makes replicas equal by broadcasting from the first.
    torch.manual_seed(smp.dp_rank() if options.get("seed_by_dp_rank") else 0)
    with smp.tensor_parallelism(options.get("tensor_parallel", smp.tp_size() > 1)):
        model, batch, forward, loss_fn = CASES[case]()
    for module_path, part in options.get("manual", {}).items():
        smp.set_partition(model.get_submodule(module_path), part)
    if options.get("hf_gradient_checkpointing"):
        model.gradient_checkpointing_enable()
    dmodel = smp.DistributedModel(model, **options.get("model_kwargs", {}))
    for module_path, strategy in options.get("checkpoint", {}).items():
        smp.set_activation_checkpointing(dmodel.get_module().get_submodule(module_path), strategy=strategy)
    if options.get("track_activations"):
        dmodel.track_saved_activations()
    inner, scheduler = make_optimizer(
        options.get("optimizer", "adam"), dmodel.get_module().named_parameters()
    )
    opt = smp.DistributedOptimizer(inner, **options.get("optimizer_kwargs", {}))
    name_of = {id(p): n for n, p in dmodel.get_module().named_parameters()}
    order = [name_of[id(p)] for g in inner.param_groups for p in g["params"]]  # state_dict's indices
    norm0 = None

    @smp.step
    def train_step(b):
        out = forward(dmodel, b)
        loss = loss_fn(out, b)
        dmodel.backward(loss)
        return loss

    losses = []
    # A prescaled batch is read by a whole tensor-parallel group: shard by rdp rank.
    prescaled = smp.parallel_state.state().config.prescaled_batch
    shards, shard = (smp.rdp_size(), smp.rdp_rank()) if prescaled else (smp.dp_size(), smp.dp_rank())
    per = global_batch // shards
    # The batch on the rank's device, as a script would put it (the loss reads it beside the outputs).
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    for s in range(steps):
        b = batch(s, global_batch)
        local = {k: v[shard * per : (shard + 1) * per].to(device) for k, v in b.items()}
        opt.zero_grad()
        loss = train_step(local).reduce_mean()
        if s == 0:
            grad_err = _grad_error(dmodel, ref_grads)
        if "clip" in options and not options.get("clipped_by_config"):  # (sdp_gradient_clipping)
            norm = opt.clip_master_grads(options["clip"]).item()
            norm0 = norm if norm0 is None else norm0
        opt.step()
        if scheduler is not None:
            scheduler.step()
        torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
        losses.append(loss.item() / smp.dp_size())
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    local = dict(dmodel.local_named_parameters())
    if smp.tp_size() > 1 or smp.sdp_size() > 1:  # compare the full parameters, gathered from their shards
        full = dmodel.state_dict()
        param_err = max((full[n].cpu() - ref_params[n]).abs().max().item() for n in ref_params)
    else:
        param_err = max((local[n].cpu() - ref_params[n]).abs().max().item() for n in local)
    inner_state = [t for v in inner.state.values() for t in v.values() if isinstance(t, torch.Tensor)]
    full_state = opt.state_dict()
    state_err = None
    if smp.pp_size() == 1 and smp.tp_size() == 1:  # per-parameter state against the reference's
        state_err = max(
            (_whole(v).cpu() - ref["state"][order[i]][k]).abs().max().item()
            for i, entry in full_state["state"].items()
            for k, v in entry.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
    return {
        "config": smp.parallel_state.state().config,
        "grad_err": grad_err,
        "norm0": norm0,
        "ref_norm0": ref["norm0"],
        "state_err": state_err,
        "state_bytes": sum(t.numel() * t.element_size() for t in inner_state if t.dim() > 0),
        "loss_scale": opt.loss_scale,
        "losses": losses,
        "loss_err": loss_err,
        "param_err": param_err,
        "master_err": _master_error(dmodel, opt, ref),
        "moved": ref["moved"],
        "local": sorted(local),
        "shared": sorted(dmodel.partition_plan.shared_parameters) if dmodel.partition_plan else [],
        "activation_peak": dmodel.saved_activation_bytes()["peak"],
        "kept_gradients_peak": dmodel.saved_activation_bytes()["kept_gradients_peak"],
        "distributed": sorted(n for n, p in local.items() if dmodel.is_distributed_parameter(p)),
        "tp_share": report.sharded_share if (report := dmodel.tensor_parallel_report()) else None,
        "local_numel": {n: p.numel() for n, p in local.items()},
        "full_numel": {n: p.numel() for n, p in ref_params.items()},
    }


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole: gathered from its shards where sharded data parallelism cut it (a DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def trained_error(result: dict) -> float:
    """The error that tells training apart from none under bf16/fp16: the fp32 masters' where smp
    keeps them (bf16/fp16 without sdp, whose parameters are the masters rounded), else the
    parameters' (fp32, and sdp's fp32 shards)."""
    return result["param_err"] if result["master_err"] is None else result["master_err"]


def _master_error(dmodel, opt, ref) -> float | None:
    """Under bf16/fp16 without sdp: the largest difference, over every rank's chunk, between the
    fp32 master weights and where the reference's steps take the half-precision start. The
    half-precision parameters (and the masters copied from them) round the start by up to half a
    unit in the last place (0.016 for a weight of 4 in bf16), as far as steps of training move them:
    only this tells training apart from none."""
    flat = opt.flat_state
    if flat is None or not flat.groups[0].master_is_copy:
        return None
    name_of = {id(p): n for n, p in dmodel.local_named_parameters()}
    err = 0.0
    for group in flat.groups:
        master = group.master.detach().cpu()
        for p, start, at, n in group.overlaps():
            name = name_of[id(p)]
            first = ref["start"][name]
            want = first.to(group.values.dtype).float() + ref["params"][name] - first
            want = dmodel._local_part(p, want).flatten()[start : start + n]
            err = max(err, (master[at : at + n] - want).abs().max().item())
    worst = torch.tensor([err], device=flat.groups[0].master.device)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)  # every rank's chunk
    return worst.item()


def _grad_error(dmodel, ref_grads) -> float:
    """Largest difference between this rank's gradients (of its shards) and the reference's,
    relative to the largest reference gradient."""
    scale = max(g.abs().max().item() for g in ref_grads.values())
    err = 0.0
    for name, p in dmodel.local_named_parameters():
        expected = dmodel._local_part(p, ref_grads[name])
        got = _whole(p.grad) if p.grad is not None else torch.zeros(p.shape)
        err = max(err, (got.cpu() - expected).abs().max().item() / scale)  # .cpu(): CUDA runs too
    return err
