"""Hugging Face transformers models as the library gives them, built from small configs (no
downloads), with the batches and losses the integration tests train them on."""

from __future__ import annotations

import torch

VOCAB = 96
SEQ = 16


def gpt2(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def bert():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def causal_batch(step, n):
    g = torch.Generator().manual_seed(5000 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return {"ids": ids, "labels": ids}


MASK_PER_ROW = 4  # the same count in every row, so per-microbatch means average to the global mean


def masked_batch(step, n):
    g = torch.Generator().manual_seed(6000 + step)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    where = torch.rand(n, SEQ, generator=g).argsort(dim=1)[:, :MASK_PER_ROW]
    labels = torch.full_like(ids, -100).scatter(1, where, ids.gather(1, where))
    return {"ids": ids.scatter(1, where, 0), "labels": labels}


def _case(build, batch):
    def make():
        return (
            build(),
            batch,
            lambda m, b: m(input_ids=b["ids"], labels=b["labels"]),
            lambda out, b: out.loss,
        )

    return make


CASES = {
    "hf_gpt2": _case(gpt2, causal_batch),
    "hf_llama": _case(llama, causal_batch),
    "hf_bert": _case(bert, masked_batch),
}
