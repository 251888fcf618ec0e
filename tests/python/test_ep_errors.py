"""Expert parallelism's bad input, each a clear error naming the module and the fix: a model with no
experts, experts the degree does not divide, experts kept as a ModuleList of MLPs, and 3-D banks
in a layout smp does not know. (A degree that does not divide data parallelism: test_ep_groups.)"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from smp.expert_parallel import ExpertLayoutError, expert_banks
from smp.expert_parallel.find import check_divides
from torch import nn


def _mixtral(experts: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=experts,
        num_experts_per_tok=2,
    )
    return MixtralForCausalLM(config)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(config)


class _ListMoe(nn.Module):
    """The older layout: a router and a ModuleList of expert MLPs, routed in the block's forward."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4))


class _OddBank(nn.Module):
    """3-D banks without transformers' experts marks (how it routes is unknown)."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.zeros(4, 8, 8))
        self.down_proj = nn.Parameter(torch.zeros(4, 8, 8))


def test_the_banks_of_transformers_moe_models_are_found():
    banks = expert_banks(_mixtral(4))
    assert [(b.path, b.num_experts, b.banks) for b in banks] == [
        ("model.layers.0.mlp.experts", 4, ("gate_up_proj", "down_proj"))
    ]


def test_a_model_without_experts_is_refused():
    model = _llama()
    with pytest.raises(
        ExpertLayoutError, match=r"expert_parallel_degree=2, but LlamaForCausalLM has no mixture"
    ):
        check_divides(expert_banks(model), 2, model)


def test_a_degree_that_does_not_divide_the_experts_is_refused():
    model = _mixtral(6)
    wanted = r"degree=4 does not divide the 6 experts of 'model.layers.0.mlp.experts'.*\[1, 2, 3, 6\]"
    with pytest.raises(ExpertLayoutError, match=wanted):
        check_divides(expert_banks(model), 4, model)
    check_divides(expert_banks(model), 2, model)


def test_unrecognised_layouts_are_named():
    with pytest.raises(
        ExpertLayoutError, match=r"'moe.experts' \(ModuleList\) is a ModuleList of 4 expert MLPs"
    ):
        expert_banks(nn.ModuleDict({"moe": _ListMoe()}))
    with pytest.raises(ExpertLayoutError, match=r"'bank' \(_OddBank\) holds 3-D expert banks .* in a layout"):
        expert_banks(nn.ModuleDict({"bank": _OddBank()}))


def _distribute(rank, world, build, arg):
    import smp

    smp.init({"expert_parallel_degree": 2})
    model = build(arg) if arg is not None else build()
    try:
        smp.DistributedModel(model)
    except ExpertLayoutError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "build, arg, wanted",
    [
        (_llama, None, "expert_parallel_degree=2, but LlamaForCausalLM has no mixture-of-experts layer"),
        (
            _mixtral,
            3,
            "expert_parallel_degree=2 does not divide the 3 experts of 'model.layers.0.mlp.experts'",
        ),
    ],
)
def test_distributed_model_refuses_on_every_rank(build, arg, wanted):
    for message in run_ranks(_distribute, 2, build, arg, timeout=120):
        assert message is not None and wanted in message
