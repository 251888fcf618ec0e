"""SMP v1 config keys that real training scripts pass, and SageMaker's config precedence."""

from __future__ import annotations

import json
import warnings

import pytest
from smp import config as cfg

# What the GPT-2/GPT-J/GPT-NeoX/Falcon notebooks and older scripts put in their smp.init dicts.
NO_OP_KEYS = {
    "static_mode": True,
    "fast_mode": True,
    "ddp_dist_backend": "auto",
    "checkpoint_attentions": False,
    "_match_weights": False,
    "_fp32_grad_accumulation": False,
    "deterministic_server": True,
    "fp16_params": False,
}


# SMP v1's sharded-data-parallel keys, with their defaults: config fields of smp's own sdp.
SDP_KEYS = {
    "sdp_hierarchical_allgather": True,
    "sdp_gradient_clipping": 1.0,
    "sdp_reduce_bucket_size": int(5e8),
    "sdp_param_persistence_threshold": int(1e6),
    "sdp_max_live_parameters": int(1e9),
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("SMP_CONFIG", raising=False)
    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)


@pytest.mark.parametrize("key", sorted(NO_OP_KEYS))
def test_legacy_key_is_accepted_with_one_warning_saying_why(key):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = cfg.parse({"partitions": 1, key: NO_OP_KEYS[key]})
    mine = [str(w.message) for w in caught if f"'{key}'" in str(w.message)]
    assert len(mine) == 1 and "no effect" in mine[0], mine
    assert c == cfg.Config()


def test_notebook_config_parses():
    notebook = {
        "ddp": True,
        "tensor_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
        "microbatches": 1,
        "shard_optimizer_state": False,
        "prescaled_batch": False,
        "fp16": False,
        "bf16": True,
        "offload_activations": False,
        "delayed_parameter_initialization": True,
        "optimize": "speed",
        "placement_strategy": "cluster",
        "activation_loading_horizon": 4,
        "skip_tracing": False,
        "auto_partition": True,
        "default_partition": None,
        "sharded_data_parallel_degree": 1,
        **SDP_KEYS,
        **NO_OP_KEYS,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = cfg.parse(notebook)
    assert c.bf16 and c.delayed_parameter_initialization and c.default_partition == 0


def test_default_partition_null_is_smp_default():
    assert cfg.parse({"partitions": 2, "default_partition": None}).default_partition == 0


def test_underscore_prescaled_batch_is_prescaled_batch():
    assert cfg.parse({"_prescaled_batch": True}).prescaled_batch
    with pytest.raises(ValueError, match="'_prescaled_batch' .* and 'prescaled_batch' .* disagree"):
        cfg.parse({"_prescaled_batch": True, "prescaled_batch": False})


def test_sagemaker_launcher_config_wins_over_the_script(monkeypatch):
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({"partitions": 2, "microbatches": 4}))
    monkeypatch.setenv("SMP_CONFIG", json.dumps({"microbatches": 8, "ddp": True, "memory_weight": 0.5}))
    with pytest.warns(UserWarning, match=r"SM_HP_MP_PARAMETERS sets 'pipeline_parallel_degree'=2 .*wins"):
        c = cfg.parse({"pipeline_parallel_degree": 1, "microbatches": 2, "memory_weight": 0.3})
    # launcher > script > SMP_CONFIG, key by key
    assert (c.pipeline_parallel_degree, c.microbatches, c.memory_weight, c.ddp) == (2, 4, 0.3, True)


@pytest.mark.parametrize("key", sorted(SDP_KEYS))
def test_sdp_keys_default_to_smp_v1s_values_and_are_quiet_without_sdp(key):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = cfg.parse({"partitions": 1, key: SDP_KEYS[key]})
    assert not [w for w in caught if key in str(w.message)]
    assert c == cfg.Config() and getattr(c, key) == SDP_KEYS[key]


# Keys smp parses and never reads: (key, a value that changed something in SMP v1, SMP's default or
# what smp always does, which stays quiet).
INERT_VALUES = [("optimize", "memory", "speed"), ("ddp", False, True), ("skip_tracing", True, False)]


def _warnings_naming(name: str, build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if name in str(w.message)]


@pytest.mark.parametrize("key, changed, quiet", INERT_VALUES, ids=[k for k, _, _ in INERT_VALUES])
def test_values_that_change_nothing_warn_once_saying_why(key, changed, quiet):
    from smp import inert

    mine = _warnings_naming(f"'{key}'", lambda: cfg.parse({key: changed}))
    assert mine == [f"smp config: '{key}': {changed!r} has no effect: {inert.CONFIG_VALUES[key][1]}"], mine
    assert not _warnings_naming(f"'{key}'", lambda: cfg.parse({key: quiet}))
    assert not _warnings_naming(f"'{key}'", lambda: cfg.parse({}))


# DistributedModel's arguments that smp accepts and never reads: (a value that changed something in
# SMP v1, SMP's default).
INERT_ARGUMENTS = {
    "trace_device": ("cpu", "gpu"),
    "trace_memory_usage": (True, False),
    "overlapping_allreduce": (False, True),
    "find_unused_parameters": (True, False),
    "gradient_as_bucket_view": (True, False),
}


def _model_warnings(rank, world_size):
    import smp
    from torch import nn

    out = {}
    for name, values in INERT_ARGUMENTS.items():
        for value in values:
            smp.init({})
            kwargs = {name: value}
            out[(name, value)] = _warnings_naming(
                f"{name}=", lambda k=kwargs: smp.DistributedModel(nn.Linear(2, 2), **k)
            )
            smp.parallel_state.reset()
    return out


def test_distributed_model_arguments_that_change_nothing_warn_once_saying_why():
    from harness import run_ranks
    from smp import inert

    (out,) = run_ranks(_model_warnings, 1, timeout=120)
    for name, (changed, default) in INERT_ARGUMENTS.items():
        why = inert.MODEL_ARGUMENTS[name][1]
        assert out[(name, changed)] == [f"smp.DistributedModel: {name}={changed!r} has no effect: {why}"], out
        assert out[(name, default)] == [], (name, out[(name, default)])
