"""GPT-J and GPT-NeoX through smp.nn (rotary embeddings, parallel residuals, bias-free projections,
fused q/k/v, untied heads): built with SMP's hooks under smp.tensor_parallelism() and checked
against Hugging Face's own models with the same weights, at tp=1 and tp=2, in training, in a
pipeline, and through the translate functions and save_pretrained / from_pretrained."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks

SEQ, VOCAB, LR = 8, 64, 0.1
TIGHT = 1e-12  # float64, same formulas: summation order apart
CLOSE = 1e-5  # float32 training, as test_smp_nn.py's GPT-2 cases


def _config(case: str):
    """Tiny configs, dropout off. Head size 8: GPT-J rotates 4 of its features (interleaved),
    NeoX-parallel half (untied head, biases), NeoX-sequential all of them with another base
    (tied head, bias-free attention)."""
    import transformers

    if case == "gptj":
        return transformers.GPTJConfig(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    parallel = case == "neox_parallel"
    return transformers.GPTNeoXConfig(
        vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, rotary_pct=0.5 if parallel else 1.0,
        rotary_emb_base=10000 if parallel else 500, use_parallel_residual=parallel,
        tie_word_embeddings=not parallel, attention_bias=parallel, use_cache=False, eos_token_id=0,
    )  # fmt: skip


CASES = ("gptj", "neox_parallel", "neox_sequential")


def _model_class(case: str):
    import transformers

    return transformers.GPTJForCausalLM if case == "gptj" else transformers.GPTNeoXForCausalLM


def _ours(case: str):
    from smp.nn.huggingface import gptj, gptneox

    return (gptj, "gptj") if case == "gptj" else (gptneox, "gptneox")


def _to_smp(case, state):
    module, name = _ours(case)
    return getattr(module, f"translate_hf_state_dict_to_smdistributed_{name}")(state)


def _to_hf(case, state):
    module, name = _ours(case)
    return getattr(module, f"translate_state_dict_to_hf_{name}")(state)


def _register_lm_heads():
    import smp
    import transformers
    from smp.nn.huggingface import gptj, gptneox

    head = smp.nn.DistributedTransformerLMHead
    smp.tp_register_with_module(transformers.GPTJForCausalLM, head, *gptj.get_hf_gptj_transformer_hooks())
    hooks = gptneox.get_hf_gptneox_transformer_lm_head_hooks()
    smp.tp_register_with_module(transformers.GPTNeoXForCausalLM, head, *hooks)


def _register_layers():
    import smp
    from smp.nn.huggingface import gptj, gptneox
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer
    from transformers.models.gptj.modeling_gptj import GPTJBlock

    layer = smp.nn.DistributedTransformerLayer
    smp.tp_register_with_module(GPTJBlock, layer, *gptj.get_hf_gptj_transformer_layer_hooks())
    smp.tp_register_with_module(GPTNeoXLayer, layer, *gptneox.get_hf_gptneox_transformer_layer_hooks())


def _batch(seed, rows=2):
    """Token ids and HF's mask (1 = attend): rows alternate right padding (2 positions) and left
    padding (2 positions, so the first queries see no key at all); labels -100 at the padding."""
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0::2, -2:] = 0
    mask[1::2, :2] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _causal_lm_loss(logits, labels):
    """HF's causal-LM loss in the logits' own dtype (HF's upcasts float64 logits to float32)."""
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten())


def _max_err(a, b):
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)


def _forward_errors(model, dense, seed):
    """Logits (every position, padded ones included) and loss of `model` against HF's `dense`."""
    ids, mask, labels = _batch(seed)
    with torch.no_grad():
        want = dense(input_ids=ids, attention_mask=mask)
        got_logits = model(input_ids=ids, attention_mask=mask).logits
        got_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        hf_loss = dense(input_ids=ids, attention_mask=mask, labels=labels).loss
        plain = _max_err(model(input_ids=ids).logits, dense(input_ids=ids).logits)
    return {
        "logits": _max_err(got_logits, want.logits),
        "logits_without_mask": plain,
        "loss": abs(got_loss.item() - _causal_lm_loss(want.logits, labels).item()),
        "loss_vs_hf_float32": abs(got_loss.item() - hf_loss.item()),
        "replaced": type(model).__name__,
    }


# --- tp=1: one process, every case ---------------------------------------------------------------


def _tp1(rank, world_size, folder):
    import smp

    _register_lm_heads()
    results = {}
    for case in CASES:
        config, cls = _config(case), _model_class(case)
        torch.manual_seed(0)
        dense = cls(config).double().eval()
        with smp.tensor_parallelism():
            model = cls(config)
        model.double().eval()
        model.load_state_dict(_to_smp(case, dense.state_dict()))
        back = _to_hf(case, model.state_dict())
        r = _forward_errors(model, dense, seed=1)
        r["roundtrip"] = _same(back, dense.state_dict())
        # save_pretrained of the translated state, loaded by Hugging Face's class: the same logits.
        cls(config).save_pretrained(f"{folder}/{case}", state_dict=back)
        loaded = cls.from_pretrained(f"{folder}/{case}", dtype=torch.float64).eval()
        ids, mask, _ = _batch(2)
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask).logits
            r["loaded_type"] = type(loaded).__name__
            r["loaded_logits"] = _max_err(loaded(input_ids=ids, attention_mask=mask).logits, want)
        results[case] = r
    try:
        model(inputs_embeds=torch.zeros(1, SEQ, 32, dtype=torch.float64))
        results["inputs_embeds_error"] = None
    except ValueError as e:
        results["inputs_embeds_error"] = str(e)
    return results


def test_rotary_models_match_hf_at_tp1(tmp_path):
    """Replaced by one DistributedTransformerLMHead, GPT-J and GPT-NeoX (parallel and sequential
    residual, tied and untied head) compute HF's logits at every position of a padded batch (left
    padding included) and HF's loss; their state translates back key for key, and HF's class loads
    it from save_pretrained with the same logits."""
    results = run_ranks(_tp1, 1, str(tmp_path), timeout=120)[0]
    for case in CASES:
        r = results[case]
        assert r["replaced"] == "DistributedTransformerLMHead" and r["roundtrip"], (case, r)
        assert r["logits"] < TIGHT and r["logits_without_mask"] < TIGHT and r["loss"] < TIGHT, (case, r)
        assert r["loss_vs_hf_float32"] < 1e-6, (case, r)
        assert r["loaded_type"] == _model_class(case).__name__ and r["loaded_logits"] < TIGHT, (case, r)
    assert results["inputs_embeds_error"].startswith(
        "smp.nn.huggingface.gptneox: inputs_embeds is not supported by DistributedTransformerLMHead"
    )


# --- tp=2 and pp=2, two processes ------------------------------------------------------------------


def _train_dense(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids, mask, labels in batches:
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train_dmodel(model, batches):
    """SGD steps on a DistributedModel (smp initialized, every rank reads the whole batch)."""
    import smp

    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.SGD(dmodel.parameters(), lr=LR))

    @smp.step
    def train_step(ids, mask, labels):
        loss = dmodel(input_ids=ids, attention_mask=mask, labels=labels).loss
        dmodel.backward(loss)
        return loss

    losses = []
    for batch in batches:
        opt.zero_grad()
        losses.append(train_step(*batch).reduce_mean().item())
        opt.step()
    return dmodel, losses


def _trained(case, config, level, folder=None):
    """`case` trained 3 SGD steps in a DistributedModel under smp's `config` (HF's whole model or
    its blocks registered, per `level`), against HF's model trained in this process; with `folder`
    the trained state, translated to HF's keys and written with save_pretrained, is loaded by HF."""
    import smp

    cls = _model_class(case)
    # Microbatches of 2 rows: one right-padded and one left-padded row each, so every microbatch
    # has as many labels as the other and the mean of their losses is the batch's.
    batches = [_batch(40, rows=4)] * 3  # one batch thrice: the loss must fall
    torch.manual_seed(0)
    dense = cls(_config(case))
    whole = {k: v.clone() for k, v in dense.state_dict().items()}
    ref_losses = _train_dense(dense, batches)
    smp.init(config)
    with smp.tensor_parallelism():
        model = cls(_config(case))
    replaced = type(model).__name__ if level == "model" else type(next(iter(_blocks(model)))).__name__
    smp.nn.load_full_state_dict(model, _to_smp(case, whole))
    dmodel, losses = _train_dmodel(model, batches)
    state = _to_hf(case, dmodel.state_dict())  # gathers every shard
    trained = dense.state_dict()
    out = {
        "replaced": replaced,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_err": max(_max_err(state[k], trained[k]) for k in trained),
        "keys_match": set(state) == set(trained),
        "moved": max(_max_err(whole[k], trained[k]) for k in trained),  # how far training took the weights
    }
    if folder is not None:
        if smp.rank() == 0:
            cls(_config(case)).save_pretrained(folder, state_dict=state)
        smp.barrier()
        loaded = cls.from_pretrained(folder).eval()
        ids, mask, _ = _batch(60)
        with torch.no_grad():
            want = dense.eval()(input_ids=ids, attention_mask=mask).logits
            out["loaded_logits"] = _max_err(loaded(input_ids=ids, attention_mask=mask).logits, want)
    return out


def _blocks(model):
    return model.transformer.h if hasattr(model, "transformer") else model.gpt_neox.layers


def _tp2_forward():
    """Every case at tp=2 in float64, outside a DistributedModel: logits and loss against HF, and
    the local shapes (each rank its heads, its rows of the head)."""
    import smp

    results = {}
    for case in CASES:
        config, cls = _config(case), _model_class(case)
        torch.manual_seed(0)
        dense = cls(config).double().eval()
        with smp.tensor_parallelism():
            model = cls(config)
        model.double().eval()
        smp.nn.load_full_state_dict(model, _to_smp(case, dense.state_dict()))
        r = _forward_errors(model, dense, seed=3)
        layer = model.transformer.seq_layers[0]
        r["shapes"] = [tuple(layer.attention.query.weight.shape), tuple(model.word_embedding.weight.shape)]
        head = model.lm_head
        r["head_shape"] = None if head is None else tuple(head.weight.shape)
        r["roundtrip"] = _same(_to_hf(case, smp.nn.full_state_dict(model)), dense.state_dict())
        results[case] = r
    return results


def _tp2(rank, world_size, folder):
    import smp

    _register_layers()
    results = {
        # Blocks in a two-stage pipeline: position ids cross the stages with the hidden states.
        "gptj_layers_pp2": _trained("gptj", {"pipeline_parallel_degree": 2, "microbatches": 2}, "layers"),
    }
    smp.parallel_state.reset()
    tp2 = {"tensor_parallel_degree": 2, "prescaled_batch": True}
    results["neox_layers_tp2"] = _trained("neox_parallel", tp2, "layers")
    smp.parallel_state.reset()
    _register_lm_heads()  # from here on the whole models are replaced
    smp.init({"tensor_parallel_degree": 2})
    results["forward"] = _tp2_forward()
    smp.parallel_state.reset()
    results["gptj_tp2"] = _trained("gptj", tp2, "model", f"{folder}/gptj")
    smp.parallel_state.reset()
    results["neox_sequential_tp2"] = _trained("neox_sequential", tp2, "model", f"{folder}/neox")
    return results


def test_rotary_models_at_tp2_and_in_a_pipeline(tmp_path):
    """At tp=2 each rank holds half the heads (rotated on that rank) and half the vocabulary rows:
    logits and loss equal HF's (float64); trained 3 SGD steps in a DistributedModel (float32),
    GPT-J and GPT-NeoX track HF's losses and weights, with the whole model or its blocks
    registered, at tp=2 and on two pipeline stages; the trained state, translated and written
    with save_pretrained, loads into HF's class with the trained model's logits."""
    results = run_ranks(_tp2, 2, str(tmp_path), timeout=240)
    for r in results:
        for case, f in r["forward"].items():
            assert f["replaced"] == "DistributedTransformerLMHead" and f["roundtrip"], (case, f)
            assert f["logits"] < TIGHT and f["logits_without_mask"] < TIGHT and f["loss"] < TIGHT, (case, f)
            assert f["shapes"] == [(16, 32), (VOCAB // 2, 32)], (case, f)  # 2 of 4 heads of size 8
            assert f["head_shape"] == (None if case == "neox_sequential" else (VOCAB // 2, 32)), (case, f)
        for name in ("gptj_layers_pp2", "neox_layers_tp2", "gptj_tp2", "neox_sequential_tp2"):
            case = r[name]
            expected = (
                "DistributedTransformerLMHead" if name.endswith("_tp2") and "layers" not in name else None
            )
            assert case["replaced"] == (expected or "DistributedTransformerLayer"), (name, case)
            pairs = zip(case["losses"], case["ref_losses"], strict=True)
            assert max(abs(a - b) / b for a, b in pairs) < CLOSE, (name, case)
            assert case["param_err"] < CLOSE and case["keys_match"], (name, case)
            assert case["ref_losses"][-1] < case["ref_losses"][0] and case["moved"] > 100 * CLOSE, (
                name,
                case,
            )
        for name in ("gptj_tp2", "neox_sequential_tp2"):
            assert r[name]["loaded_logits"] < CLOSE, (name, r[name])


# --- bad arguments: clear errors --------------------------------------------------------------------


def test_bad_rotary_and_residual_arguments():
    import smp

    attention = dict(num_attention_heads=2, attention_head_size=8, hidden_size=16)
    cases = [
        (dict(rotary_dim=10), r"rotary_dim=10 is larger than attention_head_size=8"),
        (dict(rotary_dim=3), r"rotary_dim=3 is odd; .* use an even rotary_dim"),
        (dict(rotary_dim=0), r"rotary_dim=0 must be a positive int"),
        (dict(rotary_dim=4, rotary_emb_base=0), r"rotary_emb_base=0 must be positive"),
        (dict(rotary_dim=4, cross_attention=True), r"rotary_dim=4 with cross_attention=True"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=rf"smp.nn.DistributedAttentionLayer: {message}"):
            smp.nn.DistributedAttentionLayer(**attention, **kwargs)
    layer = dict(attention, intermediate_size=32)
    with pytest.raises(ValueError, match=r"parallel_attn_output=True with pre_layernorm=False"):
        smp.nn.DistributedTransformerLayer(**layer, parallel_attn_output=True)
    with pytest.raises(ValueError, match=r"shared_pre_layernorm=True needs parallel_attn_output=True"):
        smp.nn.DistributedTransformerLayer(
            **layer, pre_layernorm=True, post_layernorm=False, shared_pre_layernorm=True
        )
    with pytest.raises(ValueError, match=r"lm_head_bias=True with tie_word_embeddings=True"):
        smp.nn.DistributedTransformerLMHead(1, **layer, vocab_size=16, lm_head_bias=True)


def test_hf_configs_the_layers_cannot_compute_are_refused():
    import smp
    from smp.nn.huggingface import gptj, gptneox

    config = _config("gptj")
    config.tie_word_embeddings = True
    with pytest.raises(
        ValueError, match=r"gptj: tie_word_embeddings=True .* is not supported by Distributed"
    ):
        gptj.lm_head_init_hook(config)
    config = _config("gptj")
    config.rotary_dim = 16  # more than the head size (8): the layer's own check names it
    _, kwargs = gptj.layer_init_hook(config)
    with pytest.raises(ValueError, match=r"rotary_dim=16 is larger than attention_head_size=8"):
        smp.nn.DistributedTransformerLayer(**kwargs)
    config = _config("neox_parallel")
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=r"gptneox: rope_type='linear'"):
        gptneox.lm_head_init_hook(config)
    fused = {"gpt_neox.layers.0.attention.query_key_value.weight": torch.zeros(3 * 24, 24)}
    with pytest.raises(ValueError, match=r"hidden_size=24 is unknown .* pass num_attention_heads="):
        gptneox._layer_to_smp(None)({"attention.query_key_value.weight": fused.popitem()[1]})


def test_fused_qkv_translation_is_per_head():
    """GPT-NeoX's fused rows are [q_0, k_0, v_0, q_1, ...] per head: the split gives each of
    query/key/value its heads in order, and fusing them back gives the same tensor."""
    from smp.nn.huggingface import gptneox

    heads, size, hidden = 2, 3, 6
    rows = torch.arange(3 * heads * size, dtype=torch.float64)
    layer = {
        "attention.query_key_value.weight": rows[:, None].expand(-1, hidden).clone(),
        "attention.query_key_value.bias": rows,
    }
    split = gptneox._layer_to_smp(heads)(layer)
    assert split["attention.query.bias"].tolist() == [0, 1, 2, 9, 10, 11]
    assert split["attention.key.bias"].tolist() == [3, 4, 5, 12, 13, 14]
    assert split["attention.value.bias"].tolist() == [6, 7, 8, 15, 16, 17]
    assert _same(gptneox._layer_to_hf(heads)(split), layer)


# --- pp=2 x tp=2, four processes ---------------------------------------------------------------------


def _pp2_tp2(rank, world_size):
    import smp

    _register_layers()
    config = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}
    results = {"gptj": _trained("gptj", config | {"prescaled_batch": True}, "layers")}
    smp.parallel_state.reset()
    results["neox_sequential"] = _trained("neox_sequential", config | {"prescaled_batch": True}, "layers")
    return results


def test_rotary_blocks_in_a_tensor_parallel_pipeline():
    """GPT-J's and GPT-NeoX's blocks as DistributedTransformerLayers on two pipeline stages of two
    tensor-parallel ranks each: 3 SGD steps track HF's model."""
    results = run_ranks(_pp2_tp2, 4, timeout=300)
    for r in results:
        for name, case in r.items():
            assert case["replaced"] == "DistributedTransformerLayer", (name, case)
            pairs = zip(case["losses"], case["ref_losses"], strict=True)
            assert max(abs(a - b) / b for a, b in pairs) < CLOSE, (name, case)
            assert case["param_err"] < CLOSE and case["keys_match"], (name, case)
            assert case["ref_losses"][-1] < case["ref_losses"][0] and case["moved"] > 100 * CLOSE, (
                name,
                case,
            )


def test_neox_head_count_from_built_models_is_never_a_guess(monkeypatch):
    """Without num_attention_heads=, the fused qkv split uses the head count of the models built
    at that width: one count is used, two are an error, none is an error."""
    from smp.nn.huggingface import gptneox

    monkeypatch.setattr(gptneox, "_heads_by_width", {8: {2}, 16: {2, 4}})
    assert gptneox._heads(8, None) == 2
    assert gptneox._heads(16, 4) == 4
    with pytest.raises(ValueError, match=r"hidden_size=16 were built with \[2, 4\] attention heads"):
        gptneox._heads(16, None)
    with pytest.raises(ValueError, match="hidden_size=32 is unknown"):
        gptneox._heads(32, None)
