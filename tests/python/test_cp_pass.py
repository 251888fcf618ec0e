"""The context-parallel graph pass (smp.passes.context_parallel) on unmodified Hugging Face
models, on real processes: each rank's rewritten graph runs its part of the sequence (its
attentions become smp's cross-rank attention on S/C query rows) and returns the loss and logits
one process computes on the whole sequence."""

from __future__ import annotations

import hf_cases
import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

TOL = 1e-5


def gpt2_eager():
    """GPT-2 with HF's eager attention: softmax(QK^T)V written out, read as the attention it is."""
    model = hf_cases.gpt2(2)
    model.config._attn_implementation = "eager"
    return model


def gpt2_eager_weights():
    """The same, returning the attention weights (output_attentions): the scores stay written out
    and the keys and values are gathered."""
    model = gpt2_eager()
    model.config.output_attentions = True
    return model


BUILD = {
    "gpt2": lambda: hf_cases.gpt2(2),
    "llama": lambda: hf_cases.llama(2),
    "mistral": hf_cases.mistral,  # sliding window 4 of the 16 positions
    "gpt2_eager": gpt2_eager,
    "gpt2_eager_weights": gpt2_eager_weights,
}


def check_pass(rank, world, case, comm):
    import smp.passes as passes

    torch.manual_seed(0)
    if case == "bert":  # no causal mask; -100 everywhere but the masked tokens
        model, batch = hf_cases.bert(), hf_cases.masked_batch(0, 2)
    else:
        model, batch = BUILD[case](), hf_cases.causal_batch(0, 2)
        batch["labels"] = batch["labels"].clone()
        batch["labels"][0, 3:6] = -100  # ignored tokens: the mean is over the whole sequence's count
    model.config.use_cache = False
    kwargs = {"input_ids": batch["ids"], "labels": batch["labels"]}
    if case == "bert":  # padding: the second row's last 3 tokens
        kwargs["attention_mask"] = torch.ones_like(batch["ids"])
        kwargs["attention_mask"][1, -3:] = 0
    expected = model(**kwargs)
    captured = passes.capture(model, (), kwargs)
    result = passes.context_parallel(captured.graph_module, dist.group.WORLD, comm)
    cut = {"input_ids": 1, "labels": 1} | ({"attention_mask": 1} if case == "bert" else {})
    assert result.seq_len == hf_cases.SEQ and result.inputs == cut, result
    layers = model.config.num_hidden_layers
    # written out: QK^T and PV each read one gathered operand (K, V), so two lines per layer
    written = case == "gpt2_eager_weights"
    form, per_layer = ("an eager attention", 2) if written else (comm, 1)
    assert len(result.attention) == per_layer * layers, result.attention
    assert all(form in a for a in result.attention), result.attention
    # Only the logits the model returns are gathered whole; every activation before them stays cut.
    # (and, for attention written out, each layer's K and V, the columns of the scores, and the
    # weights it returns)
    gathered = 1 + (3 * layers if written else 0)
    assert len(result.gathered) == gathered and all("gathered whole" in g for g in result.gathered), result
    attention = [
        n
        for n in captured.graph_module.graph.nodes
        if n.target in (torch.ops.smp.cp_attention.default, torch.ops.smp.cp_to_heads.default)
        and "local" not in n.args  # (a2a's attention after the all-to-all: whole sequence, 1/C heads)
    ]
    local = [n for n in captured.graph_module.graph.nodes if "local" in n.args]
    assert len(local) == (layers if comm == "a2a" else 0), local
    assert all(n.args[0].meta["val"].shape[2] == hf_cases.SEQ for n in local)
    if written:  # the scores: this rank's rows against every column
        attention = [
            n
            for n in captured.graph_module.graph.nodes
            if n.target in (torch.ops.aten._softmax.default, torch.ops.aten.softmax.int)
        ]
        assert attention and all(
            n.meta["val"].shape[-2:] == (hf_cases.SEQ // world, hf_cases.SEQ) for n in attention
        )
    else:
        assert attention and all(n.args[0].meta["val"].shape[2] == hf_cases.SEQ // world for n in attention)
    out = captured.graph_module.forward(*captured.flatten_inputs((), kwargs))  # flat, as the engine calls it
    loss, logits = out[0], out[1]
    errors = [(loss - expected.loss).abs().item(), (logits - expected.logits).abs().max().item()]
    torch.testing.assert_close(loss, expected.loss, atol=TOL, rtol=TOL)
    torch.testing.assert_close(logits, expected.logits, atol=TOL, rtol=TOL)
    if written:
        weights = out[2 : 2 + layers]
        torch.testing.assert_close(list(weights), list(expected.attentions), atol=TOL, rtol=TOL)
    return errors, result.gathered


@pytest.mark.parametrize("case", ["gpt2", "llama", "mistral", "bert"])
@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_cp_pass_matches_one_process(case, comm):
    _parity(2, case, comm)


@pytest.mark.parametrize(
    "case, comm", [("llama", "p2p"), ("gpt2", "all_gather"), ("bert", "a2a"), ("gpt2_eager", "p2p")]
)
def test_cp4_pass_matches_one_process(case, comm):
    _parity(4, case, comm)


EAGER = [("gpt2_eager", c) for c in ("p2p", "all_gather", "a2a")] + [("gpt2_eager_weights", "p2p")]


def check_eager(rank, world):
    return [check_pass(rank, world, case, comm) for case, comm in EAGER]


def test_cp2_pass_on_eager_attention():
    """Eager attention by each comm type, and written out where its weights are returned: one launch."""
    per_rank = run_ranks(check_eager, 2, timeout=300)
    for (case, comm), results in zip(EAGER, zip(*per_rank, strict=True), strict=True):
        _report(2, case, comm, results)


def _parity(world, case, comm):
    _report(world, case, comm, run_ranks(check_pass, world, case, comm, timeout=300))


def _report(world, case, comm, results):
    for errors, gathered in results:
        print(
            f"cp={world} pass {case} {comm}: loss error {errors[0]:.2e}, logits {errors[1]:.2e}; {gathered}"
        )


class _Heads(torch.nn.Module):
    """Self-attention with `heads` heads over [B, S, 8 * heads] inputs."""

    def __init__(self, heads, sort=False):
        super().__init__()
        self.heads, self.sort = heads, sort
        self.qkv = torch.nn.Linear(8 * heads, 24 * heads)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, 8).permute(2, 0, 3, 1, 4)
        if self.sort:  # an op the pass has no rule for, on the queries
            q = q.sort(dim=-1).values
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, -1).sum()


def check_errors(rank, world):
    import smp.passes as passes

    group = dist.group.WORLD

    def cut(model, x, comm="p2p"):
        captured = passes.capture(model, (x,))
        return passes.context_parallel(captured.graph_module, group, comm)

    with pytest.raises(
        passes.ContextParallelError,
        match=r"length 14 does not divide into 2 x .* = 4 .*multiple of 4 \(e.g. 16\)",
    ):
        cut(_Heads(2), torch.randn(2, 14, 16))
    with pytest.raises(
        passes.ContextParallelError, match=r"3 query heads .* do not divide by 2; use cp_comm_type 'p2p'"
    ):
        cut(_Heads(3), torch.randn(2, 16, 24), "a2a")
    with pytest.raises(passes.ContextParallelError, match="found no attention"):
        cut(torch.nn.Linear(4, 4), torch.randn(2, 16, 4))
    with pytest.raises(passes.ContextParallelError, match=r"cannot cut the attention .*gathered \(sort"):
        cut(_Heads(2, sort=True), torch.randn(2, 16, 16))
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        cut(_Heads(2), torch.randn(2, 16, 16), "ring")
    # 3 heads cut on the sequence (p2p: any head count) give one process's result.
    torch.manual_seed(0)
    model, x = _Heads(3), torch.randn(2, 16, 24)
    captured = passes.capture(model, (x,))
    passes.context_parallel(captured.graph_module, group, "p2p")
    (got,) = captured.graph_module.forward(x)
    torch.testing.assert_close(got, model(x), atol=TOL, rtol=TOL)
    return True


def test_cp_pass_errors_name_the_fix():
    assert run_ranks(check_errors, 2, timeout=300) == [True, True]


class _Written(torch.nn.Module):
    """softmax(Q K^T * scale + mask) V written out in a few ways; only the exact forms (`plain`,
    `divided`, `masked_fill`) are the attention scaled_dot_product_attention computes."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2)
        if self.form == "divided":
            scores = scores / 2.0 / 1.5 + mask
        elif self.form == "mask_scaled":  # the mask multiplied by the scale too
            scores = (scores + mask) * 0.3
        elif self.form.startswith("masked_fill"):  # nanoGPT's: a bool mask, -inf where it is off
            fill = float("-inf") if self.form == "masked_fill" else -1e4
            scores = (scores * 0.3).masked_fill(mask < 0, fill)
        else:
            scores = scores * 0.3 + mask
        weights = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        out = weights @ v
        return (out, weights) if self.form == "weights" else out


@pytest.mark.parametrize(
    "form, replaced",
    [
        ("plain", True),
        ("divided", True),
        ("masked_fill", True),
        ("mask_scaled", False),
        ("masked_fill_finite", False),  # (a row with nothing left would attend uniformly)
        ("weights", False),
    ],
)
def test_eager_attention_read_as_sdpa_only_in_its_exact_form(form, replaced):
    import smp.passes as passes
    from smp.passes.context_parallel.eager import eager_to_sdpa

    torch.manual_seed(0)
    model, x = _Written(form), torch.randn(2, 6, 16)
    mask = torch.zeros(2, 1, 6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -1e9)
    expected = model(x, mask)
    captured = passes.capture(model, (x, mask))
    gm = captured.graph_module
    assert bool(eager_to_sdpa(gm)) == replaced
    targets = [n.target for n in gm.graph.nodes]
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    assert (sdpa in targets) == replaced and (torch.ops.aten.softmax.int in targets) != replaced
    out = gm.forward(*captured.flatten_inputs((x, mask), {}))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
