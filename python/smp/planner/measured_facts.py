"""Counts measured on a real module: parameters from the module itself, saved activations from
one forward (and loss) of one sample on fake tensors, so nothing is allocated whatever the size.

The layer list is the module's largest nn.ModuleList / nn.Sequential. Every tensor autograd saves
is attributed to the part running when it is saved: the embedding side (before the first layer),
a layer, or the head side (after the last, with the loss). As smp's activation meter does,
a storage counts once and parameters' storages are not activations. Floating-point tensors count
as elements (their size follows the training precision), others (indices, masks) as bytes. Under
tensor parallelism, saved tensors whose last dimension is the hidden size (norm inputs and
outputs, the residual stream) are taken as replicated, the others as sharded; 2-D parameters
(matrices, embeddings) as sharded, vectors (norms, biases) as replicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from smp.planner import measured_experts
from smp.planner.model_facts import Matmul, ModelFacts, Params, Saved

_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "heads")
_KV_KEYS = ("num_key_value_heads", "n_kv_heads", "kv_heads", "num_kv_heads")


def from_module(model: nn.Module | Callable[[], nn.Module], seq_len: int) -> ModelFacts:
    # A factory builds under the fake mode (nothing real is allocated); a real module's
    # parameters are converted to fake tensors as the forward meets them.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    if isinstance(model, nn.Module):
        module = model
    else:
        with mode:
            module = model()
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"smp.plan: the model factory returned {type(module).__name__}, not an nn.Module"
            )
    layers = _layer_list(module)
    embedding = _largest_embedding(module)
    hidden, vocab = embedding.embedding_dim, embedding.num_embeddings
    heads = _attribute(module, _HEAD_KEYS)
    if heads is None:
        raise ValueError(
            "smp.plan: cannot find the model's attention head count (a config or module attribute named "
            f"{', '.join(_HEAD_KEYS)}); pass its Hugging Face config instead"
        )
    kv_heads = _attribute(module, _KV_KEYS) or heads
    moe = measured_experts.find(module, layers, hidden, _attribute(module, measured_experts.TOP_K_KEYS))
    run = _Recorder(module, layers, hidden, mode)
    with measured_experts.traceable(layers):
        run.forward(seq_len, vocab)
    n = len(layers)
    own = [p for layer in layers for p in layer.parameters() if moe is None or id(p) not in moe.params]
    layer_params = _params(own, n, replicated=moe.routers if moe else frozenset())
    # A token goes through every matrix of a layer but only top_k of its experts' (FLOPs exact);
    # the layer's own matrices are taken as one [hidden, n] matrix of the same size (its shape,
    # for the step time's tile waves, approximate).
    active = layer_params.total + (moe.moe_layers / n * moe.top_k * moe.expert.total if moe else 0)
    matmuls = (Matmul(hidden, max(1, layer_params.sharded // hidden), "n"), *(moe.matmuls if moe else ()))
    return ModelFacts(
        source=f"measured on {type(module).__name__} (a fake-tensor forward: smp/planner/measured_facts.py)",
        seq_len=seq_len,
        hidden=hidden,
        layers=n,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        before=_params(run.params["before"], 1),
        layer=layer_params,
        after=_params([p for p in run.params["after"] if not _holds(run.params["before"], p)], 1),
        tied=_params([p for p in run.params["after"] if _holds(run.params["before"], p)], 1),
        saved_before=run.saved["before"],
        saved_layer=run.saved["layer"] * (1 / n),
        saved_after=run.saved["after"],
        saved_layer_input=run.layer_input * (1 / n),
        logits_elements=seq_len * vocab,
        layer_flops_per_token=2 * active + 4 * seq_len * hidden,
        head_flops_per_token=2 * vocab * hidden,
        matmuls=matmuls,
        head_dim=hidden // heads,
        eager_attention=run.scores_saved,
        # (not told apart on a module: a written-out attention is assumed to gather, as it may)
        attention_dropout=run.scores_saved,
        layer_ops=run.layer_ops // n,
        layer_traffic=run.layer_traffic / n,
        layer_transcendental=run.transcendental["layer"][0] / n,
        layer_transcendental_backward=run.transcendental["layer"][1] / n,
        head_transcendental=sum(run.transcendental["after"]),
        experts=moe.experts if moe else 0,
        top_k=moe.top_k if moe else 0,
        moe_layers=moe.moe_layers if moe else 0,
        expert=moe.expert if moe else Params(),
    )


def _holds(params: list[nn.Parameter], p: nn.Parameter) -> bool:
    return any(q is p for q in params)


def _params(params: list[nn.Parameter], per: int, replicated: frozenset[int] = frozenset()) -> Params:
    unique = list({id(p): p for p in params}.values())
    total = sum(p.numel() for p in unique)
    sharded = sum(p.numel() for p in unique if p.dim() >= 2 and id(p) not in replicated)
    return Params(total // per, sharded // per)


def _layer_list(module: nn.Module) -> nn.Module:
    lists = [m for m in module.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    if not lists:
        raise ValueError(
            f"smp.plan: {type(module).__name__} has no nn.ModuleList / nn.Sequential of layers to plan over; "
            "pass its Hugging Face config instead"
        )
    return max(lists, key=lambda m: (len(m), sum(p.numel() for p in m.parameters())))


def _largest_embedding(module: nn.Module) -> nn.Embedding:
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError(
            f"smp.plan: {type(module).__name__} has no nn.Embedding; the planner plans token models"
        )
    return max(embeddings, key=lambda e: e.num_embeddings)


def _attribute(module: nn.Module, keys: tuple[str, ...]) -> int | None:
    config = getattr(module, "config", None)
    for source in [config, *module.modules()]:
        for key in keys:
            value = getattr(source, key, None) if source is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


class _Recorder:
    """One forward with saved-tensor hooks, attributing each saved storage to the part running."""

    def __init__(self, module: nn.Module, layers: nn.Module, hidden: int, mode: FakeTensorMode):
        self.module, self.layers, self.hidden, self.mode = module, layers, hidden, mode
        self.part = "before"
        self.saved = {"before": Saved(), "layer": Saved(), "after": Saved()}
        self.layer_input = Saved()
        self.scores_saved = False  # a layer saved a [.., seq, seq] tensor: eager attention
        self.layer_ops = 0  # ATen operations the layers dispatched
        self.layer_traffic = 0  # bytes their elementwise operations read and wrote
        # Per part, [forward, backward] elements of transcendental operations (_TRANSCENDENTAL).
        self.transcendental = {"before": [0, 0], "layer": [0, 0], "after": [0, 0]}
        self.seq_len = 0
        self.params: dict[str, list[nn.Parameter]] = {"before": [], "after": []}
        self._seen: set[int] = set()
        # The fake tensors the forward will meet for the parameters (the mode memoizes them).
        self._param_storages = {_key(p if is_fake(p) else mode.from_tensor(p)) for p in module.parameters()}
        self._layer_modules = {id(m) for m in layers.modules()}

    def forward(self, seq_len: int, vocab: int) -> None:
        self.seq_len = seq_len
        handles = []
        for layer in self.layers:
            handles.append(layer.register_forward_pre_hook(self._enter_layer))
            handles.append(layer.register_forward_hook(self._leave_layer))
        for m in self.module.modules():
            if id(m) not in self._layer_modules and next(m.parameters(recurse=False), None) is not None:
                handles.append(m.register_forward_pre_hook(self._module_called))
        try:
            with self.mode, _training(self.module):
                ids = self.mode.from_tensor(torch.zeros(1, seq_len, dtype=torch.long))
                with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x), _OpCounter(self):
                    self._loss(ids, vocab)
        finally:
            for h in handles:
                h.remove()

    def _loss(self, ids: torch.Tensor, vocab: int) -> None:
        out = _call(self.module, ids)
        loss = getattr(out, "loss", None)
        if loss is None:  # the head side ends with the loss a script computes on the logits
            logits = out if isinstance(out, torch.Tensor) else out[0]
            F.cross_entropy(logits.reshape(-1, vocab).float(), ids.reshape(-1))

    def _enter_layer(self, module, args):
        self.part = "layer"
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None:
            self.layer_input = self.layer_input + _classify(first, self.hidden, replicated=True)

    def _leave_layer(self, module, args, output):
        self.part = "after"

    def _module_called(self, module, args):
        if self.part != "layer":
            self.params[self.part].extend(module.parameters(recurse=False))

    def _pack(self, tensor: torch.Tensor):
        key = _key(tensor)
        if key not in self._param_storages and key not in self._seen:
            self._seen.add(key)
            self.saved[self.part] = self.saved[self.part] + _classify(tensor, self.hidden)
            square = tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2] == self.seq_len
            self.scores_saved |= self.part == "layer" and square
        return tensor


# Operations whose time the step-time model counts as matmuls (stage_work.py), not memory traffic.
_MATMULS = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "matmul",
    "linear",
    "scaled_dot_product_attention",
    "_grouped_mm",  # the experts' (transformers' "grouped_mm")
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}


# Transcendental operations: elements per output element their forward and their backward compute
# (exp/log/erf/sigmoid): log_softmax's backward takes exp of its output, gelu's and silu's their
# derivative's; tanh's, sigmoid's, exp's and softmax's backward use the saved output only.
_TRANSCENDENTAL = {
    "exp": (1, 0),
    "tanh": (1, 0),
    "sigmoid": (1, 0),
    "log": (1, 0),
    "erf": (1, 1),
    "_softmax": (1, 0),
    "_log_softmax": (1, 1),
    "gelu": (1, 1),
    "silu": (1, 1),
}


class _OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while a layer runs, the bytes those that are
    neither views nor matmuls read and write, and each part's transcendental elements (above the
    fake mode: each call goes on to it)."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        costs = _TRANSCENDENTAL.get(func.overloadpacket.__name__.rstrip("_"))
        if costs is not None and isinstance(out, torch.Tensor):
            counts = self.recorder.transcendental[self.recorder.part]
            counts[0] += costs[0] * out.numel()
            counts[1] += costs[1] * out.numel()
        if self.recorder.part == "layer" and func.namespace == "aten":  # not prim's device queries
            self.recorder.layer_ops += 1
            if not func.is_view and func.overloadpacket.__name__ not in _MATMULS:
                tensors = [*_tensors(args), *_tensors((kwargs or {}).values()), *_tensors([out])]
                self.recorder.layer_traffic += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _tensors(values) -> list[torch.Tensor]:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += _tensors(v)
    return found


def _key(tensor: torch.Tensor) -> int:
    # The storage's identity: meta and fake storages have no data pointer.
    return tensor.untyped_storage()._cdata


def _classify(tensor: torch.Tensor, hidden: int, replicated: bool = False) -> Saved:
    nbytes = tensor.untyped_storage().nbytes()
    whole = replicated or (tensor.dim() > 0 and tensor.shape[-1] == hidden)
    if tensor.is_floating_point():
        elements = nbytes / tensor.element_size()
        return Saved(replicated_elements=elements) if whole else Saved(sharded_elements=elements)
    return Saved(replicated_bytes=nbytes) if whole else Saved(sharded_bytes=nbytes)


def _call(module: nn.Module, ids: torch.Tensor):
    try:
        return module(ids, labels=ids)  # Hugging Face models compute their loss inside
    except TypeError:
        return module(ids)


@contextlib.contextmanager
def _training(module: nn.Module):
    was = module.training
    module.train()
    try:
        yield
    finally:
        module.train(was)
