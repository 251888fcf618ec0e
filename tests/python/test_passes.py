"""smp.passes on one process: capture, cost, partition and split reproduce the model exactly."""

from __future__ import annotations

import copy
import functools

import models
import pytest
import torch
from smp import passes
from smp.passes import cost
from torch import nn
from torch.utils import _pytree as pytree

# --- inputs and cached captures ---------------------------------------------------


def _gpt_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))


def _vector(seed: int, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)).requires_grad_(requires_grad)


def _make_case(name: str):
    """(model, args, loss_fn) with deterministic weights and inputs."""
    torch.manual_seed(1234)
    if name == "GPT":
        ids = _gpt_ids()
        return models.GPT(), (ids,), lambda out: models.lm_loss(out, ids)
    if name == "TwiceCalled":
        return models.TwiceCalled(), (_vector(1, requires_grad=True),), lambda out: out.pow(2).sum()
    if name == "LongSkip":
        return models.LongSkip(), (_vector(2, requires_grad=True),), lambda out: out.pow(2).sum()
    if name == "DictInTupleOut":
        batch = {"x": _vector(3, requires_grad=True), "gate": _vector(4)}
        return models.DictInTupleOut(), (batch,), lambda out: out[0].pow(2).sum() + 3 * out[1].sum()
    raise KeyError(name)


@functools.cache
def _case(name: str):
    """(pristine model, args, loss_fn, captured model, its cost-annotated capture), built once per model.

    The capture holds the captured model's own Parameters; nothing runs backward on the pristine model, so
    tests deep-copy it for a reference. Backward through the capture leaves gradients on the captured model:
    tests that check them clear them first.
    """
    model, args, loss_fn = _make_case(name)
    captured_model = copy.deepcopy(model)
    captured = passes.capture(captured_model, args)
    cost.annotate(captured.graph_module)
    return model, args, loss_fn, captured_model, captured


def _captured(name: str) -> passes.CapturedGraph:
    return _case(name)[4]


def _fresh(args):
    """Copies of the input tensors (same values and requires_grad), so gradients start from zero."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), args
    )


@functools.cache
def _captured_gpt8() -> passes.CapturedGraph:
    torch.manual_seed(0)
    captured = passes.capture(models.GPT(layers=8), (_gpt_ids(),))
    cost.annotate(captured.graph_module)
    return captured


def _compute_nodes(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op in passes.partition.COMPUTE_OPS]


# --- 1. split + run == module, forward and backward --------------------------------

SPLIT_CASES = [
    ("GPT", 2),
    ("GPT", 3),
    ("GPT", 4),
    ("TwiceCalled", 2),
    ("TwiceCalled", 3),
    ("LongSkip", 2),
    ("LongSkip", 4),
    ("DictInTupleOut", 2),
    ("DictInTupleOut", 3),
]


@pytest.mark.parametrize("name,stages", SPLIT_CASES)
def test_split_run_matches_module_forward_and_gradients(name, stages):
    model, args, loss_fn, captured_model, captured = _case(name)
    reference = copy.deepcopy(model)  # runs eagerly; the split runs on the captured model's Parameters
    ref_args, run_args = _fresh(args), _fresh(args)
    for p in captured_model.parameters():
        p.grad = None
    for (rname, r), (cname, c) in zip(
        reference.state_dict().items(), captured_model.state_dict().items(), strict=True
    ):
        assert rname == cname and torch.equal(r, c) and r is not c

    plan = passes.auto_partition(captured.graph_module, stages)
    pipe = passes.split(captured, plan)
    assert len(pipe.stages) == stages
    assert sorted(set(plan.node_stage.values())) == list(range(stages))

    expected = reference(*ref_args)
    got = pipe.run(*run_args)
    assert pytree.tree_structure(got) == pytree.tree_structure(expected)
    for g, e in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected), strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)

    # The capture shares the captured model's Parameters, so backward through the split fills them.
    loss_fn(expected).backward()
    loss_fn(got).backward()
    ref_params = dict(reference.named_parameters())
    got_params = dict(captured_model.named_parameters())
    assert ref_params.keys() == got_params.keys()
    for pname, p in ref_params.items():
        assert p.grad is not None and got_params[pname].grad is not None, pname
        torch.testing.assert_close(got_params[pname].grad, p.grad, rtol=1e-5, atol=1e-6, msg=pname)
        assert got_params[pname].grad.abs().sum() > 0, pname
    # Gradients w.r.t. the inputs that required them, too.
    for g_in, r_in in zip(pytree.tree_leaves(run_args), pytree.tree_leaves(ref_args), strict=True):
        if r_in.requires_grad:
            assert g_in.grad is not None
            torch.testing.assert_close(g_in.grad, r_in.grad, rtol=1e-5, atol=1e-6)


def test_split_values_cross_from_producer_to_consumers():
    captured = _captured("LongSkip")
    plan = passes.auto_partition(captured.graph_module, 4)
    pipe = passes.split(captured, plan)
    for v in pipe.values.values():
        assert v.src == plan.node_stage[v.name]
        assert all(c > v.src for c in v.consumers), v
        assert v.consumers or v.is_output
    # The skip connection (tanh of the first layer) jumps over a stage straight to the last one.
    assert any(3 in v.consumers and v.src < 2 for v in pipe.values.values())
    # Each stage receives exactly the values whose consumers include it, and produces what it sources.
    for stage in pipe.stages:
        assert sorted(stage.received) == sorted(
            n for n, v in pipe.values.items() if stage.index in v.consumers
        )
        assert sorted(stage.produced) == sorted(n for n, v in pipe.values.items() if v.src == stage.index)
    assert pipe.stages[0].inputs == [0] and all(not s.inputs for s in pipe.stages[1:])
    (out_leaf,) = pipe.outputs
    assert out_leaf.kind == "value" and pipe.values[out_leaf.ref].is_output
    assert plan.node_stage[out_leaf.ref] == 3


def test_run_rejects_inputs_of_another_structure():
    captured = _captured("DictInTupleOut")
    pipe = passes.split(captured, passes.auto_partition(captured.graph_module, 2))
    with pytest.raises(ValueError, match="same arguments"):
        pipe.run({"x": _vector(3)})


# --- 2. auto_partition ----------------------------------------------------------------

PARTITION_CASES = [(n, k) for n in ("GPT", "TwiceCalled", "LongSkip", "DictInTupleOut") for k in (1, 2, 3, 4)]


@pytest.mark.parametrize("name,stages", PARTITION_CASES)
def test_auto_partition_is_complete_and_contiguous(name, stages):
    gm = _captured(name).graph_module
    plan = passes.auto_partition(gm, stages)
    compute = _compute_nodes(gm)
    assert set(plan.node_stage) == set(compute)
    order = [plan.node_stage[n] for n in compute]
    assert order == sorted(order), "stages must be contiguous in graph order"
    assert order[0] == 0 and order[-1] == stages - 1
    assert set(order) == set(range(stages))
    assert plan.num_stages == stages
    for field in ("stage_cost", "stage_units", "stage_parameters", "stage_parameter_bytes"):
        assert len(getattr(plan, field)) == stages, field
    assert all(c > 0 for c in plan.stage_cost)
    # Every parameter lives on at least one stage; only shared ones on more than one.
    _, params = passes.partition.parameter_aliases(gm)
    holders = {p: [s for s in range(stages) if p in plan.stage_parameters[s]] for p in params}
    assert all(holders.values())
    assert {p: h for p, h in holders.items() if len(h) > 1} == plan.shared_parameters


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("memory_weight", [0.0, 0.8, 1.0])
def test_auto_partition_balances_equal_layers(stages, memory_weight):
    gm = _captured_gpt8().graph_module
    plan = passes.auto_partition(gm, stages, memory_weight=memory_weight)
    assert len(plan.stage_cost) == stages
    mean = sum(plan.stage_cost) / stages
    assert max(plan.stage_cost) / mean < 1.35, plan.report()
    # Eight equal blocks: each stage holds 8 / stages whole blocks.
    blocks = [sorted(u for u in units if u.startswith("blocks.")) for units in plan.stage_units]
    assert [len(b) for b in blocks] == [8 // stages] * stages, plan.report()


def test_memory_weight_moves_a_huge_cheap_embedding_onto_its_own_stage():
    model = BigEmbedding()
    ids = torch.randint(0, model.emb.num_embeddings, (8, 128), generator=torch.Generator().manual_seed(0))
    captured = passes.capture(model, (ids,))
    gm = captured.graph_module
    cost.annotate(gm)
    by_memory = passes.auto_partition(gm, 2, memory_weight=1.0)
    by_compute = passes.auto_partition(gm, 2, memory_weight=0.0)
    first_layer = next(n.name for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    # Memory: the embedding (almost all the parameter bytes) alone outweighs everything else.
    assert by_memory.stage_units[0] == ["emb"]
    assert by_memory.node_stage[first_layer] == 1
    assert by_memory.stage_cost[0] > 0.8
    # Compute: the lookup costs nearly nothing, so stage 0 also takes the first layers.
    assert by_compute.node_stage[first_layer] == 0
    assert "emb" in by_compute.stage_units[0] and len(by_compute.stage_units[0]) > 1
    assert max(by_compute.stage_cost) < 0.7
    assert by_memory.stage_cost != by_compute.stage_cost
    for plan in (by_memory, by_compute):
        assert "emb.weight" in plan.stage_parameters[0]
        assert plan.stage_parameter_bytes[0] >= model.emb.weight.numel() * 4
        with torch.no_grad():
            torch.testing.assert_close(passes.split(captured, plan).run(ids), model(ids), rtol=0, atol=1e-6)


def test_auto_partition_rejects_zero_stages():
    with pytest.raises(passes.PartitionError, match="num_stages must be >= 1"):
        passes.auto_partition(_captured("LongSkip").graph_module, 0)


# --- 3. shared (tied) parameters ----------------------------------------------------------


def test_tied_embedding_is_shared_between_first_and_last_stage():
    gm = _captured("GPT").graph_module
    plan = passes.auto_partition(gm, 2)
    assert plan.shared_parameters == {"tok.weight": [0, 1]}
    assert plan.parameter_aliases["head.weight"] == "tok.weight"
    assert "tok.weight" in plan.stage_parameters[0] and "tok.weight" in plan.stage_parameters[1]
    assert all("head.weight" not in ps for ps in plan.stage_parameters)
    report = plan.report()
    assert "tok.weight" in report and "shared" in report
    assert "stage 0" in report and "stage 1" in report
    # The replicas are one tensor in this process: both stage modules hold the model's own Parameter.
    pipe = passes.split(_captured("GPT"), plan)
    tok = gm.get_parameter("tok.weight")
    held = [t for s in pipe.stages for t in s.module.parameters() if t is tok]
    assert len(held) == 2


def test_module_called_twice_shares_its_parameters():
    plan = passes.auto_partition(_captured("TwiceCalled").graph_module, 2)
    assert plan.shared_parameters == {"shared.weight": [0, 1], "shared.bias": [0, 1]}
    assert "shared.weight" in plan.report()


@pytest.mark.parametrize("stages", [3, 4])
def test_colocate_shared_on_tied_gpt_is_too_small(stages):
    with pytest.raises(passes.PartitionError) as info:
        passes.auto_partition(_captured("GPT").graph_module, stages, colocate_shared=True)
    message = str(info.value)
    assert "model too small to split" in message and "colocate" in message
    assert f"pipeline_parallel_degree={stages}" in message


def test_colocate_shared_without_shared_parameters_is_a_normal_partition():
    gm = _captured("LongSkip").graph_module
    colocated = passes.auto_partition(gm, 4, colocate_shared=True)
    assert colocated.shared_parameters == {}
    assert colocated.node_stage == passes.auto_partition(gm, 4).node_stage


def test_colocate_shared_keeps_twice_called_module_on_one_stage():
    captured = _captured("TwiceCalled")
    plan = passes.auto_partition(captured.graph_module, 2, colocate_shared=True)
    assert plan.shared_parameters == {}
    holders = [s for s in range(2) if "shared.weight" in plan.stage_parameters[s]]
    assert len(holders) == 1


# --- 5. too small -----------------------------------------------------------------------------


def test_too_few_modules_for_the_stages():
    gm = passes.capture(TwoLeaves(), (torch.randn(3, 8),)).graph_module
    cost.annotate(gm)
    assert len(passes.auto_partition(gm, 2).stage_cost) == 2
    with pytest.raises(passes.PartitionError) as info:
        passes.auto_partition(gm, 4)
    message = str(info.value)
    assert "model too small to split" in message
    assert "2 partitionable unit" in message and "pipeline_parallel_degree=4" in message
    assert "colocate" not in message


# --- 6. manual_partition ---------------------------------------------------------------------

GPT_TWO_HALVES = {"blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1}


def _stage_of_module(gm, plan, path: str) -> set[int]:
    return {
        plan.node_stage[n.name]
        for n in gm.graph.nodes
        if n.name in plan.node_stage
        and path in [p for p, _ in (n.meta.get("nn_module_stack") or {}).values()]
    }


@pytest.mark.parametrize(
    "module_stage,stages",
    [
        (GPT_TWO_HALVES, 2),
        ({"blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "blocks.3": 2}, 3),
        ({"blocks.0": 0, "blocks.1": 1, "blocks.2": 2, "blocks.3": 3}, 4),
    ],
)
def test_manual_partition_follows_the_map_and_matches_the_module(module_stage, stages):
    model, (ids,), _, _, captured = _case("GPT")
    gm = captured.graph_module
    plan = passes.manual_partition(gm, stages, module_stage, default_stage=0)
    for path, s in module_stage.items():
        assert _stage_of_module(gm, plan, path) == {s}, path
    # Unassigned code: the embeddings run where their first consumer does; the tail follows its inputs.
    assert _stage_of_module(gm, plan, "tok") == {0} and _stage_of_module(gm, plan, "pos") == {0}
    assert _stage_of_module(gm, plan, "ln_f") == {stages - 1}
    assert _stage_of_module(gm, plan, "head") == {stages - 1}
    assert set(plan.node_stage) == set(_compute_nodes(gm))
    assert plan.shared_parameters == {"tok.weight": [0, stages - 1]}
    assert len(plan.stage_cost) == stages
    assert sum(plan.stage_cost) == pytest.approx(1.0)
    with torch.no_grad():
        torch.testing.assert_close(passes.split(captured, plan).run(ids), model(ids), rtol=0, atol=1e-6)


def test_manual_partition_unassigned_code_around_one_assigned_module():
    captured = _captured("LongSkip")
    gm = captured.graph_module
    plan = passes.manual_partition(gm, 2, {"layers.2": 1}, default_stage=0)
    # Before the assigned module: stage 0; after it (it feeds them): stage 1, the skip's add included.
    for path in ("inp", "layers.0", "layers.1"):
        assert _stage_of_module(gm, plan, path) == {0}, path
    for path in ("layers.2", "layers.3", "out"):
        assert _stage_of_module(gm, plan, path) == {1}, path
    (add,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert plan.node_stage[add.name] == 1
    pipe = passes.split(captured, plan)
    x = _vector(7)
    with torch.no_grad():
        torch.testing.assert_close(pipe.run(x), _case("LongSkip")[3](x), rtol=0, atol=0)


def test_manual_partition_rejects_backward_data_flow():
    gm = _captured("GPT").graph_module
    with pytest.raises(passes.PartitionError, match="not a pipeline") as info:
        passes.manual_partition(gm, 2, {"blocks.0": 1, "blocks.1": 0})
    assert "blocks.0" in str(info.value) and "blocks.1" in str(info.value)


@pytest.mark.parametrize("bad", [2, 5, -1])
def test_manual_partition_rejects_out_of_range_stage(bad):
    gm = _captured("GPT").graph_module
    with pytest.raises(passes.PartitionError) as info:
        passes.manual_partition(gm, 2, {"blocks.0": 0, "blocks.2": bad})
    message = str(info.value)
    assert "'blocks.2'" in message and str(bad) in message and "below the number of stages, 2" in message


def test_manual_partition_rejects_an_empty_partition():
    gm = _captured("GPT").graph_module
    with pytest.raises(passes.PartitionError, match="received no operations") as info:
        passes.manual_partition(gm, 3, GPT_TWO_HALVES)
    assert "[2]" in str(info.value)


def test_manual_partition_colocate_names_the_tied_parameter():
    gm = _captured("GPT").graph_module
    with pytest.raises(passes.PartitionError, match="tok.weight") as info:
        passes.manual_partition(gm, 2, GPT_TWO_HALVES, colocate_shared=True)
    assert "[0, 1]" in str(info.value)
    # Without colocation the same map is fine, with the embedding replicated.
    assert passes.manual_partition(gm, 2, GPT_TWO_HALVES).shared_parameters == {"tok.weight": [0, 1]}


# --- 7. capture errors -------------------------------------------------------------------------


def test_data_dependent_control_flow_is_a_capture_error():
    model = DataDependentBranch()
    x = torch.randn(3, 8)
    # Make sure torch itself rejects it (non-strict export), so the test exercises smp's wrapper.
    with pytest.raises(Exception) as raw:  # noqa: B017 - the tracer raises several types
        torch.export.export(model, (x,), strict=False)
    with pytest.raises(passes.CaptureError) as info:
        passes.capture(model, (x,))
    message = str(info.value)
    assert "DataDependentBranch" in message
    assert "torch.cond" in message and "smp.partition" in message
    assert type(raw.value).__name__ in message
    assert type(info.value.__cause__) is type(raw.value)
    assert isinstance(info.value, RuntimeError)


def test_capture_is_flat_and_shares_the_module_parameters():
    model, args, _ = _make_case("DictInTupleOut")
    captured = passes.capture(model, args)
    gm = captured.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 2  # batch["gate"], batch["x"] (flattened dict leaves)
    assert captured.input_requires_grad == [leaf.requires_grad for leaf in pytree.tree_leaves((args, {}))]
    assert len(captured.output_nodes()) == 2
    for name, p in model.named_parameters():
        assert gm.get_parameter(name) is p, name
    assert not any(n.op == "call_module" for n in gm.graph.nodes)


# --- 8. cost ---------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,inp,out", [(4, 16, 8), (3, 5, 7)])
def test_linear_flops_and_activation_bytes(batch, inp, out):
    model = nn.Sequential(nn.Linear(inp, out))
    gm = passes.capture(model, (torch.randn(batch, inp),)).graph_module
    cost.annotate(gm)
    (linear,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linear.meta[cost.FLOPS] == 2 * batch * inp * out
    assert linear.meta[cost.ACTIVATION_BYTES] == batch * out * 4
    assert all(
        cost.FLOPS not in n.meta for n in gm.graph.nodes if n.op in ("placeholder", "get_attr", "output")
    )


def test_elementwise_costs_and_measured_seconds():
    gm = passes.capture(MatmulRelu(), (torch.randn(2, 3, 5), torch.randn(2, 5, 7))).graph_module
    seconds = {n.name: 0.25 for n in gm.graph.nodes}
    cost.annotate(gm, seconds=seconds)
    (relu,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default]
    assert relu.meta[cost.FLOPS] == 2 * 3 * 7
    assert relu.meta[cost.ACTIVATION_BYTES] == 2 * 3 * 7 * 4
    assert relu.meta[cost.SECONDS] == 0.25
    # Measured seconds replace FLOPs as the compute of a segment.
    (segment,) = passes.segments(gm, depth=1)
    assert segment.compute == pytest.approx(0.25 * len(segment.nodes))


def test_matmul_flops():
    gm = passes.capture(MatmulRelu(), (torch.randn(2, 3, 5), torch.randn(2, 5, 7))).graph_module
    cost.annotate(gm)
    (mm,) = [n for n in gm.graph.nodes if n.op == "call_function" and "relu" not in str(n.target)]
    assert mm.meta[cost.FLOPS] == 2 * 2 * 3 * 5 * 7


def test_embedding_lookup_flops_do_not_scale_with_the_table():
    gm = passes.capture(nn.Embedding(10_000, 8), (torch.tensor([[1, 2, 3], [4, 5, 6]]),)).graph_module
    cost.annotate(gm)
    (lookup,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default]
    assert lookup.meta[cost.FLOPS] <= 2 * 3 * 8


# --- 9. plan_from_assignment ----------------------------------------------------------------


@pytest.mark.parametrize("name,stages", [("GPT", 2), ("GPT", 4), ("TwiceCalled", 3), ("LongSkip", 4)])
def test_plan_from_assignment_reproduces_the_plan(name, stages):
    gm = _captured(name).graph_module
    plan = passes.auto_partition(gm, stages)
    again = passes.plan_from_assignment(gm, plan.node_stage, stages)
    assert again.stage_parameters == plan.stage_parameters
    assert again.shared_parameters == plan.shared_parameters
    assert again.stage_units == plan.stage_units
    assert again.stage_parameter_bytes == plan.stage_parameter_bytes
    assert again.node_stage == plan.node_stage
    assert len(again.stage_cost) == stages and sum(again.stage_cost) == pytest.approx(1.0)


# --- 10. segments ----------------------------------------------------------------------------


def test_segments_follow_module_calls_in_order():
    gm = _captured("GPT").graph_module
    segs = passes.segments(gm, depth=1)
    keys = [s.key for s in segs]
    named = [k for k in keys if k]
    assert named == ["tok", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "head"]
    assert set(keys) - set(named) <= {""}
    # Every compute node is in exactly one segment, in graph order.
    assert [n for s in segs for n in s.nodes] == _compute_nodes(gm)
    total = sum(n.meta[cost.FLOPS] for n in gm.graph.nodes if cost.FLOPS in n.meta)
    assert sum(s.compute for s in segs) == pytest.approx(total)
    by_key = {s.key: s for s in segs if s.key}
    assert by_key["tok"].parameters == {"tok.weight"}
    assert by_key["head"].parameters == {"tok.weight"}  # the tied head reads the canonical name
    assert by_key["ln_f"].parameters == {"ln_f.weight", "ln_f.bias"}
    assert len(by_key["blocks.0"].parameters) == 11
    deeper = [s.key for s in passes.segments(gm, depth=2)]
    assert "blocks.0.attn" in deeper and "blocks.0.mlp" in deeper and "blocks.0.ln1" in deeper
    assert len(deeper) > len(keys)


# --- helper models ---------------------------------------------------------------------------


class TwoLeaves(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        return self.b(self.a(x))


class BigEmbedding(nn.Module):
    """A huge, cheap embedding in front of small, compute-heavy layers."""

    def __init__(self, vocab: int = 20_000, dim: int = 64, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers))
        self.out = nn.Linear(dim, 1)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class DataDependentBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


class MatmulRelu(nn.Module):
    def forward(self, a, b):
        return torch.relu(a @ b)


# --- review findings ---------------------------------------------------------------------


class _Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))

    def forward(self, x):
        return self.net(x)


class _Outer(nn.Module):
    """Wrapper modules add call depth without adding units."""

    def __init__(self):
        super().__init__()
        self.model = _Wrapped()

    def forward(self, x):
        return self.model(x)


def test_auto_partition_looks_through_wrapper_modules():
    module = _Outer()
    captured = passes.capture(module, (torch.randn(2, 8),))
    cost.annotate(captured.graph_module)
    plan = passes.auto_partition(captured.graph_module, 2)
    assert plan.stage_units == [["model.net.0", "model.net.1"], ["model.net.2", "model.net.3"]]


def test_stage_may_start_with_an_in_place_op_on_a_received_value():
    layers = [nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 1)]
    module = nn.Sequential(*layers)
    x = torch.randn(4, 8)
    captured = passes.capture(module, (x,))
    cost.annotate(captured.graph_module)
    plan = passes.manual_partition(captured.graph_module, 2, {"0": 0, "1": 1, "2": 1, "3": 1, "4": 1})
    first, second = passes.split(captured, plan).stages
    received = first.module(x)[0].detach().requires_grad_(True)  # as the runtime receives it: a leaf
    (out,) = second.module(received)
    out.sum().backward()
    torch.testing.assert_close(out, module(x))
    assert received.grad is not None and received.grad.abs().sum() > 0


class _MaskedLayers(nn.Module):
    """Two layers; the second reads a mask and a flat label view computed from the model inputs
    alone, in the first layer's code (as Hugging Face models build their attention masks)."""

    def __init__(self, variant: str = "plain"):
        super().__init__()
        self.variant = variant
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, ids):
        mask = (ids != 0).to(x.dtype).unsqueeze(-1)
        if self.variant == "random":
            mask = mask * torch.rand_like(mask)
        if self.variant == "written":
            mask.mul_(2.0)
        h = self.first(x) * mask
        labels = ids.reshape(-1)
        return (self.second(h) * mask).sum() + labels.float().mean()


def _masked_split(variant: str):
    torch.manual_seed(0)
    module = _MaskedLayers(variant)
    x, ids = torch.randn(2, 5, 8), torch.tensor([[1, 2, 0, 3, 0], [0, 4, 5, 0, 6]])
    captured = passes.capture(module, (x, ids))
    cost.annotate(captured.graph_module)
    plan = passes.manual_partition(captured.graph_module, 2, {"first": 0, "second": 1}, default_stage=0)
    return module, (x, ids), passes.split(captured, plan)


def test_values_computed_from_the_inputs_alone_are_computed_again_not_sent():
    module, (x, ids), pipe = _masked_split("plain")
    first, second = pipe.stages
    # Only the hidden state crosses; the second stage reads `ids` and builds its mask itself.
    assert [pipe.values[n].dtype for n in second.received] == [torch.float32], second.received
    assert second.inputs == [1], second.inputs
    ops = [n.target for n in second.module.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.ne.Scalar in ops and torch.ops.aten.reshape.default in ops, ops
    torch.testing.assert_close(pipe.run(x, ids), module(x, ids), rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", ["random", "written"])
def test_random_or_written_input_values_are_sent(variant):
    """A random draw would differ on each stage, and a stage computing a value again would miss
    an in-place write to it: those are sent as before."""
    module, (x, ids), pipe = _masked_split(variant)
    second = pipe.stages[1]
    ops = [n.target for n in second.module.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.ne.Scalar not in ops and torch.ops.aten.rand_like.default not in ops, ops
    assert len(second.received) >= 2, second.received  # the hidden state and the mask
    if variant == "written":
        torch.testing.assert_close(pipe.run(x, ids), module(x, ids), rtol=0, atol=1e-6)


def test_tensor_parallel_rule_registry_refuses_a_second_rule_for_an_op():
    from smp.passes.tensor_parallel import registry

    linear = torch.ops.aten.linear.default
    assert registry.lookup(linear) is not None
    with pytest.raises(ValueError, match=r"two tensor-parallel rules for aten\.linear\.default"):
        registry.rule(linear)(lambda rewrite, node: None)
    # Pointwise ops without a rule of their own find the rule of their tag.
    assert registry.lookup(torch.ops.aten.gelu.default) is registry.lookup(torch.Tag.pointwise)


def test_tensor_parallel_restarts_are_bounded_by_the_demotable_keys():
    from smp.passes.tensor_parallel import Demote, _run_with_demotions

    def demote_each_once(keys):
        pending = list(keys)

        def attempt():
            if pending:
                raise Demote(pending.pop(0), "heads do not divide")
            return "rewritten"

        return attempt

    replicated: dict[str, str] = {}
    assert _run_with_demotions(demote_each_once(["a", "b"]), replicated, {"a", "b", "c"}) == "rewritten"
    assert replicated == {"a": "heads do not divide", "b": "heads do not divide"}

    def same_key_forever():
        raise Demote("blocks.0", "read whole elsewhere")

    with pytest.raises(RuntimeError, match=r"demoted blocks\.0 again \(read whole elsewhere\)"):
        _run_with_demotions(same_key_forever, {}, {"blocks.0"})

    counter = iter(range(100))

    def new_stray_key_forever():
        raise Demote(f"stray{next(counter)}", "made up")

    stray = r"2 restarts, more than the 1 modules .* 1\. stray0: made up; 2\. stray1: made up"
    with pytest.raises(RuntimeError, match=stray):
        _run_with_demotions(new_stray_key_forever, {}, {"x"})


class _ThreeRanks:
    """What the rewrite reads of a process group (it runs no collective)."""

    group_name = "unused"

    def size(self):
        return 3

    def rank(self):
        return 0


def test_tensor_parallel_demoted_module_list_covers_its_layers():
    """Layers in an nn.ModuleList whose features do not divide: demoting the list (a path no node's
    module stack holds) keeps every layer under it whole, instead of demoting it again."""
    model = models.DictInTupleOut()
    batch = {"x": torch.randn(6, 16), "gate": torch.randn(6, 16)}
    captured = passes.capture(model, (batch,))
    flat = captured.flatten_inputs((batch,), {})
    expected = captured.graph_module(batch)  # (the rewritten graph takes the flat leaves)
    marked = {path for path, _ in model.named_modules()}
    result = passes.tensor_parallel(captured.graph_module, _ThreeRanks(), marked)
    assert result.specs == {}
    assert (
        "layers" in result.replicated and "divide by tensor_parallel_degree=3" in result.replicated["layers"]
    )
    for got, want in zip(captured.graph_module.forward(*flat), expected, strict=True):  # (no input hooks)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _LinearSpellings(torch.nn.Module):
    """One linear layer spelled every way models spell it, and two products that are none."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4))  # [out, in]
        self.w_in_out = torch.nn.Parameter(torch.randn(4, 8))  # [in, out]
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        spelled = [
            x @ self.w.T + self.b,
            torch.matmul(x, self.w.t()),
            x @ self.w.transpose(0, 1),
            x @ self.w.permute(1, 0),
            torch.einsum("bsi,oi->bso", x, self.w),
            torch.einsum("oi,bsi->bso", self.w, x),
            self.b + torch.einsum("bsi,io->bso", x, self.w_in_out),
            torch.matmul(x, self.w_in_out),
        ]
        not_linear = [self.w @ self.w_in_out, torch.einsum("bsi,oi->bos", x, self.w)]
        return spelled, not_linear


def test_linear_spellings_become_linear_layers_computing_the_same():
    from smp.passes.linear_forms import canonicalize_linears, linear_in_out

    model, x = _LinearSpellings(), torch.randn(2, 3, 4)
    captured = passes.capture(model, (x,))
    expected = captured.graph_module(x)
    assert canonicalize_linears(captured.graph_module) == 8 + 2  # two biases folded
    nodes = [n for n in captured.graph_module.graph.nodes if n.op == "call_function"]
    linears = [n for n in nodes if n.target in (torch.ops.aten.linear.default, linear_in_out)]
    assert len(linears) == 8 and sum(len(n.args) == 3 for n in linears) == 2
    assert not any(n.target is torch.ops.aten.add.Tensor for n in nodes)  # biases folded in
    assert {str(n.target) for n in nodes} - {str(n.target) for n in linears} == {
        "aten.matmul.default",
        "aten.einsum.default",
    }
    for got, want in zip(captured.graph_module(x), expected, strict=True):
        torch.testing.assert_close(got, want)
