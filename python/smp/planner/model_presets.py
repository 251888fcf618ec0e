"""Named model configs `smp.plan` and `python -m smp.plan --model` take in place of a config.json:
Hugging Face configs of well-known models, the keys model_facts.py / moe_facts.py read, as each
model's published config.json gives them."""

from __future__ import annotations

from typing import Any

# mistralai/Mixtral-8x7B-v0.1: 32 layers, every one MoE, 8 experts of intermediate 14336, top-2.
# 46.7B parameters, 12.9B per token (Mistral AI's announcement: "46.7B total, 12.9B per token").
MIXTRAL_8X7B: dict[str, Any] = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rope_theta": 1e6,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
}
# allenai/OLMoE-1B-7B-0924: 16 layers, 64 experts of intermediate 1024, top-8; 6.9B parameters,
# 1.3B per token.
OLMOE_1B_7B: dict[str, Any] = {
    "model_type": "olmoe",
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "vocab_size": 50304,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
}
# Qwen/Qwen1.5-MoE-A2.7B: 24 layers, 60 experts of intermediate 1408, top-4, and a shared expert of
# 5632 with its sigmoid gate; 14.3B parameters, 2.7B per token.
QWEN1_5_MOE_A2_7B: dict[str, Any] = {
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
    "rope_theta": 1e6,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": True,
    "mlp_bias": False,
}

MODELS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": MIXTRAL_8X7B,
    "olmoe-1b-7b": OLMOE_1B_7B,
    "qwen1.5-moe-a2.7b": QWEN1_5_MOE_A2_7B,
}
