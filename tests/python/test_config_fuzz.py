"""Config fuzz: 10,000 random configs through smp.init in a world of one. Each either initializes
or raises a ValueError whose message names a key it was given: nothing else, ever."""

from __future__ import annotations

import math
import os
import random
import warnings

import pytest
from harness import run_ranks

CONFIGS = int(os.environ.get("FUZZ_N", 10_000))


def _keys():
    from smp import config

    valid = sorted(config._FIELDS)
    return valid, sorted(config.ALIASES), sorted(config.LEGACY_NO_OP_KEYS)


def _typo(rng: random.Random, key: str) -> str:
    i = rng.randrange(len(key))
    return rng.choice([key[:i] + key[i + 1 :], key[:i] + "x" + key[i:], key.upper(), key + "s"])


def _value(rng: random.Random):
    """Every JSON type, in and out of range, NaN, infinities and huge integers."""
    return rng.choice(
        [
            True,
            False,
            None,
            0,
            1,
            2,
            -1,
            rng.randint(-5, 5),
            10**30,
            -(10**30),
            2**63,
            0.5,
            1.0,
            -0.5,
            math.nan,
            math.inf,
            -math.inf,
            1e308,
            "",
            "interleaved",
            "simple",
            "speed",
            "memory",
            "cluster",
            "spread",
            "TDP",
            "DPT",
            "x",
            [],
            [1, 2],
            {},
            {"a": 1},
        ]
    )


def _config(rng: random.Random, valid, aliases, legacy) -> dict:
    config = {}
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.6:
            key = rng.choice(valid)
        elif kind < 0.7:
            key = rng.choice(aliases)
        elif kind < 0.8:
            key = rng.choice(legacy)
        elif kind < 0.95:
            key = _typo(rng, rng.choice(valid))
        else:
            key = rng.choice(["", " ", "0", "ü", "__class__"])
        config[key] = _value(rng)
    return config


def _fuzz(rank, world, n, seed):
    import smp
    from smp import config as config_lib
    from smp import parallel_state

    valid, aliases, legacy = _keys()
    rng = random.Random(seed)
    outcomes = {"ok": 0, "ValueError": 0}
    for i in range(n):
        config = _config(rng, valid, aliases, legacy)
        names = set(config) | {config_lib.ALIASES.get(k, k) for k in config}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                smp.init(config)
        except ValueError as e:
            if not any(f"'{name}'" in str(e) or (name and name in str(e)) for name in names):
                raise AssertionError(f"config {i} {config!r}: the ValueError names no key of it: {e}") from e
            outcomes["ValueError"] += 1
            continue
        except Exception as e:
            raise AssertionError(f"config {i} {config!r}: {type(e).__name__}: {e}") from e
        outcomes["ok"] += 1
        parallel_state.reset(keep_groups=True)  # the next init of this layout reuses its groups
    return outcomes


def test_config_fuzz():
    assert "SMP_CONFIG" not in os.environ and "SM_HP_MP_PARAMETERS" not in os.environ
    (outcomes,) = run_ranks(_fuzz, 1, CONFIGS, 22, timeout=300)
    print(outcomes)
    assert sum(outcomes.values()) == CONFIGS
    assert outcomes["ok"] > 100 and outcomes["ValueError"] > 100  # both paths were exercised


@pytest.mark.parametrize("value", ["{not json", "[1, 2]", "nan"])
def test_environment_config_not_json(monkeypatch, value):
    from smp import config

    monkeypatch.setenv("SM_HP_MP_PARAMETERS", value)
    with pytest.raises(ValueError, match="SM_HP_MP_PARAMETERS") as e:
        config.parse({})
    assert "JSON" in str(e.value)
