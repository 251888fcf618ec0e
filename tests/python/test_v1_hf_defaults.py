"""SMP v1's out-of-the-box Hugging Face models (AWS's GPT-2, GPT-J and GPT-NeoX scripts rely on
them): built under `smp.model_creation(tensor_parallelism=True)` a supported model is replaced by
smp.nn's distributed transformer without any registration, trains like Hugging Face's model with
the same weights, and answers both SMP's path to its layers (`transformer.seq_layers`) and the
Hugging Face one. model_creation's SMP keywords do what they did or warn; delayed initialization
materializes what `__init__` computes (rotary frequencies) and initializes with the model's own
functions."""

from __future__ import annotations

import warnings

import torch
from harness import run_ranks

SEQ, VOCAB = 8, 64
CLOSE = 1e-5  # float32 training against one process


def _neox_config(**kw):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, rotary_pct=0.5, use_parallel_residual=True,
        tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False,
        eos_token_id=0, **kw,
    )  # fmt: skip


def _gpt2_config(**kw):
    from transformers import GPT2Config

    sizes = {"n_embd": 32, "n_layer": 2, **kw}
    return GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0, **sizes,
    )  # fmt: skip


def _batch(step, rows=4):
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(100 + step))
    return ids, torch.ones_like(ids)


# --- replaced by default, trained at tp=2 against the dense model -------------------------------


def _trains_replaced(rank, world_size):
    import smp
    import transformers
    from smp.nn.huggingface import gpt2, gptneox

    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    out = {}
    for name, config, translate in (
        ("gpt_neox", _neox_config(), gptneox.translate_hf_state_dict_to_smdistributed_gptneox),
        ("gpt2", _gpt2_config(), gpt2.translate_hf_state_dict_to_smdistributed_gpt2),
    ):
        torch.manual_seed(0)
        dense = transformers.AutoModelForCausalLM.from_config(config)  # outside: kept as it is
        with smp.model_creation(tensor_parallelism=True):
            built = transformers.AutoModelForCausalLM.from_config(config)
        layers = built.gpt_neox.layers if name == "gpt_neox" else built.transformer.h
        out[name] = {
            "dense": type(dense).__name__,
            "built": type(built).__name__,
            "hf_path_is_smp_path": layers is built.transformer.seq_layers,
            "not_a_submodule": not any(".layers." in n or ".h." in n for n, _ in built.named_parameters()),
        }
        out[name]["loss_errors"], out[name]["moved"] = _train_against(smp, built, dense, translate)
        smp.parallel_state.reset()
        smp.init({"tensor_parallel_degree": 2, "ddp": True})
    return out


def _train_against(smp, built, dense, translate=lambda state: state) -> tuple[list[float], float]:
    """`built` in a DistributedModel, loaded with the dense model's (translated) state, and the dense
    model trained 3 SGD steps side by side: the loss errors, and how far training moved the dense
    model's loss on the first batch."""
    model = smp.DistributedModel(built)
    model.load_state_dict(translate(dense.state_dict()))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    reference = torch.optim.SGD(dense.parameters(), lr=0.5)

    @smp.step
    def train(model, ids, mask):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids)["loss"]
        model.backward(loss)
        return loss

    errors, before = [], _loss(dense, 0)
    for step in range(3):
        ids, mask = _batch(step)
        got = train(model, ids, mask).reduce_mean()
        optimizer.step()
        optimizer.zero_grad()
        want = dense(input_ids=ids, attention_mask=mask, labels=ids).loss
        want.backward()
        reference.step()
        reference.zero_grad()
        errors.append(abs(got.item() - want.item()))
    return errors, abs(before - _loss(dense, 0))


def _loss(dense, step):
    ids, mask = _batch(step)
    with torch.no_grad():
        return dense(input_ids=ids, attention_mask=mask, labels=ids).loss.item()


def test_supported_models_are_replaced_by_default_and_train_as_the_dense_model():
    for result in run_ranks(_trains_replaced, 2, timeout=300):
        for name, r in result.items():
            assert r["dense"] != "DistributedTransformerLMHead", name
            assert r["built"] == "DistributedTransformerLMHead", name
            assert r["hf_path_is_smp_path"] and r["not_a_submodule"], name
            assert max(r["loss_errors"]) < CLOSE, (name, r["loss_errors"])
            assert r["moved"] > 100 * CLOSE, (name, r["moved"])


# --- when models are kept, and model_creation's keywords ----------------------------------------


def _kept_and_keywords(rank, world_size):
    import smp
    import transformers
    from smp.nn.huggingface import gptneox
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer

    smp.init({"tensor_parallel_degree": 2})
    build = transformers.AutoModelForCausalLM.from_config
    out = {}
    with smp.tensor_parallelism():  # smp's own context: the graph pass shards the model's modules
        out["tensor_parallelism"] = type(build(_gpt2_config())).__name__
    with smp.tensor_parallelism(distributed_transformer=True):
        out["tensor_parallelism_opt_in"] = type(build(_gpt2_config())).__name__
    with smp.model_creation(tensor_parallelism=True, distributed_transformer=False):
        out["opted_out"] = type(build(_gpt2_config())).__name__
    with smp.model_creation(tensor_parallelism=False):
        out["no_tp"] = type(build(_gpt2_config())).__name__
    with smp.model_creation(tensor_parallelism=True):  # BERT and RoBERTa: the encoder is replaced
        bert = transformers.BertModel(
            transformers.BertConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
            )
        )
    out["bert"] = (type(bert.encoder).__name__, bert.encoder.layer is bert.encoder.seq_layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with smp.model_creation(tensor_parallelism=True):  # a head smp.nn cannot tie differently
            out["refused"] = type(build(_gpt2_config(tie_word_embeddings=False))).__name__
    out["refused_warning"] = [str(w.message) for w in caught if "kept as it is" in str(w.message)]
    # SMP's keywords: attention in fp32 (also Megatron's layer scaling), fp32 residuals.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with smp.model_creation(
                tensor_parallelism=True, query_key_layer_scaling=True, fp32_residual_addition=True,
                fused_bias_gelu=True, fused_softmax=True, zero_init=True, distribute_embedding=False,
                flash_attention=True, fused_dropout=False,
            ):  # fmt: skip
                model = build(_gpt2_config())
    layer = model.transformer.seq_layers[0]
    out["fp32_scores"] = layer.attention.attention_scores_in_fp32
    out["fp32_residual"] = layer.fp32_residual_addition and layer.output.fp32_residual_addition
    messages = [str(w.message) for w in caught if "changes nothing" in str(w.message)]
    out["no_effect"] = sorted(m.split(":")[1].split("=")[0].strip() for m in messages)
    try:
        with smp.model_creation(tensor_parallelism=True, use_alibi=True):
            pass
        out["alibi"] = "accepted"
    except ValueError as e:
        out["alibi"] = str(e)
    # A user's registration of a model's class ends that model's default replacement.
    smp.tp_register_with_module(
        GPTNeoXLayer, smp.nn.DistributedTransformerLayer, *gptneox.get_hf_gptneox_transformer_layer_hooks()
    )
    with smp.model_creation(tensor_parallelism=True):
        mixed = build(_neox_config())
    out["user_registered"] = (type(mixed).__name__, type(mixed.gpt_neox.layers[0]).__name__)
    return out


def test_models_are_kept_outside_model_creation_and_its_keywords_act_or_warn():
    r = run_ranks(_kept_and_keywords, 2, timeout=180)[0]
    assert r["tensor_parallelism"] == "GPT2LMHeadModel"
    assert r["tensor_parallelism_opt_in"] == "DistributedTransformerLMHead"
    assert r["opted_out"] == r["no_tp"] == "GPT2LMHeadModel"
    assert r["bert"] == ("DistributedTransformer", True)
    assert r["refused"] == "GPT2LMHeadModel"
    assert len(r["refused_warning"]) == 1 and "tie_word_embeddings=False" in r["refused_warning"][0]
    assert r["fp32_scores"] is True and r["fp32_residual"] is True
    # Each warns once (two blocks built), and only for values that would have changed something.
    assert r["no_effect"] == [
        "distribute_embedding",
        "flash_attention",
        "fused_bias_gelu",
        "fused_softmax",
        "zero_init",
    ]
    assert "use_alibi=True is not supported" in r["alibi"] and "ALiBi" in r["alibi"]
    assert r["user_registered"] == ("GPTNeoXForCausalLM", "DistributedTransformerLayer")


# --- delayed initialization: computed buffers, the model's own initializers ---------------------


def _delayed(rank, world_size):
    import smp
    import transformers

    smp.init({"delayed_parameter_initialization": True})
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(_neox_config())
    with smp.model_creation(tensor_parallelism=False):
        neox = transformers.AutoModelForCausalLM.from_config(_neox_config())
    meta = {
        "params_meta": all(p.is_meta for p in neox.parameters()),
        "buffers_real": not any(b.is_meta for b in neox.buffers()),
    }
    wide = _gpt2_config(n_embd=64, n_layer=8)  # residual projections drawn with std 0.02 / sqrt(16)
    with smp.model_creation(tensor_parallelism=False):
        gpt2 = transformers.AutoModelForCausalLM.from_config(wide)
    model = smp.DistributedModel(torch.nn.ModuleDict({"neox": neox, "gpt2": gpt2}))
    rotary = {n: b for n, b in eager.named_buffers() if "inv_freq" in n}
    meta["inv_freq_equal"] = bool(rotary) and all(
        torch.equal(dict(neox.named_buffers())[n], b) for n, b in rotary.items()
    )
    blocks = gpt2.transformer.h
    meta["c_proj_std"] = torch.cat([b.attn.c_proj.weight.flatten() for b in blocks]).std().item()
    meta["c_attn_std"] = torch.cat([b.attn.c_attn.weight.flatten() for b in blocks]).std().item()
    meta["neox_dense_std"] = neox.gpt_neox.layers[0].mlp.dense_h_to_4h.weight.std().item()
    meta["bias_zero"] = not neox.gpt_neox.layers[0].mlp.dense_h_to_4h.bias.any()
    meta["same_on_ranks"] = [p.sum().item() for p in model.parameters()][:4]
    return meta


def test_delayed_initialization_computes_buffers_and_uses_the_models_initializers():
    results = run_ranks(_delayed, 2, timeout=180)
    r = results[0]
    assert r["params_meta"] and r["buffers_real"]
    assert r["inv_freq_equal"]  # as __init__ computes them (no reset_parameters() to call)
    assert abs(r["c_attn_std"] - 0.02) < 0.002  # HF's N(0, 0.02), not torch's default uniform
    assert abs(r["c_proj_std"] - 0.02 / 4) < 0.001  # GPT-2's block-level scaling of its children
    assert abs(r["neox_dense_std"] - 0.02) < 0.003 and r["bias_zero"]
    assert results[1]["same_on_ranks"] == r["same_on_ranks"]  # replicas agree


def _delayed_captured(rank, world_size):
    """GPT-NeoX built delayed (meta parameters, real rotary tables) and captured for tensor
    parallelism, a dense state loaded before the first step: it trains as the dense model."""
    import smp
    import transformers

    smp.init({"tensor_parallel_degree": 2, "delayed_parameter_initialization": True})
    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(_neox_config())
    with smp.model_creation(tensor_parallelism=True, distributed_transformer=False):
        built = transformers.AutoModelForCausalLM.from_config(_neox_config())
    errors, moved = _train_against(smp, built, dense)  # (loaded before the first step: SMP's rule)
    return {"type": type(built).__name__, "errors": errors, "moved": moved}


def test_delayed_model_with_computed_buffers_is_captured_and_trains_as_the_dense_model():
    for r in run_ranks(_delayed_captured, 2, timeout=240):
        assert r["type"] == "GPTNeoXForCausalLM"
        assert max(r["errors"]) < CLOSE and r["moved"] > 100 * CLOSE, r
