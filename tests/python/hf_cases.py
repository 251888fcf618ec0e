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


# Llama's small shape, which Mistral shares (grouped-query attention: 4 heads, 2 for keys/values).
_LLAMA_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
)


def llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, **_LLAMA_SHAPE)
    return LlamaForCausalLM(config)


def mistral(layers: int = 2, window: int = 4, initializer_range: float = 0.02):
    """Llama's shape with Mistral's sliding window: each token sees the last `window` positions
    (4 of the 16 by default, so the window cuts every sequence)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        num_hidden_layers=layers,
        **_LLAMA_SHAPE,
        sliding_window=window,
        initializer_range=initializer_range,
    )
    return MistralForCausalLM(config)


def bert(layers: int = 4, initializer_range: float = 0.02):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=initializer_range,
    )
    return BertForMaskedLM(config)


def causal_batch(step, n):
    g = torch.Generator().manual_seed(5000 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return {"ids": ids, "labels": ids}


def causal_batch_ignoring(step, n):
    """causal_batch with -100 labels in the first row (tokens the loss skips: its mean is over
    the tokens left, counted over the whole sequence)."""
    b = causal_batch(step, n)
    b["labels"] = b["labels"].clone()
    b["labels"][0, 3:7] = -100
    return b


MASK_PER_ROW = 4  # the same count in every row, so per-microbatch means average to the global mean


def masked_batch(step, n):
    g = torch.Generator().manual_seed(6000 + step)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    where = torch.rand(n, SEQ, generator=g).argsort(dim=1)[:, :MASK_PER_ROW]
    labels = torch.full_like(ids, -100).scatter(1, where, ids.gather(1, where))
    return {"ids": ids.scatter(1, where, 0), "labels": labels}


PADDED = {1: 3, 3: 5}  # row -> padded tokens at its end (rows 0 and 2 unpadded)


def padded_masked_batch(step, n):
    """masked_batch with padding: rows 1 and 3 end in padding (attention_mask 0, labels -100, the
    masked tokens among the real ones), so the padding mask cuts the keys of some rows only."""
    g = torch.Generator().manual_seed(7000 + step)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.full_like(ids, -100)
    for row in range(n):
        real = SEQ - PADDED.get(row % 4, 0)
        mask[row, real:] = 0
        where = torch.randperm(real, generator=g)[:MASK_PER_ROW]
        labels[row, where] = ids[row, where]
        ids[row, where] = 0
    return {"ids": ids, "labels": labels, "mask": mask}


def _case(build, batch):
    def make():
        return (
            build(),
            batch,
            lambda m, b: m(input_ids=b["ids"], labels=b["labels"], **_mask(b)),
            lambda out, b: out.loss,
        )

    return make


def _frozen_key_bias(model):
    """BERT with its key biases frozen: softmax ignores them (they add one constant to a row's
    scores), so their true gradient is zero and what is computed is rounding noise (2e-8 here),
    which Adam's normalization turns into steps of about lr that differ with the summation order
    (2.3e-3 apart after 3 steps at cp=2). Frozen, the model computes the same function."""
    for name, p in model.named_parameters():
        if name.endswith("attention.self.key.bias"):
            p.requires_grad_(False)
    return model


def _mask(b):
    return {"attention_mask": b["mask"]} if "mask" in b else {}


CASES = {
    "hf_gpt2": _case(gpt2, causal_batch),
    "hf_llama": _case(llama, causal_batch),
    "hf_bert": _case(bert, masked_batch),
    # Context parallelism's other masks, tiny: Mistral's sliding window, BERT's padding. Weights
    # drawn wider than HF's 0.02 so that attention, and so its mask, moves the loss: without the
    # mask the first loss is 2.2e-2 (window) and 8.7e-3 (padding) off, at 0.02 only 7e-4 and 3.8e-6.
    "hf_mistral": _case(lambda: mistral(initializer_range=0.2), causal_batch_ignoring),
    "hf_bert_padded": _case(lambda: _frozen_key_bias(bert(2, initializer_range=0.2)), padded_masked_batch),
}
