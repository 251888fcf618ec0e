"""What the planner knows of a mixture of experts, from a Hugging Face config (docs/planner.md,
"Mixtures of experts"): E routed experts in each MoE layer, each token through top_k of them.

Keys read, whatever the family calls them: the experts (`num_local_experts` Mixtral,
`num_experts` OLMoE / Qwen-MoE, `n_routed_experts` DeepSeek), top_k (`num_experts_per_tok`), an
expert's intermediate size (`moe_intermediate_size`, else `intermediate_size`), shared experts
(Qwen's `shared_expert_intermediate_size` with its sigmoid gate, DeepSeek's `n_shared_experts`),
which layers are MoE (Qwen's `decoder_sparse_step` / `mlp_only_layers`, DeepSeek's
`first_k_dense_replace` / `moe_layer_freq`; otherwise every layer). The other layers keep the
dense MLP of `intermediate_size`. DeepSeek's latent attention is counted as ordinary attention.

Per MoE layer: parameters = attention + norms + router (hidden x E, replicated) + shared experts +
E experts; FLOPs and saved activations per token those of top_k experts: the dispatched tokens
(top_k x hidden, the experts' input), each expert's intermediates, the experts' outputs (kept for
the routing weights' gradient), the router's logits, fp32 probabilities and top_k indices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from smp.planner.facts import Matmul, ModelFacts, Params, Saved

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


@dataclasses.dataclass(frozen=True)
class Moe:
    experts: int
    top_k: int
    intermediate: int  # one expert's
    shared: int  # the shared experts' intermediate size together (0: none)
    shared_gate: bool  # Qwen's sigmoid gate on the shared expert (hidden x 1)
    layers: int  # MoE layers


def read(config: Mapping[str, Any], layers: int, intermediate: int) -> Moe | None:
    """The config's experts, or None for a dense model; a clear error for a half-described one."""
    experts = next((config[k] for k in _EXPERT_KEYS if config.get(k)), 0)
    if not experts:
        return None
    top_k = next((config[k] for k in _TOP_K_KEYS if config.get(k)), None)
    for name, value in (("experts", experts), ("experts per token (num_experts_per_tok)", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"smp.plan: the model config's {name} must be a positive integer, got {value!r}; "
                "a mixture of experts needs both its number of experts and num_experts_per_tok"
            )
    if top_k > experts:
        raise ValueError(f"smp.plan: num_experts_per_tok {top_k} is more than the {experts} experts")
    inner = int(config.get("moe_intermediate_size") or intermediate)
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    shared = shared or int(config.get("n_shared_experts") or 0) * inner
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or ())
    first = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    count = sum(
        1
        for i in range(layers)
        if i not in dense_only and (i + 1) % step == 0 and i >= first and i % freq == 0
    )
    return Moe(experts, top_k, inner, shared, "shared_expert_intermediate_size" in config, count)


def with_experts(facts: ModelFacts, s, moe: Moe, attn: int, seq: int) -> ModelFacts:
    """`facts` of the dense model a config describes (`s`: model_facts._Shape), its MLPs turned
    into `moe`'s experts where the layers are MoE: every per-layer figure the average per layer."""
    h, n_mats = s.hidden, 3 if s.gated else 2
    saves = 4 if s.gated else s.mlp_saves  # [intermediate] tensors an MLP saves per token

    def mlp(inner: int) -> int:
        return n_mats * h * inner + (((n_mats - 1) * inner + h) if s.mlp_bias else 0) if inner else 0

    share = moe.layers / s.layers
    dense = 1.0 - share
    router = h * moe.experts
    shared = mlp(moe.shared) + (h if moe.shared_gate and moe.shared else 0)
    norms = facts.layer.total - attn - mlp(s.intermediate)
    layer = Params(
        attn + norms + share * (router + shared) + dense * mlp(s.intermediate),
        attn + share * shared + dense * mlp(s.intermediate),
    )
    expert = mlp(moe.intermediate)
    q = s.heads * s.head_dim
    active_mlp = share * (router + shared + moe.top_k * expert) + dense * mlp(s.intermediate)
    dense_saved = Saved(sharded_elements=seq * saves * s.intermediate)
    moe_saved = Saved(
        replicated_elements=seq * (moe.experts + 2 * moe.top_k * h),
        sharded_elements=seq * saves * (moe.top_k * moe.intermediate + moe.shared),
        replicated_bytes=seq * (4 * moe.experts + 12 * moe.top_k),
    )
    first = (2 if s.gated else 1) * moe.intermediate
    matmuls = [*facts.matmuls[:2]]
    if dense:
        matmuls += [dataclasses.replace(m, share=dense) for m in facts.matmuls[2:]]
    if moe.shared:
        shared_first = (2 if s.gated else 1) * moe.shared
        matmuls += [Matmul(h, shared_first, "n", share=share), Matmul(moe.shared, h, "k", share=share)]
    matmuls += [
        Matmul(h, first, "n", experts=moe.experts, share=share),
        Matmul(moe.intermediate, h, "k", experts=moe.experts, share=share),
    ]
    return dataclasses.replace(
        facts,
        source=facts.source.replace("Hugging Face config", "Hugging Face config, mixture of experts", 1),
        layer=layer,
        saved_layer=facts.saved_layer + (moe_saved + dense_saved * -1.0) * share,
        layer_flops_per_token=2 * (attn + active_mlp) + 4 * seq * q,
        matmuls=tuple(matmuls),
        experts=moe.experts,
        top_k=moe.top_k,
        moe_layers=moe.layers,
        expert=Params(expert, expert),
    )
