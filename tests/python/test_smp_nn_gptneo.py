"""GPT-Neo through smp.nn (local attention layers, unscaled float32 scores, bias-free q/k/v, learned
positions, a tied head): replaced by one DistributedTransformerLMHead, as SMP v1 did out of the
box, against Hugging Face's own model with the same weights: logits and loss at tp=1, training
at tp=2, and the translate functions both ways."""

from __future__ import annotations

import torch
from harness import run_ranks

SEQ, VOCAB, WINDOW = 8, 64, 3  # a window shorter than the sequence: the local layers differ
TIGHT = 1e-8  # float64, except that HF's GPT-Neo computes q·kᵀ in float32 whatever the model's dtype
CLOSE = 1e-5  # float32 training


def _config(**kw):
    from transformers import GPTNeoConfig

    return GPTNeoConfig(
        vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=WINDOW, resid_dropout=0.0,
        embed_dropout=0.0, attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, **kw,
    )  # fmt: skip


def _batch(seed, rows=2):
    """Token ids and a mask of ones, some rows right-padded (no query loses every key)."""
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _max_err(a, b):
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _tp1(rank, world_size):
    import smp
    from smp.nn.huggingface import gptneo
    from transformers import GPTNeoForCausalLM

    smp.init({})
    torch.manual_seed(0)
    dense = GPTNeoForCausalLM(_config()).double().eval()
    with smp.model_creation(tensor_parallelism=True):
        model = GPTNeoForCausalLM(_config())
    model.double().eval()
    model.load_state_dict(gptneo.translate_hf_state_dict_to_smdistributed_gptneo(dense.state_dict()))
    back = gptneo.translate_state_dict_to_hf_gptneo(model.state_dict())
    ids, mask, labels = _batch(1)
    with torch.no_grad():
        want = dense(input_ids=ids, attention_mask=mask)
        got = model(input_ids=ids, attention_mask=mask)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        want_loss = dense(input_ids=ids, attention_mask=mask, labels=labels).loss
    rows = mask.bool()  # (positions with a key each; HF leaves masked rows to its own conventions)
    windows = [layer.attention.causal_mask[5].tolist() for layer in model.transformer.seq_layers]
    return {
        "type": type(model).__name__,
        "logits": _max_err(got.logits[rows], want.logits[rows]),
        "loss": abs(loss.item() - want_loss.item()),
        "roundtrip": set(back) == set(dense.state_dict())
        and all(torch.equal(back[k], v) for k, v in dense.state_dict().items()),
        "windows": windows,
    }


def test_gptneo_is_replaced_and_matches_hf_at_tp1():
    r = run_ranks(_tp1, 1, timeout=120)[0]
    assert r["type"] == "DistributedTransformerLMHead"
    assert r["logits"] < TIGHT and r["loss"] < 1e-6, r  # (HF computes the loss in float32)
    assert r["roundtrip"]
    # Query 5 sees every earlier key in the global layer, the WINDOW up to itself in the local one.
    assert r["windows"][0] == [True] * 6 + [False] * 2
    assert r["windows"][1] == [False] * 3 + [True] * 3 + [False] * 2


def _tp2(rank, world_size):
    import smp
    from smp.nn.huggingface import gptneo
    from transformers import GPTNeoForCausalLM

    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    dense = GPTNeoForCausalLM(_config())
    start = {k: v.clone() for k, v in dense.state_dict().items()}
    with smp.model_creation(tensor_parallelism=True):
        model = smp.DistributedModel(GPTNeoForCausalLM(_config()))
    model.load_state_dict(gptneo.translate_hf_state_dict_to_smdistributed_gptneo(start))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    reference = torch.optim.SGD(dense.parameters(), lr=0.5)

    @smp.step
    def train(model, ids, mask, labels):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels)["loss"]
        model.backward(loss)
        return loss

    errors = []
    for step in range(3):
        ids, mask, labels = _batch(10 + step, rows=4)
        got = train(model, ids, mask, labels).reduce_mean()
        optimizer.step()
        optimizer.zero_grad()
        want = dense(input_ids=ids, attention_mask=mask, labels=labels).loss
        want.backward()
        reference.step()
        reference.zero_grad()
        errors.append(abs(got.item() - want.item()))
    trained = gptneo.translate_state_dict_to_hf_gptneo(model.state_dict())
    final = dense.state_dict()
    return {
        "type": type(model.get_module()).__name__,
        "loss_errors": errors,
        "param_error": max(_max_err(trained[k], v) for k, v in final.items()),
        "moved": max(_max_err(start[k], v) for k, v in final.items()),
    }


def test_gptneo_trains_at_tp2_as_hf():
    for r in run_ranks(_tp2, 2, timeout=240):
        assert r["type"] == "DistributedTransformerLMHead"
        assert max(r["loss_errors"]) < CLOSE and r["param_error"] < CLOSE, r
        assert r["moved"] > 100 * CLOSE
