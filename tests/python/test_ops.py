"""Tests of the tensor-parallel custom ops (ops/, python/smp/ops.py).

In this process, over an smp group of one rank: torch.library.opcheck, gradcheck in float64,
torch.compile (fullgraph, forward and backward, with the collectives visible in the AOT graphs),
torch.export, the fake kernels, every dtype, the argument checks. On 2 and 4 real processes: every op
against the dense computation with the full weights. On CUDA where there is one.
"""

from __future__ import annotations

import pytest
import smp  # noqa: F401  (registers the backend and the ops)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from smp import ops

ATOL = RTOL = 1e-5  # float32 parity


# --- one call of every op, at world size 1 -----------------------------------


def _randn(*shape, dtype=torch.float32, device="cpu", grad=True):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(grad)


def _cases(dtype=torch.float32, device="cpu"):
    """{case: (op, args)} covering every op, with the group name last."""

    def r(*shape):
        return _randn(*shape, dtype=dtype, device=device)

    torch.manual_seed(0)
    ids = torch.randint(0, 12, (3, 5), device=device)
    ids[0, :3] = torch.tensor([4, 2, 11])  # the padding row, ids of another shard, the last id
    target = torch.randint(0, 10, (2, 3, 4), device=device)
    target[0, 0, :2] = torch.tensor([-100, 13])  # ignored, and a class of another shard
    return {
        "column_bias": (torch.ops.smp.column_parallel_linear, (r(2, 3, 5), r(6, 5), r(6))),
        "column_nobias": (torch.ops.smp.column_parallel_linear, (r(4, 5), r(6, 5), None)),
        "column_1d": (torch.ops.smp.column_parallel_linear, (r(5), r(6, 5), r(6))),
        "row_bias": (torch.ops.smp.row_parallel_linear, (r(2, 3, 5), r(6, 5), r(6))),
        "row_nobias": (torch.ops.smp.row_parallel_linear, (r(4, 5), r(6, 5), None)),
        # This rank holds ids [2, 10); 4 is the padding row.
        "embedding_pad": (torch.ops.smp.vocab_parallel_embedding, (ids, r(8, 4), 2, 4)),
        "embedding_int32": (torch.ops.smp.vocab_parallel_embedding, (ids.int(), r(8, 4), 2, -1)),
        # This rank holds classes [3, 13).
        "cross_entropy": (torch.ops.smp.vocab_parallel_cross_entropy, (r(2, 3, 4, 10), target + 3, 3, -100)),
        "gather_last": (torch.ops.smp.tp_gather, (r(2, 3, 4), -1)),
        "gather_first": (torch.ops.smp.tp_gather, (r(2, 3, 4), 0)),
        # Moved back along dim 1, the gathered [3, 1] is a contiguous view of shape [1, 3].
        "gather_size1": (torch.ops.smp.tp_gather, (r(1, 3), 1)),
        "split": (torch.ops.smp.tp_split, (r(2, 6, 4), 1, 1.0)),
        "split_scaled": (torch.ops.smp.tp_split, (r(2, 6, 4), -1, 0.5)),
        "reduce": (torch.ops.smp.tp_reduce, (r(2, 3, 4),)),
        "copy": (torch.ops.smp.tp_copy, (r(2, 3, 4),)),
    }


CASES = list(_cases())


def _args(case, group, **kw):
    op, args = _cases(**kw)[case]
    return op, (*args, group.group_name)


def _float_inputs(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]


# --- opcheck ------------------------------------------------------------------


@pytest.fixture
def opcheck_exempting_wait_tensor(monkeypatch):
    """torch.library.opcheck, minus the checks that torch's own wait_tensor fails.

    The ops' Autograd kernels run first, so opcheck's test_schema (SchemaCheckMode) and
    test_faketensor (CrossRefFakeMode) inspect the ops they call. torch's
    _c10d_functional::wait_tensor returns its input, while its schema and its meta kernel say it
    returns a new tensor: both checks reject it whoever calls it. They are exempted from checking
    torch's _c10d_functional ops; our ops' outputs are checked for aliasing in test_no_aliasing.
    """
    from torch._subclasses.schema_check_mode import SchemaCheckMode
    from torch.testing._internal.optests import fake_tensor as optests_fake_tensor
    from torch.testing._internal.optests import generate_tests as optests_generate

    class SchemaCheckModeSkippingWait(SchemaCheckMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops._c10d_functional.wait_tensor.default:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    monkeypatch.setattr(optests_generate, "SchemaCheckMode", SchemaCheckModeSkippingWait)
    is_builtin = optests_fake_tensor.is_builtin
    monkeypatch.setattr(
        optests_fake_tensor, "is_builtin", lambda op: is_builtin(op) or op.namespace == "_c10d_functional"
    )
    return torch.library.opcheck


@pytest.mark.parametrize("case", CASES)
def test_opcheck(group, case, opcheck_exempting_wait_tensor):
    op, args = _args(case, group)
    opcheck_exempting_wait_tensor(op.default, args)


@pytest.mark.parametrize("case", CASES)
def test_gradcheck(group, case):
    op, args = _args(case, group, dtype=torch.float64)
    if case == "split_scaled":
        pytest.skip("grad_scale != 1 scales the gradient on purpose")
    if case == "embedding_pad":
        pytest.skip("the padding row gets no gradient on purpose, as in nn.Embedding")
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

    def fn(*inputs):
        full = list(args)
        for i, t in zip(positions, inputs, strict=True):
            full[i] = t
        return op(*full)

    assert torch.autograd.gradcheck(fn, [args[i] for i in positions])


def test_grad_scale(group):
    x = _randn(2, 6)
    ops.tp_split(x, 1, grad_scale=0.25, group=group).backward(torch.ones(2, 6))
    torch.testing.assert_close(x.grad, torch.full((2, 6), 0.25))


@pytest.mark.parametrize("case", CASES)
def test_no_aliasing(group, case):
    op, args = _args(case, group)
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):  # autograd and plain kernels
        with mode():
            out = op(*args)
        for a in args:
            if isinstance(a, torch.Tensor):
                assert not torch._C._overlaps(out, a), (
                    f"{case} under {mode.__name__}: output aliases an input"
                )


@pytest.mark.parametrize("case", CASES)
def test_fake_kernel_matches_real(group, case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, args = _args(case, group)
    with torch.inference_mode():
        real = op(*args)
    with FakeTensorMode() as mode, torch._C._AutoDispatchBelowAutograd():
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args)  # reaches the registered fake kernel, not the autograd kernel
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


# --- the math, in one process --------------------------------------------------


def _dense(case, args):
    """The reference computation of each case with plain torch."""
    if case.startswith("column") or case.startswith("row"):
        x, w, b, _ = args
        return F.linear(x, w, b)
    if case.startswith("embedding"):
        ids, w, start, pad, _ = args
        local = ids.long() - start
        inside = (local >= 0) & (local < w.shape[0])
        out = F.embedding(local.clamp(0, w.shape[0] - 1), w, padding_idx=None if pad < 0 else pad - start)
        return out * inside.unsqueeze(-1)
    if case == "cross_entropy":
        logits, target, start, ignore, _ = args
        local = target - start
        inside = (local >= 0) & (local < logits.shape[-1])
        acc = logits.double() if logits.dtype == torch.float64 else logits.float()
        lse = acc.logsumexp(-1)
        picked = acc.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        loss = lse - picked * inside
        return loss.masked_fill(target == ignore, 0).to(logits.dtype)
    return args[0].clone()  # gather, split and reduce over a group of one


TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-10, 1e-10),
    torch.bfloat16: (5e-2, 2e-2),
    torch.float16: (1e-2, 1e-2),
}


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_every_dtype_matches_plain_torch(group, dtype):
    atol, rtol = TOLERANCES[dtype]
    for case in CASES:
        op, args = _args(case, group, dtype=dtype)
        out = op(*args)
        ref_args = [
            a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
            for a in args
        ]
        ref = _dense(case, ref_args)
        assert out.dtype == dtype, case
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=lambda m, c=case: f"{c}: {m}")
        grad = torch.randn_like(out)
        inputs = _float_inputs(args)
        got = torch.autograd.grad(out, inputs, grad)
        if case == "split_scaled":
            grad = grad * 0.5  # the op scales its gradient by 0.5
        want = torch.autograd.grad(ref, _float_inputs(ref_args), grad)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == dtype, case
            torch.testing.assert_close(
                g, w, atol=atol * 4, rtol=rtol * 4, msg=lambda m, c=case: f"{c} grad: {m}"
            )


def test_embedding_padding_row_gets_no_gradient(group):
    ids = torch.tensor([[0, 1, 1, 3]])
    w = _randn(4, 2)
    ops.vocab_parallel_embedding(ids, w, vocab_start=0, padding_idx=1, group=group).sum().backward()
    torch.testing.assert_close(w.grad, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]))


def test_cross_entropy_ignores_and_accumulates_in_float32(group):
    logits = (torch.randn(3, 7) * 30).to(torch.bfloat16).requires_grad_()
    target = torch.tensor([1, -100, 6])
    loss = ops.vocab_parallel_cross_entropy(logits, target, 0, group=group)
    assert loss.dtype == torch.bfloat16 and loss[1].item() == 0
    ref = F.cross_entropy(logits.float(), target, reduction="none")
    torch.testing.assert_close(loss.float(), ref, atol=0, rtol=1e-2)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and not logits.grad[1].any()


# --- torch.compile -------------------------------------------------------------


class _RecordingBackend:
    """aot_eager that keeps the forward and backward graphs AOTAutograd produced.

    With the min-cut partitioner, as aot_eager and inductor. (aot_autograd's default partitioner
    copies the cross entropy's forward collectives into the backward graph as dead code, a torch
    quirk when all of a collective's inputs are saved for the backward.)
    """

    def __init__(self):
        from functorch.compile import min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        self.forward = []
        self.backward = []
        self.backend = aot_autograd(
            fw_compiler=self._record(self.forward),
            bw_compiler=self._record(self.backward),
            partition_fn=min_cut_rematerialization_partition,
        )

    @staticmethod
    def _record(graphs):
        from functorch.compile import make_boxed_func

        def compiler(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        return compiler


def _collectives(graphs):
    return sorted(
        str(node.target).split(".")[1]
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "call_function"
        and str(node.target).startswith("_c10d_functional.")
        and "wait_tensor" not in str(node.target)
    )


# case -> the collectives expected in the forward and the backward graph
COMPILED = {
    "column_bias": ([], ["all_reduce"]),
    "row_bias": (["all_reduce"], []),
    "embedding_pad": (["all_reduce"], []),
    "cross_entropy": (["all_reduce", "all_reduce"], []),
    "gather_last": (["all_gather_into_tensor"], []),
    "split": ([], ["all_gather_into_tensor"]),
    "reduce": (["all_reduce"], []),
    "copy": ([], ["all_reduce"]),
}


def _eager_and_compiled(fn, args, backend):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    results = []
    for f in (fn, compiled):
        leaves = [
            a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a
            for a in args
        ]
        out = f(*leaves)
        grads = torch.autograd.grad(out, _float_inputs(leaves), torch.ones_like(out))
        results.append((out, grads))
    return results


@pytest.mark.parametrize("case", list(COMPILED))
def test_compile_fullgraph_shows_collectives(group, case):
    op, args = _cases()[case]

    def fn(*tensors):
        return op(*tensors, group.group_name)

    recorder = _RecordingBackend()
    (out, grads), (c_out, c_grads) = _eager_and_compiled(fn, args, recorder.backend)
    torch.testing.assert_close(c_out, out, atol=ATOL, rtol=RTOL)
    for c, e in zip(c_grads, grads, strict=True):
        torch.testing.assert_close(c, e, atol=ATOL, rtol=RTOL)
    forward, backward = COMPILED[case]
    assert _collectives(recorder.forward) == forward
    assert _collectives(recorder.backward) == backward


def _tiny_model(x, ids, target, w_emb, w1, b1, w2, b2, group):
    """Every op through the Python wrappers, which take the ProcessGroup."""
    h = x + ops.vocab_parallel_embedding(ids, w_emb, 0, 0, group)
    h = ops.tp_gather(ops.tp_split(h, -1, 1.0, group), -1, group)
    h = ops.column_parallel_linear(h, w1, b1, group)
    h = ops.row_parallel_linear(F.gelu(h), w2, b2, group)
    logits = F.linear(ops.tp_copy(ops.tp_reduce(h, group), group), w_emb)
    return ops.vocab_parallel_cross_entropy(logits, target, 0, -100, group)


def _tiny_model_args(group):
    torch.manual_seed(1)
    target = torch.randint(0, 10, (2, 3))
    target[0, 0] = -100
    return (
        _randn(2, 3, 4),
        torch.randint(0, 10, (2, 3)),
        target,
        _randn(10, 4),
        _randn(8, 4),
        _randn(8),
        _randn(4, 8),
        _randn(4),
        group,
    )


def test_compile_aot_eager_every_op_through_the_wrappers(group):
    (out, grads), (c_out, c_grads) = _eager_and_compiled(_tiny_model, _tiny_model_args(group), "aot_eager")
    torch.testing.assert_close(c_out, out, atol=ATOL, rtol=RTOL)
    for c, e in zip(c_grads, grads, strict=True):
        torch.testing.assert_close(c, e, atol=ATOL, rtol=RTOL)


def _mlp(x, w1, b1, w2, b2, group):
    return ops.row_parallel_linear(F.gelu(ops.column_parallel_linear(x, w1, b1, group)), w2, b2, group)


def test_compile_inductor_linear_ops(group):
    args = (_randn(2, 3, 4), _randn(8, 4), _randn(8), _randn(4, 8), _randn(4), group)
    (out, grads), (c_out, c_grads) = _eager_and_compiled(_mlp, args, "inductor")
    torch.testing.assert_close(c_out, out, atol=ATOL, rtol=RTOL)
    for c, e in zip(c_grads, grads, strict=True):
        torch.testing.assert_close(c, e, atol=ATOL, rtol=RTOL)


def test_export_keeps_the_ops_and_decomposes_to_collectives(group):
    class Tiny(torch.nn.Module):
        def forward(self, *args):
            return _tiny_model(*args, group)

    args = _tiny_model_args(group)[:-1]
    exported = torch.export.export(Tiny(), args)
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    # (the mixture-of-experts exchange is exported in its own test: test_moe_ops.py)
    assert {f"smp.{name}.default" for name in ops.__all__ if not name.startswith("moe_")} <= targets
    torch.testing.assert_close(exported.module()(*args), Tiny()(*args))
    decomposed = exported.run_decompositions()
    targets = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("smp.") for t in targets)
    assert "_c10d_functional.all_gather_into_tensor.default" in targets


# --- argument checks -----------------------------------------------------------


def test_argument_errors_name_the_bad_value(group):
    g = group.group_name
    linear = torch.ops.smp.column_parallel_linear
    with pytest.raises(RuntimeError, match=r"input's last dimension \(5\) must equal weight.size\(1\) \(4\)"):
        linear(torch.randn(2, 5), torch.randn(6, 4), None, g)
    with pytest.raises(RuntimeError, match=r"bias must have shape \[6\].*got shape \[5\]"):
        linear(torch.randn(2, 4), torch.randn(6, 4), torch.randn(5), g)
    with pytest.raises(RuntimeError, match="weight has dtype Double but input has dtype Float"):
        torch.ops.smp.row_parallel_linear(torch.randn(2, 4), torch.randn(6, 4, dtype=torch.float64), None, g)
    with pytest.raises(IndexError, match=r"tp_gather: dim 3 is out of range for a tensor of 2 dimension"):
        torch.ops.smp.tp_gather(torch.randn(2, 4), 3, g)
    with pytest.raises(IndexError, match=r"tp_split: dim -3 is out of range"):
        torch.ops.smp.tp_split(torch.randn(2, 4), -3, 1.0, g)
    with pytest.raises(RuntimeError, match="indices must be int64 or int32, got Float"):
        torch.ops.smp.vocab_parallel_embedding(torch.zeros(3), torch.randn(4, 2), 0, -1, g)
    with pytest.raises(RuntimeError, match=r"padding_idx must be .* got -2"):
        torch.ops.smp.vocab_parallel_embedding(torch.zeros(3, dtype=torch.long), torch.randn(4, 2), 0, -2, g)
    with pytest.raises(RuntimeError, match=r"target shape \[2, 4\] must equal .* \[2, 3\]"):
        torch.ops.smp.vocab_parallel_cross_entropy(
            torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), 0, -1, g
        )
    with pytest.raises(RuntimeError, match="target must be int64 class ids, got Int"):
        torch.ops.smp.vocab_parallel_cross_entropy(
            torch.randn(2, 5), torch.zeros(2, dtype=torch.int), 0, -1, g
        )


# --- parity on real process groups ----------------------------------------------


def _shard(t, dim, rank, world_size):
    return t.chunk(world_size, dim)[rank].detach().clone().requires_grad_()


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _close(got, want, what):
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def check_parity(rank, world_size, with_compile):
    group = dist.group.WORLD
    torch.manual_seed(0)  # every rank builds the same full tensors, then takes its slice

    # Megatron MLP: column then row == the dense MLP.
    x, w1, b1, w2, b2 = (torch.randn(*s) for s in [(3, 5, 6), (8, 6), (8,), (6, 8), (6,)])
    gy = torch.randn(3, 5, 6)
    xs, b2s = _leaf(x), _leaf(b2)  # replicated
    w1s, b1s = _shard(w1, 0, rank, world_size), _shard(b1, 0, rank, world_size)  # output features
    w2s = _shard(w2, 1, rank, world_size)  # input features
    y = _mlp(xs, w1s, b1s, w2s, b2s, group)
    y.backward(gy)
    xd, w1d, b1d, w2d, b2d = (_leaf(t) for t in (x, w1, b1, w2, b2))
    yd = F.linear(F.gelu(F.linear(xd, w1d, b1d)), w2d, b2d)
    yd.backward(gy)
    _close(y, yd, "mlp output")
    _close(xs.grad, xd.grad, "mlp input grad")
    _close(w1s.grad, w1d.grad.chunk(world_size, 0)[rank], "column weight grad")
    _close(b1s.grad, b1d.grad.chunk(world_size, 0)[rank], "column bias grad")
    _close(w2s.grad, w2d.grad.chunk(world_size, 1)[rank], "row weight grad")
    _close(b2s.grad, b2d.grad, "row bias grad")
    with torch.inference_mode():  # the plain CPU kernels
        _close(_mlp(x, w1s, b1s, w2s, b2s, group), yd, "mlp output under inference_mode")

    # Vocab-parallel embedding == F.embedding, with and without a padding row.
    vocab, v_local = 12, 12 // world_size
    table = torch.randn(vocab, 5)
    ids = torch.randint(0, vocab, (4, 7))
    ids[0, :3] = torch.tensor([0, 7, vocab - 1])
    gy = torch.randn(4, 7, 5)
    for padding_idx in (7, None):
        ws = _shard(table, 0, rank, world_size)
        out = ops.vocab_parallel_embedding(ids, ws, rank * v_local, padding_idx, group)
        out.backward(gy)
        wd = _leaf(table)
        ref = F.embedding(ids, wd, padding_idx=padding_idx)
        ref.backward(gy)
        _close(out, ref, f"embedding (padding_idx={padding_idx})")
        _close(ws.grad, wd.grad.chunk(world_size, 0)[rank], f"embedding grad (padding_idx={padding_idx})")

    # Vocab-parallel cross entropy == F.cross_entropy(reduction="none"), ignored rows included.
    logits = torch.randn(4, 6, vocab) * 3
    target = torch.randint(0, vocab, (4, 6))
    target[0, :2] = -100
    target[1, :3] = torch.tensor([0, vocab // 2, vocab - 1])
    gy = torch.randn(4, 6)
    ls = _shard(logits, -1, rank, world_size)
    loss = ops.vocab_parallel_cross_entropy(ls, target, rank * v_local, -100, group)
    loss.backward(gy)
    ld = _leaf(logits)
    ref = F.cross_entropy(ld.flatten(0, 1), target.flatten(), reduction="none").view(4, 6)
    ref.backward(gy)
    _close(loss, ref, "cross entropy")
    assert not loss[0, :2].any()
    _close(ls.grad, ld.grad.chunk(world_size, -1)[rank], "cross entropy grad")
    with torch.inference_mode():
        loss = ops.vocab_parallel_cross_entropy(ls, target, rank * v_local, -100, group)
        _close(loss, ref, "cross entropy under inference_mode")

    # tp_gather / tp_split / tp_reduce, forward and backward.
    full = torch.randn(4, 2 * world_size, 3 * world_size)
    gy = torch.randn_like(full)
    for dim in (1, -1):
        part = _shard(full, dim, rank, world_size)
        gathered = ops.tp_gather(part, dim, group)
        gathered.backward(gy)
        _close(gathered, full, f"tp_gather dim {dim}")
        _close(part.grad, gy.chunk(world_size, dim)[rank], f"tp_gather grad dim {dim}")

        whole = _leaf(full)
        piece = ops.tp_split(whole, dim, 0.5, group)
        piece.backward(gy.chunk(world_size, dim)[rank])
        _close(piece, full.chunk(world_size, dim)[rank], f"tp_split dim {dim}")
        _close(whole.grad, gy * 0.5, f"tp_split grad dim {dim}")

    parts, gy = torch.randn(world_size, 3, 4), torch.randn(3, 4)
    mine = _leaf(parts[rank])
    total = ops.tp_reduce(mine)  # group=None: the default group
    total.backward(gy)
    _close(total, parts.sum(0), "tp_reduce")
    _close(mine.grad, gy, "tp_reduce grad")

    # tp_copy: q/k/v-style column layers on one copy; the input gradient summed once over ranks.
    x, ws = torch.randn(3, 4), torch.randn(world_size, 2, 4)
    shared = _leaf(x)
    out = F.linear(ops.tp_copy(shared, group), ws[rank])
    out.backward(torch.ones_like(out))
    _close(out, F.linear(x, ws[rank]), "tp_copy")
    _close(shared.grad, torch.ones(3, 2) @ ws.sum(0), "tp_copy grad")

    size = 2 * world_size + 1
    with pytest.raises(
        RuntimeError, match=rf"size of dim -1 \({size}\) does not divide by the group size \({world_size}\)"
    ):
        ops.tp_split(torch.randn(3, size), -1, 1.0, group)

    if not with_compile:
        return True
    # The MLP compiled (aot_eager) over the real group matches eager, gradients included.
    (out, grads), (c_out, c_grads) = _eager_and_compiled(_mlp, (xs, w1s, b1s, w2s, b2s, group), "aot_eager")
    _close(c_out, out, "compiled mlp output")
    for c, e in zip(c_grads, grads, strict=True):
        _close(c, e, "compiled mlp grad")
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_with_dense(world_size):
    # Compiling costs each rank seconds of CPU: once is enough.
    assert run_ranks(check_parity, world_size, world_size == 2) == [True] * world_size


# --- outputs that later ops may change in place ------------------------------


def _outputs_change_in_place(group, device):
    """Every op's output is its own tensor to autograd, never a view: a captured graph's later ops
    change it in place (e.g. zero_bubble's weight tap marks it dirty, a model's `x += ...`), which
    autograd forbids on a view made inside a custom Function. Which outputs would be views depends
    on the device: at::linear returns one on CUDA (3-D input with a bias), not on the CPU."""
    for case in CASES:
        op, args = _args(case, group, device=device)
        out = op(*args)
        assert not out._is_view(), f"{case} on {device}: the output is a view"
        if out.requires_grad:
            out.mul_(2).sum().backward()  # raises for a view of a custom Function's


def test_outputs_change_in_place(group):
    _outputs_change_in_place(group, "cpu")


# --- CUDA ----------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_outputs_change_in_place(group):
    _outputs_change_in_place(group, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu(group):
    for case in CASES:
        op, args = _args(case, group)
        cuda_args = [
            (_leaf(a.cuda()) if a.requires_grad else a.cuda()) if isinstance(a, torch.Tensor) else a
            for a in args
        ]
        out, out_cuda = op(*args), op(*cuda_args)
        assert out_cuda.is_cuda
        torch.testing.assert_close(
            out_cuda.cpu(), out, atol=1e-4, rtol=1e-4, msg=lambda m, c=case: f"{c}: {m}"
        )
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out_cuda, _float_inputs(cuda_args), grad.cuda())
        want = torch.autograd.grad(out, _float_inputs(args), grad)
        for g, w in zip(got, want, strict=True):
            assert g.is_cuda
            torch.testing.assert_close(
                g.cpu(), w, atol=1e-4, rtol=1e-4, msg=lambda m, c=case: f"{c} grad: {m}"
            )
    with torch.inference_mode():
        op, args = _args("row_bias", group, dtype=torch.bfloat16, device="cuda")
        assert op(*args).dtype == torch.bfloat16


# --- the tensor-parallel pass's value inference on fake tensors (issue 31) -----
# The pass (passes/tensor_parallel/driver.py `_infer_val`) computes each emitted node's fake value by
# calling its op on the fake values torch.export recorded, in which parameters require grad. Called
# outside the fakes' mode, an smp op goes first to its C++ Autograd kernel, which builds an autograd
# node over the fake parameters and runs the C++ forward on them; for the pass's whole-parameter
# values next to local activations that forward throws from inside the kernel. That is the call that
# killed every rank on a GPU. Inferred under the fakes' mode below autograd, the ops reach only their
# fake kernels (python/smp/ops.py), and no C++ of smp's nor any autograd state touches a fake.


def _recording_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Recording(FakeTensorMode):
        """A fake mode that lists the ops it is asked to run."""

        def __init__(self):
            super().__init__()
            self.seen = []

        def dispatch(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return super().dispatch(func, types, args, kwargs or {})

    return Recording()


def _inferred(op, values, group):
    """_infer_val of one call_function node on these fake values (what the pass emits)."""
    from smp.passes.tensor_parallel.driver import _infer_val
    from torch import fx

    graph = fx.Graph()
    inputs = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            p = graph.placeholder(f"a{i}")
            p.meta["val"] = v
            inputs.append(p)
        else:
            inputs.append(v)
    return _infer_val(graph.call_function(op, (*inputs, group.group_name)))


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # fake CUDA tensors need no GPU
def test_pass_value_inference_reaches_only_the_fake_kernels(group, device):
    mode = _recording_fake_mode()
    with mode:
        x = torch.empty(2, 3, 8, device=device)  # an activation: no grad, as export records it
        w = torch.empty(4, 8, device=device).requires_grad_()  # parameters require grad
        b = torch.empty(4, device=device).requires_grad_()
        w_row = torch.empty(6, 8, device=device).requires_grad_()
    cases = {
        "smp.column_parallel_linear.default": (torch.ops.smp.column_parallel_linear.default, (x, w, b), 4),
        "smp.row_parallel_linear.default": (torch.ops.smp.row_parallel_linear.default, (x, w_row, None), 6),
    }
    for name, (op, values, out_features) in cases.items():
        mode.seen.clear()
        out = _inferred(op, values, group)
        # The mode ran the op itself (its fake kernel makes the output with new_empty), not the
        # ATen ops of its C++ body (view, t, addmm, ...), as it did when the C++ kernel ran first.
        assert mode.seen[:1] == [name] and set(mode.seen[1:]) <= {"aten.new_empty.default"}, mode.seen
        assert out.fake_mode is mode and out.shape == (2, 3, out_features) and out.device.type == device
        assert out.grad_fn is None and not out.requires_grad, name  # no autograd node over the fakes


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_pass_value_inference_of_mismatched_values_fails_in_the_fake_kernel(group, device):
    """What the pass asked when the GPU runs crashed: a whole bias next to the local weight (GPT-2's
    fused qkv, column parallel) and a whole weight next to the local input (row parallel). The
    C++ Autograd kernel threw from inside on these; now only the fake kernel sees them."""
    mode = _recording_fake_mode()
    with mode:
        x = torch.empty(128, 32, device=device)
        w_local = torch.empty(48, 32, device=device)  # aten.t of the local shard: no grad
        b_whole = torch.empty(96, device=device).requires_grad_()
        x_local = torch.empty(8, 16, 16, device=device)
        w_whole = torch.empty(32, 32, device=device).requires_grad_()
        b_row = torch.empty(32, device=device).requires_grad_()
    for op, values in [
        (torch.ops.smp.column_parallel_linear.default, (x, w_local, b_whole)),
        (torch.ops.smp.row_parallel_linear.default, (x_local, w_whole, b_row)),
    ]:
        mode.seen.clear()
        assert _inferred(op, values, group) is None  # unknown, as before: the pass sets the value
        assert mode.seen == [str(op)], mode.seen  # the C++ kernel threw before any op reached the mode


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_pass_value_inference_on_a_worker_thread_with_cuda_fakes(group):
    """The GPU runs' conditions: values torch.export recorded from a CUDA module, mismatched as the
    pass asks, inferred on a thread other than the main one (the microbatch thread)."""
    import threading

    from smp import passes

    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Linear(96, 32)).cuda()
    captured = passes.capture(model, (torch.randn(4, 32, device="cuda"),))
    vals = {n.target: n.meta["val"] for n in captured.graph_module.graph.nodes if n.op == "get_attr"}
    x = next(n.meta["val"] for n in captured.graph_module.graph.nodes if n.op == "placeholder")
    local_w = vals["0.weight"].new_empty(48, 32)
    results = []

    def infer():
        results.append(
            _inferred(torch.ops.smp.column_parallel_linear.default, (x, local_w, vals["0.bias"]), group)
        )
        results.append(
            _inferred(torch.ops.smp.row_parallel_linear.default, (x, vals["1.weight"], vals["1.bias"]), group)
        )

    thread = threading.Thread(target=infer)
    thread.start()
    thread.join()
    assert results == [None, None]
