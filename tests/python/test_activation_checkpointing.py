"""Activation checkpointing (smp.set_activation_checkpointing): parity with one process training
the unsplit model in every layout, measured memory savings, dropout under recompute, Hugging
Face's gradient_checkpointing_enable(), the outline pass itself, and every error by message."""

from __future__ import annotations

import operator

import pipeline_cases
import pytest
import smp
import torch
from harness import run_ranks
from smp.passes import capture, regions
from torch import fx, nn

STRATEGIES = ("each", "group_2", "contiguous")
LAYOUTS = {
    "pp2": {"pipeline_parallel_degree": 2, "microbatches": 2},
    "pp2_simple": {"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "simple"},
    "pp2_tp2": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2},
    "tp2_rdp2_sharded": {"tensor_parallel_degree": 2, "shard_optimizer_state": True},
}


# Every strategy at pp=2 (the memory comparison), one at each other layout, each strategy at
# another layout too; the whole cross-product with --slow.
PAIRS = [("pp2", s) for s in STRATEGIES] + [
    ("pp2_simple", "contiguous"),
    ("pp2_tp2", "each"),
    ("tp2_rdp2_sharded", "group_2"),
]


def _matrix(rank, world_size, every):
    pairs = [(n, s) for n in LAYOUTS for s in STRATEGIES] if every else PAIRS
    runs = [(name, s, (LAYOUTS[name], {"checkpoint": {"blocks": s}})) for name, s in pairs]
    # Memory: the same pp=2 layout without checkpointing, every run measuring saved activations.
    runs.append(("pp2", None, (LAYOUTS["pp2"], {})))
    configs = [(cfg, opts | {"track_activations": True}) for _, _, (cfg, opts) in runs]
    results = pipeline_cases.train_smp(rank, world_size, "gpt", configs, 3, 8)
    keep = ("loss_err", "param_err", "grad_err", "activation_peak")
    return [(name, s, {k: r[k] for k in keep}) for (name, s, _), r in zip(runs, results, strict=True)]


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_parity_and_memory_every_strategy_and_layout(every):
    """Each strategy at pp=2 (both schedules), pp=2 x tp=2 and tp=2 x rdp=2 with sharded optimizer
    state (every pair with --slow) trains as one process does; checkpointing every layer keeps
    <= 1/3 of the saved bytes."""
    per_rank = run_ranks(_matrix, 4, every, timeout=600)
    for results in per_rank:
        for layout, strategy, r in results:
            assert r["loss_err"] < 1e-5, (layout, strategy, r)
            assert r["param_err"] < 1e-5, (layout, strategy, r)
            assert r["grad_err"] < 1e-5, (layout, strategy, r)
        peak = {s: r["activation_peak"] for layout, s, r in results if layout == "pp2"}
        assert 0 < peak["each"] * 3 <= peak[None], peak
        # More layers per region keep fewer inputs (the seeds' advice): contiguous <= group_2 < each.
        assert peak["contiguous"] <= peak["group_2"] < peak["each"], peak


def _hf(rank, world_size):
    config = LAYOUTS["pp2_tp2"] | {"debug": True}
    (llama,) = pipeline_cases.train_smp(
        rank, world_size, "hf_llama", [(config, {"checkpoint": {"model.layers": "each"}})], 3, 8
    )
    (gpt2,) = pipeline_cases.train_smp(
        rank, world_size, "hf_gpt2", [(config, {"hf_gradient_checkpointing": True})], 3, 8
    )
    return {
        "llama": (llama["loss_err"], llama["param_err"]),
        "gpt2": (gpt2["loss_err"], gpt2["param_err"]),
    }


def test_hf_llama_and_gpt2_pp2_tp2_every_layer(capfd):
    """Llama checkpointed with smp's call, GPT-2 with HF's gradient_checkpointing_enable() (which
    smp takes over as "each"): both train as one process does, every decoder layer recomputed."""
    per_rank = run_ranks(_hf, 4, timeout=600)
    for r in per_rank:
        for model in ("llama", "gpt2"):
            loss_err, param_err = r[model]
            assert loss_err < 1e-4 and param_err < 1e-4, (model, r[model])
    out = capfd.readouterr().out
    # Both models, both stages: two decoder layers each, every one its own region.
    assert out.count("recomputes 2 regions: model.layers.0, model.layers.1") == 1, out
    assert out.count("recomputes 2 regions: model.layers.2, model.layers.3") == 1, out
    assert out.count("recomputes 2 regions: transformer.h.0, transformer.h.1") == 1, out
    assert out.count("recomputes 2 regions: transformer.h.2, transformer.h.3") == 1, out


def test_manual_partition_region_split_at_the_stage_boundary(capfd):
    """blocks.0-2 on stage 0, blocks.3 on stage 1 (manual); group_2 makes blocks.2-3 one region,
    which spans the boundary: each stage recomputes its part, debug says so, parity holds."""
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "debug": True}
    options = {"manual": {"blocks.3": 1, "ln_f": 1}, "checkpoint": {"blocks": "group_2"}}
    results = run_ranks(pipeline_cases.train_smp, 2, "gpt", config, 3, 8, options, timeout=300)
    for r in results:
        assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, r
    out = capfd.readouterr().out
    assert "region blocks.2-3 spans stages [0, 1]: split at the boundary" in out, out
    assert "stage 0 recomputes 2 regions: blocks.0-1, blocks.2" in out, out
    assert "stage 1 recomputes 1 regions: blocks.3" in out, out


def _bf16_delayed(rank, world_size, strategy):
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "bf16": True})
    torch.manual_seed(0)
    with smp.delay_param_initialization():
        model = pipeline_cases.models.GPT(layers=4)
    dmodel = smp.DistributedModel(model)
    if strategy is not None:
        smp.set_activation_checkpointing(dmodel.get_module().blocks, strategy=strategy)
    # SGD: a wrong gradient changes its step (Adam's first steps are ~lr whatever the gradient).
    opt = smp.DistributedOptimizer(torch.optim.SGD(dmodel.parameters(), lr=0.05, momentum=0.9))

    @smp.step
    def train_step(ids):
        loss = pipeline_cases.models.lm_loss(dmodel(ids).float(), ids)
        dmodel.backward(loss)
        return loss

    batch = pipeline_cases.CASES["counting"]()[1]
    losses = []
    for s in range(3):
        opt.zero_grad()
        losses.append(train_step(batch(s, 8)["ids"]).reduce_mean().item())
        if s == 0:  # materialized and partitioned by the first step
            start = {n: p.detach().float().clone() for n, p in dmodel.local_named_parameters()}
        opt.step()
    now = {n: p.detach().float() for n, p in dmodel.local_named_parameters()}
    params = {n: p.flatten().tolist() for n, p in now.items()}
    moved = max((p - start[n]).abs().max().item() for n, p in now.items())
    smp.parallel_state.reset()
    return losses, params, moved


def _bf16_delayed_pair(rank, world_size):
    return _bf16_delayed(rank, world_size, None), _bf16_delayed(rank, world_size, "each")


def test_bf16_and_delayed_initialization_train_as_without_checkpointing():
    """The recompute runs the same bf16 ops on the same inputs: the same numbers, bit for bit, after
    3 SGD steps that moved the bf16 weights by many units in their last place."""
    for plain, checkpointed in run_ranks(_bf16_delayed_pair, 2, timeout=300):
        assert checkpointed[0] == plain[0]
        assert checkpointed[1] == plain[1]
        # trained: 4 units in the last place of a bf16 weight of 1 (measured: 0.06 and 0.33 per stage)
        assert plain[2] > 0.03, plain[2]


# --- dropout: the recompute draws the same mask (whole-model path, pp = tp = 1) ---------------------


class _DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Tanh()) for _ in range(3)]
        )
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.layers(x))


def _dropout_run(rank, world_size, strategy, preserve_rng_state):
    smp.init({})
    torch.manual_seed(0)
    model = smp.DistributedModel(_DropoutNet())
    if strategy is not None:
        smp.set_activation_checkpointing(
            model.get_module().layers, preserve_rng_state=preserve_rng_state, strategy=strategy
        )
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))

    @smp.step
    def train_step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    torch.manual_seed(1)  # the same dropout draws for every run
    losses = []
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        losses.append(train_step(x, y).reduce_mean().item())
        opt.step()
    params = [p.detach().flatten().tolist() for p in model.parameters()]  # (tensors do not pickle out)
    smp.parallel_state.reset()
    return losses, params


def _dropout_matrix(rank, world_size):
    return {
        key: _dropout_run(rank, world_size, *key)
        for key in ((None, True), ("each", True), ("group_2", True), ("contiguous", True), ("each", False))
    }


def test_dropout_in_region_same_as_without():
    (runs,) = run_ranks(_dropout_matrix, 1, timeout=120)
    plain_losses, plain_params = runs[(None, True)]
    for key in (("each", True), ("group_2", True), ("contiguous", True)):
        losses, params = runs[key]
        assert losses == plain_losses, key
        assert params == plain_params, key
    # Without preserving the RNG state the recompute draws new masks: the gradients change (so
    # the comparison above can fail).
    _, params = runs[("each", False)]
    assert params != plain_params


# --- errors ---------------------------------------------------------------------------------------


class _Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _errors(rank, world_size):
    messages = {}

    def catch(key, fn):
        try:
            fn()
        except ValueError as err:
            messages[key] = str(err)

    smp.init({})
    catch("no_model", lambda: smp.set_activation_checkpointing(nn.Linear(2, 2)))
    model = smp.DistributedModel(_Layers())
    layers = model.get_module().layers
    catch("foreign", lambda: smp.set_activation_checkpointing(nn.Linear(4, 4)))
    catch("strategy", lambda: smp.set_activation_checkpointing(layers, strategy="every"))
    catch("group_0", lambda: smp.set_activation_checkpointing(layers, strategy="group_0"))
    catch("group_x", lambda: smp.set_activation_checkpointing(layers, strategy="group_x"))
    catch("flag", lambda: smp.set_activation_checkpointing(layers, preserve_rng_state="yes"))
    catch("eager_group", lambda: smp.set_activation_checkpointing(layers, strategy="group_2"))

    @smp.step
    def train_step(x):
        out = model(x)
        model.backward(out.sum())

    train_step(torch.randn(2, 4))
    catch("after_step", lambda: smp.set_activation_checkpointing(layers))
    smp.parallel_state.reset()
    return messages


def test_errors_name_the_value_and_the_fix():
    (messages,) = run_ranks(_errors, 1, timeout=120)
    assert "no smp.DistributedModel exists yet" in messages["no_model"]
    assert "Linear passed is not part of the model" in messages["foreign"]
    assert "model.get_module()" in messages["foreign"]
    assert "unknown strategy 'every'" in messages["strategy"] and "'group_2'" in messages["strategy"]
    assert "'group_0' groups 0 layers" in messages["group_0"]
    assert "unknown strategy 'group_x'" in messages["group_x"]
    assert "preserve_rng_state must be True or False, got 'yes'" in messages["flag"]
    assert (
        "nn.ModuleList 'layers'" in messages["eager_group"] and "strategy='each'" in messages["eager_group"]
    )
    assert "called after the first step" in messages["after_step"]
    assert "before the first @smp.step call" in messages["after_step"]


# --- the outline pass -------------------------------------------------------------------------------


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x)) + x))


def test_outline_keeps_the_graph_meaning_and_splits_non_convex_regions():
    torch.manual_seed(0)
    model = _Chain()
    x = torch.randn(3, 8)
    gm = capture(model, (x,)).graph_module
    expected = gm(x)
    wrapped = []

    def wrap(region, paths, body):
        wrapped.append((region.label, paths))
        return body

    # a and c around b (outside): one region that is not convex, so two pieces.
    done = regions.outline_regions(gm, [regions.Region("a+c", frozenset({"a", "c"}))], wrap)
    assert [paths for _, paths, _ in done] == [["a"], ["c"]]
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert len(calls) == 2
    assert all(u.target is operator.getitem for n in calls for u in n.users)
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)


def test_outline_moves_outside_users_after_the_call():
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.sin, (x,))
    outside = graph.call_function(torch.cos, (a,))  # uses the region before its last node
    b = graph.call_function(torch.exp, (a,))
    graph.output((outside, b))
    gm = fx.GraphModule(nn.Module(), graph)
    t = torch.randn(4)
    expected = gm(t)
    from smp.passes.outline import convex_pieces, outline

    (piece,) = convex_pieces(gm.graph, {a, b})
    assert piece == [a, b]
    outline(gm, piece, "region", lambda body: body)
    gm.graph.lint()
    gm.recompile()
    for got, want in zip(gm(t), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading moves CUDA tensors")
def test_offload_parity_and_device_memory():
    from smp.recompute.offload import ActivationOffloader

    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).cuda()
    params = list(layers.parameters())
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    reference = torch.autograd.grad(layers(x).square().sum(), params)
    offloader = ActivationOffloader(1, lambda: params)
    from smp.recompute.region import checkpoint_forward

    for layer in layers:
        checkpoint_forward(layer, True, offloader)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with offloader.forward_of(0):
        y = layers(x * 1.0)
    torch.cuda.synchronize()
    held_offloaded = torch.cuda.memory_allocated() - before
    offloader.before_backward(0)
    got = torch.autograd.grad(y.square().sum(), params)
    for a, b in zip(got, reference, strict=True):
        torch.testing.assert_close(a, b)
    z = layers(x * 1.0)  # no offloader context: the inputs stay on the device
    torch.cuda.synchronize()
    held_plain = torch.cuda.memory_allocated() - before
    del z
    assert held_offloaded < held_plain, (held_offloaded, held_plain)
