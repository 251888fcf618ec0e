"""SMP v1's `smp.tp_register` / `smp.tp_register_with_module`: a model's own module class mapped
onto a distributed module (an smp.nn class) that computes the same function.

Registering installs a `__new__` on the class: built inside `smp.tensor_parallelism()` (or
`smp.model_creation(tensor_parallelism=True)`), the class returns the distributed module instead
(Python then skips the class's own `__init__`), made from `init_hook(*args, **kwargs)`; outside
the context, or with `enabled=False`, the class builds itself as before. Only the outermost
registered module is replaced: classes built while a distributed module is being built stay as
they are. `forward_hook` maps the original call's arguments to the distributed module's,
`return_hook` its result back, both inside the forward of a subclass of the distributed module
(same name) made once per registration. The context's keyword
arguments override the init_hook's where the distributed module's `__init__` takes them.

Default registrations (`register_default`: SMP v1's out-of-the-box Hugging Face models,
smp.nn.huggingface.defaults) replace their class only in a context opened with
`defaults=True` (smp.model_creation's); a user's registration of the class takes their place. A
default whose init_hook refuses the configuration (a ValueError) leaves the class as it is, with a
warning naming why, as SMP v1 left modules it could not distribute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

_state = threading.local()


@dataclasses.dataclass(frozen=True)
class Registration:
    module_cls: type
    dist_module: type
    init_hook: Callable | None
    forward_hook: Callable | None
    return_hook: Callable | None
    after_build: Callable[[nn.Module], None] | None = None  # (defaults: SMP's attribute paths)


_registry: dict[type, Registration] = {}
# Each class _new was installed on -> its own __new__ before that (None: it had none of its own).
_own_new: dict[type, Callable | None] = {}
_defaults: dict[type, Registration] = {}
_built_by_default: set[type] = set()  # default registrations that replaced their class here


def _contexts() -> list[tuple[bool, dict[str, Any]]]:
    if not hasattr(_state, "contexts"):
        _state.contexts = []
    return _state.contexts


@contextlib.contextmanager
def distributing(enabled: bool, overrides: dict[str, Any], defaults: bool = False):
    """Registered classes built inside are (enabled) or are not replaced, default registrations
    too with `defaults`; the innermost block wins."""
    _contexts().append((bool(enabled), dict(overrides), bool(defaults)))
    try:
        yield
    finally:
        _contexts().pop()


def _active() -> tuple[bool, dict[str, Any], bool]:
    contexts = _contexts()
    return contexts[-1] if contexts else (False, {}, False)


def registered(module_cls: type) -> Registration | None:
    """The class's registration: the user's, or a default one that has replaced the class here."""
    found = _registry.get(module_cls)
    if found is None and module_cls in _built_by_default:
        found = _defaults[module_cls]
    return found


def register_default(module_cls, dist_module, hooks: tuple, after_build=None) -> None:
    """A registration that applies only in contexts opened with defaults=True, and that a user's
    registration of the class replaces (see the module doc). Registering twice is a no-op, and so
    is registering a class of a model the user registered a class of (see _drop_defaults)."""
    if module_cls in _defaults or any(c.__module__ == module_cls.__module__ for c in _registry):
        return
    init_hook, forward_hook, return_hook = hooks
    _defaults[module_cls] = Registration(
        module_cls, dist_module, init_hook, forward_hook, return_hook, after_build
    )
    _install_new(module_cls)


def tp_register(dist_module, init_hook=None, forward_hook=None, return_hook=None):
    """Class decorator: `@smp.tp_register(smp.nn.DistributedTransformer, init_hook=...)`."""

    def decorate(module_cls):
        tp_register_with_module(module_cls, dist_module, init_hook, forward_hook, return_hook)
        return module_cls

    return decorate


def tp_register_with_module(module_cls, dist_module, init_hook=None, forward_hook=None, return_hook=None):
    """Registers `dist_module` as the distributed version of the existing class `module_cls`."""
    for role, cls in (("module_cls", module_cls), ("dist_module", dist_module)):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"smp.tp_register: {role} must be an nn.Module subclass, got {cls!r}")
    _drop_defaults(module_cls)
    if module_cls in _registry:
        raise ValueError(
            f"smp.tp_register: {module_cls.__qualname__} is already registered to "
            f"{_registry[module_cls].dist_module.__qualname__}; register each class once "
            f"(a second registration, here to {dist_module.__qualname__}, would silently replace the first)"
        )
    _check_hook("init_hook", init_hook, module_cls, "__init__")
    _check_hook("forward_hook", forward_hook, module_cls, "forward")
    if return_hook is not None:
        if not callable(return_hook):
            raise TypeError(f"smp.tp_register: return_hook must be callable, got {return_hook!r}")
        try:
            inspect.signature(return_hook).bind(None)
        except TypeError:
            raise ValueError(
                f"smp.tp_register: return_hook {_describe(return_hook)} must take one argument, the "
                f"distributed module's output, and return what {module_cls.__qualname__}.forward returns"
            ) from None
    _adapters.pop(module_cls, None)
    _registry[module_cls] = Registration(module_cls, dist_module, init_hook, forward_hook, return_hook)
    _install_new(module_cls)


def _drop_defaults(module_cls: type) -> None:
    """A user's registration of a class ends the default registrations of its model (the classes of
    its module: registering GPT2Block keeps GPT2LMHeadModel from being replaced whole)."""
    for cls in [c for c in _defaults if c.__module__ == module_cls.__module__]:
        del _defaults[cls]  # (its __new__ stays _new, which now builds it as it is)
        _built_by_default.discard(cls)


def _describe(fn) -> str:
    try:
        return f"{getattr(fn, '__qualname__', fn)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def _shape(sig: inspect.Signature, drop_self: bool) -> list[tuple[str, Any]]:
    params = list(sig.parameters.values())[1 if drop_self else 0 :]
    out = []
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            out.append(("*", p.kind))
        elif p.kind is p.VAR_KEYWORD:
            out.append(("**", p.kind))
        else:
            out.append((p.name, p.kind if p.kind is p.KEYWORD_ONLY else p.POSITIONAL_OR_KEYWORD))
    return out


def _check_hook(role: str, hook, module_cls: type, method: str) -> None:
    """SMP's rule: a hook takes exactly the original method's arguments (without self); a hook of
    (*args, **kwargs) takes anything."""
    if hook is None:
        return
    if not callable(hook):
        raise TypeError(f"smp.tp_register: {role} must be callable or None, got {hook!r}")
    hook_shape = _shape(inspect.signature(hook), drop_self=False)
    if [name for name, _ in hook_shape] == ["*", "**"]:
        return
    original = getattr(module_cls, method)
    wanted = _shape(inspect.signature(original), drop_self=True)
    if hook_shape != wanted:
        raise ValueError(
            f"smp.tp_register: {role} {_describe(hook)} does not match "
            f"{module_cls.__qualname__}.{method}{inspect.signature(original)}: the hook must take exactly "
            f"the arguments of {method} without self, in the same order (or *args, **kwargs), and return "
            "(args, kwargs) for the distributed module"
        )


def _new(cls, *args, **kwargs):
    enabled, overrides, defaults = _active()
    registration = _registry.get(cls)
    by_default = registration is None and defaults and cls in _defaults
    if by_default:
        registration = _defaults[cls]
    if registration is None or not enabled:
        # Not registered itself (a subclass of a registered class), or outside the context.
        return _build_original(cls, args, kwargs)
    if not by_default:
        return _build(registration, args, kwargs, overrides)
    try:
        module = _build(registration, args, kwargs, overrides)
    except ValueError as refused:  # a configuration smp.nn's module does not express
        warnings.warn(
            f"smp: {cls.__qualname__} is kept as it is, not replaced by smp.nn."
            f"{registration.dist_module.__name__} (SMP v1's distributed transformer): {refused}. Its "
            "layers are sharded by smp's graph tensor parallelism instead",
            stacklevel=3,
        )
        return _build_original(cls, args, kwargs)
    _built_by_default.add(cls)
    if registration.after_build is not None:
        registration.after_build(module)
    return module


def _build_original(cls, args: tuple, kwargs: dict):
    original = _original_new(cls)
    return original(cls) if original is object.__new__ else original(cls, *args, **kwargs)


def _install_new(cls: type) -> None:
    """Routes the class's construction through _new (once; its own __new__ kept for building it)."""
    if cls not in _own_new:
        _own_new[cls] = cls.__dict__.get("__new__")
        cls.__new__ = _new


def _original_new(cls):
    """The __new__ the class would have without smp: the first own one up its MRO."""
    for klass in cls.__mro__:
        own = _own_new[klass] if klass in _own_new else klass.__dict__.get("__new__")
        if own is not None:
            return own.__func__ if isinstance(own, staticmethod) else own
    return object.__new__


def _split(role: str, registration: Registration, result) -> tuple[tuple, dict]:
    ok = isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)
    if not ok:
        raise TypeError(
            f"smp.tp_register: the {role} registered for {registration.module_cls.__qualname__} returned "
            f"{type(result).__name__}, not an (args, kwargs) tuple with a dict of keyword arguments"
        )
    return tuple(result[0]), result[1]


def _build(registration: Registration, args: tuple, kwargs: dict, overrides: dict) -> nn.Module:
    if registration.init_hook is not None:
        args, kwargs = _split("init_hook", registration, registration.init_hook(*args, **kwargs))
    accepted = inspect.signature(registration.dist_module.__init__).parameters
    kwargs = {**kwargs, **{k: v for k, v in overrides.items() if k in accepted}}
    with distributing(False, {}):  # only the outermost registered module is replaced
        module = _adapted(registration)(*args, **kwargs)
    module.smp_replaces = registration.module_cls.__qualname__  # what was built in its place
    return module


_adapters: dict[type, type] = {}


def _adapted(registration: Registration) -> type:
    """The distributed module's class, or with hooks a subclass of it (same name) whose forward
    takes the original call and returns what the original returns: forward_hook, the
    distributed forward, return_hook. In forward itself, not as module hooks, so that a replaced
    model's root (GPT2LMHeadModel as DistributedTransformerLMHead) is captured (torch.export
    binds the call to forward's signature) and compiled with its hooks."""
    dist, before, after = registration.dist_module, registration.forward_hook, registration.return_hook
    if before is None and after is None:
        return dist
    key = registration.module_cls
    if key not in _adapters:

        def forward(self, *args, **kwargs):
            if before is not None:
                args, kwargs = _split("forward_hook", registration, before(*args, **kwargs))
            out = dist.forward(self, *args, **kwargs)
            return out if after is None else after(out)

        names = {"__module__": dist.__module__, "__qualname__": dist.__qualname__, "forward": forward}
        _adapters[key] = type(dist.__name__, (dist,), names)
    return _adapters[key]
