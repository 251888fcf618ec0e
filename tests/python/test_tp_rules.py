"""The tensor-parallel rules (smp.passes.tensor_parallel: registry.py, rules/) in one process, with no
process group.

- test_lookup_finds_each_family_rule: registry.lookup gives the linear and embedding rules of
  rules.layers, the pointwise rule of rules.elementwise for an op tagged pointwise that has no rule of
  its own (and an op's own rule over its tag's), with the carries/uses_shards flags the pay-off walk
  reads; None (and neither flag) for ops without a rule.
- test_every_linear_form_has_a_rule_that_uses_shards: every op smp.passes.linear_forms turns a linear
  spelling into is cut by a rule that consumes shards (otherwise the rewrite would gather around it).
- test_registering_*: @rule on fresh private ops (removed from the table afterwards): it registers
  every op given with its flags, stacked decorators give one function different flags, a second rule
  for an op raises ValueError naming both functions and leaves the first in place, and
  carries=True with uses_shards=True raises before registering anything.
- test_rewritten_block_runs_as_two_ranks_in_one_process: the whole rewrite, functional. A transformer
  block (and one whose linears are spelled as x @ W.T, einsum and matmul on an [in, out] weight) is
  rewritten for rank 0 and for rank 1 of a two-rank group that exists only as a size and a rank (the
  rewrite runs no collective). The sharding is Megatron's pairing, written out by hand. The two
  rewritten graphs then run in two threads of this process, with the smp ops swapped for their
  definitions (smp.ops' docstrings: column-parallel is a local linear, row-parallel a local product
  summed over the ranks plus the bias, tp_gather/tp_split/tp_reduce/tp_copy the collectives they
  name) over an in-memory exchange: both ranks' outputs equal the unsharded block's.

Not repeated here (test_passes.py has them): a second rule for aten.linear raising, gelu finding the
pointwise tag's rule, and canonicalize_linears on every spelling computing the same values.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import threading

import models
import pytest
import torch
import torch.nn.functional as F
from smp import passes
from smp.passes.linear_forms import grouped_linear, linear_in_out
from smp.passes.tensor_parallel import registry, rules
from smp.passes.tensor_parallel.layout import ShardSpec

aten = torch.ops.aten


# --- the table ---------------------------------------------------------------------------


def test_lookup_finds_each_family_rule():
    linear = registry.lookup(aten.linear.default)
    assert linear.apply is rules.layers.linear
    assert (linear.carries, linear.uses_shards) == (False, True)
    embedding = registry.lookup(aten.embedding.default)
    assert embedding.apply is rules.layers.embedding
    assert (embedding.carries, embedding.uses_shards) == (False, False)
    for op in (aten.mul.Tensor, aten.tanh.default, aten.add.Tensor):  # pointwise, no rule of their own
        assert torch.Tag.pointwise in op.tags and op not in registry._RULES, op
        found = registry.lookup(op)
        assert found.apply is rules.elementwise.pointwise, op
        assert registry.carries(op) and not registry.uses_shards(op), op
    # clone is tagged pointwise too, but its own rule wins over the tag's.
    assert torch.Tag.pointwise in aten.clone.default.tags
    assert registry.lookup(aten.clone.default).apply is rules.elementwise.unchanged
    assert registry.lookup(operator.getitem).apply is rules.shape.getitem
    for op in (aten.sort.default, aten.cumsum.default, aten.mm.default, aten.index_select.default):
        assert registry.lookup(op) is None, op
        assert not registry.carries(op) and not registry.uses_shards(op), op
    assert registry.lookup(object()) is None  # not an op at all: no tag to fall back on


def test_every_linear_form_has_a_rule_that_uses_shards():
    for op in (aten.linear.default, linear_in_out, aten.addmm.default, grouped_linear):
        found = registry.lookup(op)
        assert found is not None and found.uses_shards and not found.carries, op
        assert found.apply.__module__ == rules.layers.__name__, op


@contextlib.contextmanager
def _private_ops(count: int):
    """Fresh keys for the rule table (any hashable target can hold a rule), removed afterwards."""
    ops = [type(f"_PrivateOp{i}", (), {})() for i in range(count)]
    try:
        yield ops
    finally:
        for op in ops:
            registry._RULES.pop(op, None)


def test_registering_rules_for_private_ops():
    with _private_ops(4) as (a, b, c, d):

        def first(rewrite, node):
            return None

        assert registry.rule(a, b, carries=True)(first) is first  # the decorator returns the function
        assert registry.lookup(a) == registry.Rule(first, True, False)
        assert registry.lookup(b) == registry.Rule(first, True, False)

        @registry.rule(c, uses_shards=True)
        @registry.rule(d, carries=True)
        def stacked(rewrite, node):
            return None

        assert registry.lookup(c) == registry.Rule(stacked, False, True)
        assert registry.lookup(d) == registry.Rule(stacked, True, False)
    assert all(registry.lookup(op) is None for op in (a, b, c, d))  # the table is as it was


def test_registering_a_second_rule_names_both_and_keeps_the_first():
    with _private_ops(1) as (op,):

        def kept_rule(rewrite, node):
            return None

        def late_rule(rewrite, node):
            return None

        registry.rule(op)(kept_rule)
        with pytest.raises(ValueError) as raised:
            registry.rule(op, carries=True)(late_rule)
        message = str(raised.value)
        assert "two tensor-parallel rules" in message
        assert kept_rule.__qualname__ in message and late_rule.__qualname__ in message
        assert registry.lookup(op) == registry.Rule(kept_rule, False, False)


def test_registering_a_rule_that_carries_and_uses_shards_raises():
    with _private_ops(1) as (op,):
        with pytest.raises(ValueError, match="either carries shards on or uses them, not both"):
            registry.rule(op, carries=True, uses_shards=True)
        assert registry.lookup(op) is None


# --- the rewrite, run as two ranks -------------------------------------------------------


class _Rank:
    """What the rewrite reads of a process group: its size, this rank and a name (no collective runs)."""

    group_name = "two-ranks-in-one-process"

    def __init__(self, rank: int):
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank


class _Exchange:
    """The two ranks' collectives in memory: each rank hands its tensor over and gets both."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=60)  # a guard against a hang, not a wait
        self._slots: list[torch.Tensor | None] = [None, None]

    def all_gather(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = tensor
        self.barrier.wait()
        parts = list(self._slots)
        self.barrier.wait()  # both have read before either writes again
        return parts

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        first, second = self.all_gather(rank, tensor)
        return first + second  # the same order on both ranks


def _definitions(exchange: _Exchange, rank: int) -> dict:
    """smp's tensor-parallel ops as smp.ops documents them, over `exchange`."""
    smp_ops = torch.ops.smp

    def row_parallel(x, weight, bias, group):
        out = exchange.all_reduce(rank, F.linear(x, weight))
        return out if bias is None else out + bias

    return {
        smp_ops.column_parallel_linear.default: lambda x, weight, bias, group: F.linear(x, weight, bias),
        smp_ops.row_parallel_linear.default: row_parallel,
        smp_ops.tp_gather.default: lambda x, dim, group: torch.cat(exchange.all_gather(rank, x), dim),
        smp_ops.tp_split.default: lambda x, dim, scale, group: x.chunk(2, dim)[rank].contiguous(),
        smp_ops.tp_reduce.default: lambda x, group: exchange.all_reduce(rank, x),
        smp_ops.tp_copy.default: lambda x, group: x,
    }


def _rewritten(captured: passes.CapturedGraph, marked: set[str], rank: int):
    """A copy of the captured graph, rewritten for `rank` of two."""
    gm = copy.deepcopy(captured.graph_module)
    return gm, passes.tensor_parallel(gm, _Rank(rank), marked)


def _run_ranks(graphs, exchange: _Exchange, x: torch.Tensor) -> list:
    results, errors = [None, None], []

    def run(rank: int) -> None:
        try:
            results[rank] = graphs[rank].forward(x)  # (the flat inputs)
        except BaseException as error:  # the other rank's barrier breaks instead of waiting
            errors.append(error)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


_ATTENTION = {"attn.qkv.weight": ShardSpec(0, 3), "attn.proj.weight": ShardSpec(1)}  # q/k/v fused: 3 blocks
BLOCKS = {
    "plain": (
        lambda: models.Block(16, 4),
        _ATTENTION
        | {
            "mlp.0.weight": ShardSpec(0),  # column-parallel up projection and its bias
            "mlp.0.bias": ShardSpec(0),
            "mlp.2.weight": ShardSpec(1),  # row-parallel down projection (its bias stays whole)
        },
    ),
    # x @ W.T attention projections, an einsum up projection with a bias, a matmul on [in, out].
    "spelled": (
        lambda: models.Block(16, 4, attention=models.RawLinearAttention, mlp=models.EinsumMLP),
        _ATTENTION | {"mlp.up": ShardSpec(0), "mlp.up_bias": ShardSpec(0), "mlp.down": ShardSpec(0)},
    ),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_rewritten_block_runs_as_two_ranks_in_one_process(name):
    make, expected_specs = BLOCKS[name]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = model(x)
    captured = passes.capture(copy.deepcopy(model), (x,))
    marked = {path for path, _ in model.named_modules()}
    graphs = []
    exchange = _Exchange()
    for rank in range(2):
        gm, result = _rewritten(captured, marked, rank)
        assert result.specs == expected_specs, result.specs
        assert result.replicated == {}
        params = dict(model.named_parameters())
        for target, spec in result.specs.items():  # this rank holds half of each cut parameter
            local_shape = list(params[target].shape)
            local_shape[spec.dim] //= 2
            assert list(gm.get_parameter(target).shape) == local_shape, target
            # The graph records the shard's value too, so ops over it are inferred on local shapes
            # (issue 31: a whole bias beside a local weight made the C++ op throw on fakes).
            (read,) = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == target]
            assert list(read.meta["val"].shape) == local_shape, target
        definitions = _definitions(exchange, rank)
        called = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        smp_called = {t for t in called if getattr(t, "namespace", None) == "smp"}
        assert smp_called <= definitions.keys(), smp_called - definitions.keys()
        assert torch.ops.smp.row_parallel_linear.default in smp_called  # one per pair, forward
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in definitions:
                node.target = definitions[node.target]
        gm.recompile()
        graphs.append(gm)
    with torch.no_grad():
        outputs = _run_ranks(graphs, exchange, x)
    for got in outputs:
        (got,) = got
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
