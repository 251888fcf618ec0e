"""smp config: SMP v1's parameters and defaults, and a clear error for every mistake."""

from __future__ import annotations

import json
import warnings

import pytest
from smp import config as cfg


def test_defaults_are_smp_v1_defaults():
    c = cfg.parse({})
    assert c.pipeline_parallel_degree == 1 and c.tensor_parallel_degree == 1
    assert c.microbatches == 1 and c.pipeline == "interleaved"
    assert c.placement_strategy == "cluster" and c.placement_order == "DPT"
    assert c.auto_partition is True and c.default_partition == 0
    assert c.memory_weight == 0.8 and c.optimize == "speed"
    assert c.activation_loading_horizon == 4 and c.tensor_parallel_seed == 0
    for flag in (
        "prescaled_batch",
        "shard_optimizer_state",
        "ddp",
        "fp16",
        "bf16",
        "offload_activations",
        "delayed_parameter_initialization",
        "skip_tracing",
    ):
        assert getattr(c, flag) is False, flag


def test_every_parameter_is_accepted_and_stored():
    given = {
        "partitions": 2,
        "tensor_parallel_degree": 2,
        "microbatches": 8,
        "pipeline": "simple",
        "active_microbatches": 3,
        "prescaled_batch": True,
        "shard_optimizer_state": True,
        "placement_strategy": "spread",
        "auto_partition": False,
        "default_partition": 1,
        "memory_weight": 0.3,
        "optimize": "memory",
        "ddp": True,
        "bf16": True,
        "offload_activations": True,
        "activation_loading_horizon": 2,
        "delayed_parameter_initialization": True,
        "tensor_parallel_seed": 7,
        "skip_tracing": True,
    }
    c = cfg.parse(given)
    assert c.pipeline_parallel_degree == 2
    for key, value in given.items():
        if key != "partitions":
            assert getattr(c, key) == value, key
    assert c.placement_order == "TPD" and c.num_active_microbatches == 3


def test_active_microbatches_defaults_to_pp_plus_two_capped():
    assert cfg.parse({"partitions": 2, "microbatches": 8}).num_active_microbatches == 4
    assert cfg.parse({"partitions": 4, "microbatches": 3}).num_active_microbatches == 3


def test_environment_json_and_explicit_argument_wins(monkeypatch):
    monkeypatch.setenv("SMP_CONFIG", json.dumps({"microbatches": 4, "tensor_parallel_degree": 2}))
    c = cfg.parse({"microbatches": 2})
    assert c.microbatches == 2 and c.tensor_parallel_degree == 2


def test_sagemaker_environment_variable_is_read(monkeypatch):
    monkeypatch.delenv("SMP_CONFIG", raising=False)
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({"partitions": 2}))
    assert cfg.parse(None).pipeline_parallel_degree == 2


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"pipline_parallel_degree": 2},
            "unknown key 'pipline_parallel_degree'; did you mean 'pipeline_parallel_degree'?",
        ),
        ({"microbatch": 2}, "did you mean 'microbatches'?"),
        ({"zzz": 1}, "unknown key 'zzz'; valid keys:"),
        ({"microbatches": "4"}, "'microbatches' must be an integer, got '4' (str)"),
        ({"microbatches": 0}, "'microbatches' must be a positive integer, got 0"),
        ({"tensor_parallel_degree": 2.0}, "'tensor_parallel_degree' must be an integer, got 2.0"),
        ({"ddp": 1}, "'ddp' must be true or false, got 1 (int)"),
        ({"memory_weight": 1.5}, "'memory_weight' must be in [0, 1], got 1.5"),
        (
            {"pipeline": "1f1b"},
            "'pipeline' must be 'interleaved' or 'simple' or 'zero_bubble' or 'zero_bubble_v', got '1f1b'",
        ),
        ({"optimize": "fast"}, "'optimize' must be 'speed' or 'memory', got 'fast'"),
        ({"placement_strategy": "DPP"}, "'placement_strategy' must be 'cluster', 'spread' or a permutation"),
        ({"fp16": True, "bf16": True}, "'fp16' and 'bf16' are both true"),
        ({"microbatches": 2, "active_microbatches": 3}, "active_microbatches (3) exceeds microbatches (2)"),
        (
            {"partitions": 2, "default_partition": 2},
            "default_partition (2) must be in [0, pipeline_parallel_degree) = [0, 2)",
        ),
        ({"default_partition": -1}, "'default_partition' must be >= 0, got -1"),
        (
            {"partitions": 2, "pipeline_parallel_degree": 4},
            "'partitions' (2) and 'pipeline_parallel_degree' (4) disagree",
        ),
        ({"sharded_data_parallel_degree": 2, "shard_optimizer_state": True}, "set only one of them"),
    ],
)
def test_bad_config_names_key_value_and_fix(config, message):
    with pytest.raises(ValueError) as info:
        cfg.parse(config)
    assert message in str(info.value)


def test_bad_environment_json(monkeypatch):
    monkeypatch.setenv("SMP_CONFIG", "{microbatches: 2")
    with pytest.raises(ValueError, match="SMP_CONFIG is not valid JSON"):
        cfg.parse(None)


def test_world_size_not_divisible_names_the_three_numbers():
    c = cfg.parse({"partitions": 2, "tensor_parallel_degree": 2})
    with pytest.raises(ValueError) as info:
        c.check_world(6)
    assert (
        "world size 6 is not divisible by pipeline_parallel_degree (2) x tensor_parallel_degree (2) = 4"
        in str(info.value)
    )
    c.check_world(8)


def test_tensor_parallel_degree_not_power_of_two_warns():
    with pytest.warns(UserWarning, match="tensor_parallel_degree=3 is not a power of two"):
        cfg.parse({"tensor_parallel_degree": 3})


def test_tensor_parallelism_across_nodes_warns():
    c = cfg.parse({"tensor_parallel_degree": 4})
    with pytest.warns(UserWarning, match="larger than the 2 processes per node"):
        c.check_world(8, local_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.check_world(8, local_size=8)


def test_legacy_keys_are_accepted_with_a_warning():
    with pytest.warns(UserWarning, match="'ddp_dist_backend' configured SMP v1's plumbing"):
        cfg.parse({"ddp_dist_backend": "auto"})


def test_cuda_graph_compile_modes_only_where_the_model_runs_whole():
    from smp import config

    assert config.parse({"compile": {"mode": "reduce-overhead"}}).compile["mode"] == "reduce-overhead"
    for layout in (
        {"pipeline_parallel_degree": 2, "microbatches": 2},
        {"tensor_parallel_degree": 2},
        {"sharded_data_parallel_degree": 2},
    ):
        for mode in ("reduce-overhead", "max-autotune"):
            wanted = f"compile mode '{mode}' records CUDA graphs.*{next(iter(layout))}=2"
            with pytest.raises(ValueError, match=wanted):
                config.parse(layout | {"compile": {"mode": mode}})
    assert config.parse({"pipeline_parallel_degree": 2, "compile": {"mode": "max-autotune-no-cudagraphs"}})


def test_the_rule_tables_cover_the_keys():
    """Every key has its value check (config_rules.VALUES); every agreement rule and every
    value that changes nothing (smp.inert) names keys there are."""
    from smp import config_rules, inert

    assert set(config_rules.VALUES) == set(cfg._FIELDS)
    for rule in config_rules.AGREEMENT:
        assert set(rule.keys) <= set(cfg._FIELDS), rule.keys
    assert set(inert.CONFIG_VALUES) <= set(cfg._FIELDS)
    assert not set(inert.LEGACY_NO_OP_KEYS) & set(cfg._FIELDS)
