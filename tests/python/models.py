"""Small models for pipeline tests: a GPT-style LM and shapes that stress the partitioner."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        # No qkv bias (as in most current LMs): the key bias has an exactly zero true gradient,
        # and Adam turns the rounding noise of any summation order into lr-sized updates there.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class QKNormAttention(Attention):
    """Attention with a learned RMSNorm over each head's queries and keys (QK-norm: Qwen3, OLMo2,
    Gemma3): replicated [head_dim] weights applied to every head, so with heads sharded each
    rank computes only its heads' share of their gradients."""

    def __init__(self, dim: int, heads: int):
        super().__init__(dim, heads)
        self.q_norm = nn.Parameter(1.0 + 0.1 * torch.randn(dim // heads))
        self.k_norm = nn.Parameter(1.0 + 0.1 * torch.randn(dim // heads))

    @staticmethod
    def _rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        q, k = self._rms(q, self.q_norm), self._rms(k, self.k_norm)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class RawLinear(nn.Linear):
    """Falcon's FalconLinear: `x @ W.T + b` spelled out, no aten.linear in the graph."""

    def forward(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class RawLinearAttention(Attention):
    """Attention whose projections are RawLinear (fused q/k/v among them)."""

    def __init__(self, dim: int, heads: int):
        super().__init__(dim, heads)
        self.qkv = RawLinear(dim, 3 * dim, bias=False)
        self.proj = RawLinear(dim, dim)


class EinsumMLP(nn.Module):
    """An MLP on raw parameters: the up projection an einsum plus a bias, the down projection a
    matmul on a weight stored [in, out] (as Conv1D stores it)."""

    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Parameter(torch.randn(4 * dim, dim) / math.sqrt(dim))
        self.up_bias = nn.Parameter(torch.zeros(4 * dim))
        self.down = nn.Parameter(torch.randn(4 * dim, dim) / math.sqrt(4 * dim))

    def forward(self, x):
        h = F.gelu(torch.einsum("bti,oi->bto", x, self.up) + self.up_bias)
        return torch.matmul(h, self.down)


def _mlp(dim: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attention: type[nn.Module] = Attention, mlp=_mlp):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = mlp(dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token embedding tied to the output head, learned positions, pre-LN blocks, no dropout."""

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        heads: int = 4,
        layers: int = 4,
        seq: int = 16,
        attention: type[nn.Module] = Attention,
        mlp=_mlp,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attention, mlp) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)  # GPT-2's init: logits start near uniform

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TwiceCalled(nn.Module):
    """Calls one submodule twice: its parameters are used at both ends of the model."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.shared = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        x = torch.tanh(self.shared(x))
        for layer in self.layers:
            x = layer(x)
        return self.out(torch.tanh(self.shared(x)))


class LongSkip(nn.Module):
    """A skip connection from the first layer to the last crosses every stage boundary."""

    def __init__(self, dim: int = 16, layers: int = 4, middle_outputs: bool = False):
        super().__init__()
        self.middle_outputs = middle_outputs  # also return a middle layer's output and the first's
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        first = torch.tanh(self.inp(x))
        y, middles = first, []
        for layer in self.layers:
            y = layer(y)
            middles.append(y)
        out = self.out(y + first)
        return (out, middles[len(middles) // 2], first) if self.middle_outputs else out


class DictInTupleOut(nn.Module):
    """forward(batch: dict) -> (prediction, auxiliary)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.out = nn.Linear(dim, 1)

    def forward(self, batch):
        x = torch.tanh(self.a(batch["x"])) * torch.sigmoid(self.b(batch["gate"]))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x), x.pow(2).mean(dim=-1)


def lm_loss(logits, ids):
    """Next-token cross entropy."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class Normed(nn.Module):
    """BatchNorm: train mode normalizes by batch statistics and updates running buffers, eval mode
    uses the buffers, so the two modes capture different graphs."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        x = self.norm(self.inp(x))
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class ReturnsTwice(LongSkip):
    """Returns one tensor at two places of its output: every other stage receives it once."""

    def forward(self, x):
        y = super().forward(x)
        return y, {"again": y}


class GQABlock(nn.Module):
    """Llama-style block: grouped-query attention (fewer k/v heads, repeated as HF's repeat_kv
    does), fused-free q/k/v, gated MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def _repeat_kv(self, x):
        b, _, t, d = x.shape
        rep = self.heads // self.kv_heads
        return x[:, :, None, :, :].expand(b, self.kv_heads, rep, t, d).reshape(b, self.heads, t, d)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class GQALM(nn.Module):
    """A language model of GQA blocks that computes its own loss from labels (as HF models do)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 8, kv_heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(GQABlock(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, ids, labels):
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
