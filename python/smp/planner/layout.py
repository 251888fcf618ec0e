"""One candidate configuration: the parallel degrees and memory knobs the planner varies, read
from (and written back as) an smp config dict plus "activation_checkpointing"."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import warnings
from collections.abc import Mapping
from typing import Any

from smp import config as smp_config
from smp import schedules
from smp.recompute.requests import group_size

CHECKPOINTING_KEY = "activation_checkpointing"
RDP_KEY = "reduced_data_parallel_degree"  # optional: checked against gpus / (pp * tp * cp)
SDP_KEY = "sharded_data_parallel_degree"
CP_KEY, CP_COMM_KEY = "context_parallel_degree", "cp_comm_type"
CP_COMMS = ("p2p", "all_gather", "a2a")
EP_KEY = "expert_parallel_degree"


@dataclasses.dataclass(frozen=True)
class Layout:
    pp: int = 1
    tp: int = 1
    rdp: int = 1
    sdp: int = 1  # sharded data parallelism: replicas a parameter is sharded over (divides rdp)
    shard_optimizer_state: bool = False
    checkpointing: str = "none"  # none, each, group_N (of the layer list)
    prescaled_batch: bool = False
    microbatches: int = 1
    active_microbatches: int | None = None  # None: smp's default (Config.num_active_microbatches)
    pipeline: str = "interleaved"
    fp16: bool = False
    bf16: bool = False
    offload_activations: bool = False
    activation_loading_horizon: int = 4
    shard_gradients: bool | None = None  # the config key; see gradient_sharding
    cp: int = 1  # context parallelism: ranks cutting every sequence (they share one batch)
    cp_comm: str = "p2p"  # "p2p" (ring attention), "all_gather" or "a2a" (Ulysses)
    ep: int = 1  # expert parallelism: data replicas dividing every MoE layer's experts (divides rdp)

    @property
    def world(self) -> int:
        """GPUs of the layout: pp x tp x cp x rdp."""
        return self.pp * self.tp * self.cp * self.rdp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same parameters: the data replicas with their cp ranks. Gradients
        are averaged over them, and a sharded optimizer state (sdp: each block's sdp x cp ranks)
        is sharded over them."""
        return self.rdp * self.cp

    @property
    def gradient_sharding(self) -> bool | None:
        """Whether smp keeps only each rank's chunk of the gradients (ZeRO-2): False never, True
        (asked for, with sharded state and replicas), None where it saves enough memory (one
        microbatch: smp decides by the gradients' size, memory.py as GradSync.can_shard)."""
        if not self.shard_optimizer_state or self.dp_cp == 1 or self.shard_gradients is False:
            return False
        if self.shard_gradients:
            return True
        return None if self.microbatches == 1 else False

    @property
    def active(self) -> int:
        """The microbatches in flight: smp's own default where the layout leaves it open."""
        config = smp_config.Config(
            pipeline_parallel_degree=self.pp,
            microbatches=self.microbatches,
            active_microbatches=self.active_microbatches,
        )
        return config.num_active_microbatches

    @property
    def half(self) -> bool:
        return self.fp16 or self.bf16

    @property
    def checkpoint_group(self) -> int:
        """Layers per recomputed region (0: no checkpointing)."""
        if self.checkpointing == "none":
            return 0
        return group_size(self.checkpointing) or 1

    def replace(self, **changes: Any) -> Layout:
        return dataclasses.replace(self, **changes)

    def smp_config(self) -> dict[str, Any]:
        """The config for smp.init, plus "activation_checkpointing" (apply it with
        smp.set_activation_checkpointing on the model's layer list)."""
        config: dict[str, Any] = {
            "pipeline_parallel_degree": self.pp,
            "tensor_parallel_degree": self.tp,
            CP_KEY: self.cp,
            CP_COMM_KEY: self.cp_comm,
            EP_KEY: self.ep,
            "microbatches": self.microbatches,
            "active_microbatches": self.active,
            "pipeline": self.pipeline,
            "prescaled_batch": self.prescaled_batch,
            "shard_optimizer_state": self.shard_optimizer_state,
            SDP_KEY: self.sdp,
            "ddp": True,
            "fp16": self.fp16,
            "bf16": self.bf16,
        }
        if self.shard_gradients is not None:
            config["shard_gradients"] = self.shard_gradients
        if self.offload_activations:
            config["offload_activations"] = True
            config["activation_loading_horizon"] = self.activation_loading_horizon
        config[CHECKPOINTING_KEY] = self.checkpointing
        return config

    def describe(self) -> str:
        parts = [f"pp={self.pp}", f"tp={self.tp}", f"rdp={self.rdp}"]
        if self.cp > 1:
            parts.insert(2, f"cp={self.cp} {self.cp_comm}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.sdp > 1:
            parts.append(f"sdp={self.sdp}")
        if self.shard_optimizer_state:
            parts.append("sharded optimizer")
        if self.checkpointing != "none":
            parts.append(f"checkpoint {self.checkpointing}")
        if self.prescaled_batch:
            parts.append("prescaled")
        if self.pp > 1:
            parts.append(f"m={self.microbatches} active={self.active}")
        if self.offload_activations:
            parts.append("offload")
        return ", ".join(parts)


def from_config(config: Mapping[str, Any], gpus: int) -> Layout:
    """A Layout from an smp config dict (plus "activation_checkpointing" and, optionally,
    "reduced_data_parallel_degree"); every mistake is a ValueError naming the value and the fix."""
    if not isinstance(config, Mapping):
        raise ValueError(f"smp.plan: --layout must be a JSON object (an smp config), got {config!r}")
    config = dict(config)
    checkpointing = config.pop(CHECKPOINTING_KEY, "none")
    rdp_given = config.pop(RDP_KEY, None)
    # Checked here rather than by smp.config.parse: whether smp.init accepts a degree depends on
    # the engine's state, while the planner models any degree that divides rdp.
    sdp = _positive_sdp(config.pop(SDP_KEY, 1))
    for key in config:
        name = smp_config.ALIASES.get(key, key)
        if name not in smp_config.Config.__dataclass_fields__ and name not in smp_config.LEGACY_NO_OP_KEYS:
            raise ValueError(_unknown_key(key))
    parsed = _parse_smp_keys(config)
    pp, tp = parsed.pipeline_parallel_degree, parsed.tensor_parallel_degree
    cp = parsed.context_parallel_degree
    degrees = f"pipeline_parallel_degree ({pp}) x tensor_parallel_degree ({tp})"
    if cp > 1:
        degrees += f" x {CP_KEY} ({cp})"
    if gpus % (pp * tp * cp):
        raise ValueError(
            f"smp.plan: {degrees} = {pp * tp * cp} does not "
            f"divide the {gpus} GPUs; choose degrees whose product divides {gpus}"
        )
    rdp = gpus // (pp * tp * cp)
    if rdp_given is not None and rdp_given != rdp:
        raise ValueError(
            f"smp.plan: pp ({pp}) x tp ({tp}) x cp ({cp}) x {RDP_KEY} ({rdp_given}) = "
            f"{pp * tp * cp * rdp_given} is not the {gpus} GPUs; set {RDP_KEY} to {rdp} or leave it out"
        )
    if parsed.cp_comm_type not in CP_COMMS:
        raise ValueError(
            f"smp.plan: {CP_COMM_KEY} {parsed.cp_comm_type!r} is not one of {', '.join(CP_COMMS)}"
        )
    _check_checkpointing(checkpointing)
    layout = Layout(
        pp=pp,
        tp=tp,
        rdp=rdp,
        sdp=sdp,
        shard_optimizer_state=parsed.shard_optimizer_state,
        checkpointing=checkpointing,
        prescaled_batch=parsed.prescaled_batch,
        microbatches=parsed.microbatches,
        active_microbatches=parsed.num_active_microbatches,
        pipeline=parsed.pipeline,
        fp16=parsed.fp16,
        bf16=parsed.bf16,
        offload_activations=parsed.offload_activations,
        activation_loading_horizon=parsed.activation_loading_horizon,
        shard_gradients=parsed.shard_gradients,
        cp=cp,
        cp_comm=parsed.cp_comm_type,
        ep=parsed.expert_parallel_degree,
    )
    problem = sdp_problem(layout) or ep_problem(layout)
    if problem:
        raise ValueError(f"smp.plan: {problem}")
    return layout


def sdp_problem(layout: Layout) -> str:
    """Why `layout`'s sharded data parallel degree cannot run ("" where it can), with the fix."""
    n = layout.sdp
    if n == 1:
        return ""
    if layout.rdp % n:
        return (
            f"{SDP_KEY} {n} does not divide the reduced data parallel degree {layout.rdp} "
            f"(GPUs / (pp x tp{' x cp' if layout.cp > 1 else ''})); choose one of {_divisors(layout.rdp)}"
        )
    if layout.shard_optimizer_state:
        return (
            f"{SDP_KEY} {n} already shards the optimizer state (with the parameters and gradients); "
            "set shard_optimizer_state to false, or sharded_data_parallel_degree to 1"
        )
    if layout.fp16:
        return (
            f"{SDP_KEY} {n}: the planner does not model fp16 under sharded data parallelism (smp runs "
            'it, with fp32 shards and loss scaling, as bf16\'s memory); plan it with "bf16": true, '
            "or set sharded_data_parallel_degree to 1"
        )
    if layout.pp > 1 and schedules.Schedule(layout.pipeline, layout.pp, 1, 1).splits_backward:
        return (
            f"{SDP_KEY} {n} with pipeline '{layout.pipeline}': its weight gradients come after FSDP2 "
            "reduce-scatters them; use pipeline 'interleaved' or 'simple'"
        )
    return ""


def _divisors(n: int) -> list[int]:
    """The degrees that divide n (the choices an error names)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def ep_problem(layout: Layout, experts: int | None = None) -> str:
    """Why `layout`'s expert parallel degree cannot run ("" where it can), with the fix: ep blocks
    of data replicas divide every MoE layer's `experts` (None: not checked) among them. smp.init
    refuses ep with cp, and with sdp over pipeline stages or tp (smp.config says so for an
    explicit layout)."""
    e = layout.ep
    if e == 1:
        return ""
    captured = [
        f"{k}={v}"
        for k, v in (("pipeline_parallel_degree", layout.pp), ("tensor_parallel_degree", layout.tp))
        if v > 1
    ]
    if layout.sdp > 1 and captured:
        return (
            f"{EP_KEY} {e} runs with data, pipeline and tensor parallelism, not with "
            f"sharded_data_parallel_degree={layout.sdp} together with {' and '.join(captured)}; "
            f"drop sdp, or {' and '.join(captured)}, or set {EP_KEY} to 1"
        )
    if layout.rdp % e:
        return (
            f"{EP_KEY} {e} does not divide the reduced data parallel degree {layout.rdp}; choose one of "
            f"{_divisors(layout.rdp)}"
        )
    if experts == 0:
        return f"{EP_KEY} {e}: the model has no experts (not a mixture of experts); set it to 1"
    if experts and experts % e:
        divisors = [d for d in _divisors(experts) if layout.rdp % d == 0]
        return (
            f"{EP_KEY} {e} does not divide the model's {experts} experts per layer; choose one of {divisors}"
        )
    return ""


def cp_problem(layout: Layout, seq_len: int, heads: int) -> str:
    """Why `layout`'s context parallelism cannot run on this sequence and model ("" where it can),
    with the fix: the sequence is cut into 2 x cp chunks, and "a2a" spreads the heads (after tensor
    parallelism) over the cp ranks."""
    c = layout.cp
    if c == 1:
        return ""
    if seq_len % (2 * c):
        return (
            f"{CP_KEY} {c}: the sequence of {seq_len} tokens does not cut into 2 x {c} chunks; pad it "
            f"to {-(-seq_len // (2 * c)) * 2 * c} or choose a degree whose double divides {seq_len}"
        )
    if layout.cp_comm == "a2a" and (heads // layout.tp) % c:
        return (
            f"{CP_KEY} {c} with {CP_COMM_KEY} 'a2a': the {heads // layout.tp} attention heads per tensor-"
            f"parallel rank do not divide by {c}; use 'p2p' or a degree dividing them"
        )
    return ""


def _positive_sdp(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"smp.plan: {SDP_KEY} must be a positive integer, got {value!r}")
    return value


def _parse_smp_keys(config: dict[str, Any]) -> smp_config.Config:
    # smp.config.parse checks every value as smp.init would. It also merges this process's
    # SMP_CONFIG / SM_HP_MP_PARAMETERS, which describe some job, not the layout asked about:
    # they are hidden while it runs.
    with _without_env(smp_config.ENV_VARS), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # legacy keys and odd TP degrees: the walk says why itself
        try:
            return smp_config.parse(config)
        except ValueError as e:
            raise ValueError(f"smp.plan: --layout: {e}") from e


@contextlib.contextmanager
def _without_env(names: tuple[str, ...]):
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _check_checkpointing(value: Any) -> None:
    if value == "none":
        return
    if value == "contiguous":
        raise ValueError(
            "smp.plan: activation_checkpointing 'contiguous' depends on the stage's partition, which the "
            "planner does not model; use 'none', 'each' or 'group_N'"
        )
    try:
        group_size(value)
    except ValueError as e:
        raise ValueError(
            f"smp.plan: activation_checkpointing {value!r} is not 'none', 'each' or 'group_N' (N layers per "
            f"recomputed region, e.g. 'group_2') ({e})"
        ) from e


def _unknown_key(key: str) -> str:
    known = sorted({*smp_config.Config.__dataclass_fields__, CHECKPOINTING_KEY, RDP_KEY, SDP_KEY})
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    fix = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(known)}"
    return f"smp.plan: --layout has an unknown key '{key}'; {fix}"
