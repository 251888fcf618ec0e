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


def check_pass(rank, world, case, comm):
    import smp.passes as passes

    torch.manual_seed(0)
    model = getattr(hf_cases, case)(2)
    model.config.use_cache = False
    batch = hf_cases.causal_batch(0, 2)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, 3:6] = -100  # ignored tokens: the mean is over the whole sequence's count
    kwargs = {"input_ids": batch["ids"], "labels": batch["labels"]}
    expected = model(**kwargs)
    captured = passes.capture(model, (), kwargs)
    result = passes.context_parallel(captured.graph_module, dist.group.WORLD, comm)
    assert result.seq_len == hf_cases.SEQ and result.inputs == {"input_ids": 1, "labels": 1}, result
    assert len(result.attention) == 2 and all(comm in a for a in result.attention), result.attention
    # Only the logits the model returns are gathered whole; every activation before them stays cut.
    assert len(result.gathered) == 1 and "gathered whole" in result.gathered[0], result.gathered
    attention = [
        n
        for n in captured.graph_module.graph.nodes
        if n.target in (torch.ops.smp.cp_attention.default, torch.ops.smp.cp_to_heads.default)
    ]
    assert attention and all(n.args[0].meta["val"].shape[2] == hf_cases.SEQ // world for n in attention)
    out = captured.graph_module.forward(*captured.flatten_inputs((), kwargs))  # flat, as the engine calls it
    loss, logits = out[0], out[1]
    errors = [(loss - expected.loss).abs().item(), (logits - expected.logits).abs().max().item()]
    torch.testing.assert_close(loss, expected.loss, atol=TOL, rtol=TOL)
    torch.testing.assert_close(logits, expected.logits, atol=TOL, rtol=TOL)
    return errors, result.gathered


@pytest.mark.parametrize("case", ["gpt2", "llama"])
@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_cp_pass_matches_one_process(case, comm):
    results = run_ranks(check_pass, 2, case, comm, timeout=300)
    for errors, gathered in results:
        print(
            f"cp pass {case} {comm}: loss error {errors[0]:.2e}, logits max error {errors[1]:.2e}; {gathered}"
        )
