"""`smp.model_creation(...)`: the context SMP v1's scripts build their model in, and
`smp.tensor_parallelism(...)`.

    with smp.model_creation(tensor_parallelism=True, dtype=torch.bfloat16, ...):
        model = AutoModelForCausalLM.from_config(config)

- tensor_parallelism: modules built inside may be sharded, as under `smp.tensor_parallelism()`;
  and the Hugging Face models SMP v1 supported out of the box are replaced by smp.nn's
  distributed transformer, as SMP v1 did (smp.nn.huggingface.defaults), unless
  `distributed_transformer=False` (then smp's graph pass shards the model's own modules).
- dtype: floating-point tensors created inside get this dtype.
- With the config's `delayed_parameter_initialization`, parameters are created on the meta device
  (as `smp.delay_param_initialization()`).
- SMP v1's other keywords (OPTIONS below) each do what they did, or warn once why they change
  nothing here.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from smp import parallel_state
from smp.engine.delayed_init import delay_param_initialization
from smp.nn.huggingface import defaults
from smp.tensor_parallel import marks

# SMP v1 keyword -> a function of its value giving the smp.nn keywords it sets (None: nothing).
_AS_SMP_NN: dict[str, Callable[[Any], dict[str, Any] | None]] = {
    # Scores, masks and softmax in float32: SMP's attention_in_fp32. Megatron's
    # query_key_layer_scaling guards the same fp16 scores from overflow by dividing them by the
    # layer's number before the softmax; float32 scores give that protection and the same result.
    "attention_in_fp32": lambda on: {"attention_scores_in_fp32": True} if on else None,
    "query_key_layer_scaling": lambda on: {"attention_scores_in_fp32": True} if on else None,
    "fp32_residual_addition": lambda on: {"fp32_residual_addition": True} if on else None,
}

# SMP v1 keyword -> (whether its value would change something in SMP v1, why it does not here).
_NO_EFFECT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "zero_init": (
        bool,
        "SMP v1 partitioned the parameters as they were created (DeepSpeed's zero.Init); smp's sharded "
        "data parallelism shards them when smp.DistributedModel wraps the model. To allocate no "
        "whole parameter before that, set 'delayed_parameter_initialization' in smp.init's config",
    ),
    "distribute_embedding": (
        lambda on: not on and parallel_state.tp_size() > 1,
        "smp always cuts the word embedding over the tensor-parallel group (vocabulary-parallel, tied "
        "to the head), so it cannot be kept whole",
    ),
    "fused_softmax": (
        bool,
        "smp.nn's attention masks and softmaxes in torch's kernels; fusing them needs 'compile': true",
    ),
    "fused_dropout": (
        bool,
        "smp.nn's dropout runs as torch's kernel; fusing it needs 'compile': true",
    ),
    "fused_bias_gelu": (
        bool,
        "smp.nn's bias addition and GELU run as torch's kernels; fusing them needs 'compile': true",
    ),
    "flash_attention": (
        bool,
        "smp.nn's attention computes q·kᵀ, the softmax and ·v as separate kernels (the same values)",
    ),
}

_REFUSED: dict[str, tuple[Any, str]] = {
    "use_alibi": (
        True,
        "smp.nn's distributed transformer has no ALiBi position bias; train the model with its own "
        "position embeddings (use_alibi=False)",
    ),
}

_warned: set[str] = set()


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, distributed_transformer: bool = False, **kwargs):
    """Modules constructed inside the block are (enabled=True) or are not distributed.

    A class registered with `smp.tp_register` that is built inside is replaced by its
    distributed module, and `kwargs` that the distributed module's __init__ takes override the
    init_hook's (SMP v1's rule); other keywords have no effect: smp's graph pass shards the
    model's own layers. With `distributed_transformer`, the Hugging Face models SMP v1 supported
    out of the box are replaced by smp.nn's distributed transformer too (smp.nn.huggingface.
    defaults; the default of `smp.model_creation(tensor_parallelism=True)`).
    """
    if enabled and distributed_transformer:
        defaults.enable()
    with marks.tensor_parallelism(enabled, distributed_transformer, **kwargs):
        yield


@contextlib.contextmanager
def model_creation(
    tensor_parallelism: bool = False,
    dtype: torch.dtype | None = None,
    distributed_transformer: bool = True,
    **tp_config,
):
    """Build the model inside this block (SMP v1's `smp.model_creation`; see the module doc)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"smp.model_creation: dtype must be a floating-point torch.dtype, got {dtype!r}")
    overrides = _smp_nn_keywords(tp_config)
    delayed = parallel_state.state().config.delayed_parameter_initialization
    previous = torch.get_default_dtype()
    sharding = (
        _tensor_parallelism(distributed_transformer, overrides)
        if tensor_parallelism
        else contextlib.nullcontext()
    )
    with sharding, delay_param_initialization(delayed):
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def _tensor_parallelism(distributed_transformer: bool, overrides: dict[str, Any]):
    return tensor_parallelism(distributed_transformer=distributed_transformer, **overrides)


def _smp_nn_keywords(tp_config: dict[str, Any]) -> dict[str, Any]:
    """SMP v1's keywords -> the smp.nn keywords they set (the rest pass through as overrides of the
    distributed modules' arguments, SMP's rule); warns once for those that change nothing."""
    out: dict[str, Any] = {}
    for key, value in tp_config.items():
        if key in _REFUSED and bool(value) == _REFUSED[key][0]:
            raise ValueError(f"smp.model_creation: {key}={value!r} is not supported: {_REFUSED[key][1]}")
        if key in _AS_SMP_NN:
            out.update(_AS_SMP_NN[key](value) or {})
        elif key in _NO_EFFECT:
            if _NO_EFFECT[key][0](value) and key not in _warned:
                _warned.add(key)
                warnings.warn(
                    f"smp.model_creation: {key}={value!r} changes nothing in smp: {_NO_EFFECT[key][1]}",
                    stacklevel=4,
                )
        elif key not in _REFUSED:
            out[key] = value
    return out
