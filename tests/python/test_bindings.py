"""smp.passes.bindings: a captured graph run through its ops' Python bindings computes exactly
what it computes through the OpOverloads: outputs and gradients, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from smp import passes
from smp.passes import bindings
from torch import fx, nn


class _ManyOps(nn.Module):
    """A transformer-like block that uses (nearly) every op in bindings.BOUND_OPS, with their
    defaults left out where a graph leaves them out."""

    def __init__(self, d: int = 16, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Parameter(torch.randn(d, 2 * d) / d)
        self.bias = nn.Parameter(torch.zeros(2 * d))

    def forward(self, ids, target):
        b, s = ids.shape
        x = self.emb(ids) + torch.arange(s).unsqueeze(-1).float() / s
        h = self.ln(x)
        q, k, v = self.qkv(h).split(h.shape[-1], dim=-1)
        q, k, v = (t.view(b, s, 2, -1).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) / 4.0
        mask = torch.ones(s, s, dtype=torch.bool).tril().bitwise_not()
        att = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) + torch.matmul(att, v)
        y = torch.ops.aten.contiguous.default(y.permute(0, 2, 1, 3)).view(b, s, -1)  # (kept by export)
        x = x + self.proj(y)
        u = torch.addmm(self.bias, x.reshape(b * s, -1), self.up).view(b, s, -1)
        a, c = u.chunk(2, dim=-1)
        x = x + F.gelu(a) * torch.sigmoid(c) + F.silu(c) * torch.tanh(a) - torch.relu(a).pow(2).mean()
        x = torch.where(x > 0, x, x * 0.5) + torch.cat([x[..., :1], x[..., 1:]], dim=-1).clamp(-3, 3)
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        logits = F.linear(x, self.emb.weight)
        loss = F.cross_entropy(logits.reshape(b * s, -1), target.reshape(-1))  # (its default: mean)
        return loss, logits.log_softmax(-1).sum(dim=(0, 1)), torch.zeros_like(loss).exp()


def _run(gm: nn.Module, ids, target):
    for p in gm.parameters():
        p.grad = None
    outputs = gm(ids, target)
    torch.autograd.backward(outputs[0])
    return [o.detach() for o in outputs], [p.grad.clone() for p in gm.parameters()]


def test_graph_through_bindings_computes_what_the_ops_do():
    torch.manual_seed(0)
    model = _ManyOps()
    ids, target = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    gm = passes.capture(model, (ids, target)).graph_module
    used = {n.target.overloadpacket.__name__ for n in gm.graph.nodes if bindings.binding_of(n.target)}
    assert {
        "cross_entropy_loss",
        "linear",
        "layer_norm",
        "scaled_dot_product_attention",
        "contiguous",
    } <= used
    assert len(used) >= 35, sorted(bindings.BOUND_OPS - used)
    plain = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    plain.graph.set_codegen(fx.graph.CodeGen())  # a stage graph's codegen (capture's is pytree's)
    plain.recompile()
    fast = fx.GraphModule(gm, copy.deepcopy(plain.graph))
    bindings.use_python_bindings(fast)
    assert "torch.ops.aten" in plain.code and "forward" in fast.__dict__
    expected, fast_out = _run(plain, ids, target), _run(fast, ids, target)
    for a, b in zip(expected[0] + expected[1], fast_out[0] + fast_out[1], strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    assert expected[0][0].dim() == 0  # the mean, not the binding's default (no reduction)
    copied = copy.deepcopy(fast)  # a copy is a plain GraphModule of its own again
    assert "forward" not in copied.__dict__ and torch.equal(copied(ids, target)[0], fast(ids, target)[0])


def test_a_binding_default_that_differs_from_the_schema_is_given_explicitly():
    op = torch.ops.aten.cross_entropy_loss.default
    x, t = torch.randn(6, 5), torch.randint(0, 5, (6,))
    assert bindings.binding_of(op)(x, t).shape == (6,)  # the trap: torch._C._nn's default
    kwargs = bindings.explicit_arguments(op, (x, t), {})
    assert kwargs["reduction"] == 1 and torch.equal(bindings.binding_of(op)(x, t, **kwargs), op(x, t))
    # An enum's default comes as its number, which the binding refuses: left to the binding's own.
    op, y = torch.ops.aten.contiguous.default, torch.randn(3, 4).t()
    assert bindings.explicit_arguments(op, (y,), {}) == {}
    assert bindings.binding_of(op)(y).is_contiguous()


@pytest.mark.parametrize("op", [torch.ops.aten.add_.Tensor, torch.ops.aten.slice.Tensor, torch.ops.smp])
def test_ops_outside_the_list_keep_their_op(op):
    assert bindings.binding_of(op) is None


def test_a_parameter_replaced_on_its_module_is_read_at_the_next_call():
    """The forward reads each tensor from its module at every call (what tensor-parallel sharding,
    delayed initialization and FSDP2's gathers rely on), not a copy taken when it was made."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2)))
    x = torch.randn(3, 4)
    gm = passes.capture(model, (x,)).graph_module
    gm.graph.set_codegen(fx.graph.CodeGen())
    gm.recompile()
    bindings.use_python_bindings(gm)
    before = gm(x)[0]
    new = nn.Parameter(torch.randn(2, 4))
    gm.get_submodule("1.1").weight = new
    assert torch.equal(gm(x)[0], F.linear(model[1][0](model[0](x)), new, model[1][1].bias))
    assert not torch.equal(before, gm(x)[0])
