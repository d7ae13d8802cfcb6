"""LoRA on Equinox models: a layer with an adapter is a subclass of its layer class
with three more fields, `lora_a`, `lora_b` and `lora_settings` (static), whose
`__call__` adds the low-rank path to the layer's own output.

The arrays are in PEFT's orientation, which is Equinox's own: `lora_a (rank, in)`
(a convolution's `(rank, in, *window)`), `lora_b (out, rank)`. Dropout on the
adapter's input runs when the layer is called with a `key`, as `eqx.nn.Dropout`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._adapters._native import like, to_native, to_neutral
from .._paths import Path, at
from .._tree import Tree, kind, walk
from . import _forward
from ._settings import Frame, Injection, Settings, Target, register_frame


def _linear_call(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    out = type(self)._lora_base.__call__(self, x)
    h = _forward.dropout(x, self.lora_settings.dropout, key).astype(self.lora_a.dtype)
    d = (self.lora_b @ (self.lora_a @ h)) * self.lora_settings.scaling
    return out + d.astype(out.dtype)


def _conv_call(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    out = type(self)._lora_base.__call__(self, x)
    h = _forward.dropout(x, self.lora_settings.dropout, key).astype(self.lora_a.dtype)
    # lora_a: a rank-channel convolution with the layer's strides, padding, dilation
    conv = _plain(self, eqx.nn.Conv, {"weight": self.lora_a, "bias": None})
    h = eqx.nn.Conv.__call__(conv, h)
    d = jnp.tensordot(self.lora_b, h, axes=1) * self.lora_settings.scaling
    return out + d.astype(out.dtype)


def _embedding_call(self, x: Any, *, key: Any = None) -> jax.Array:
    out = type(self)._lora_base.__call__(self, x)
    d = (self.lora_b @ self.lora_a[:, x]) * self.lora_settings.scaling
    return out + d.astype(out.dtype)


_CALLS = (
    (eqx.nn.Linear, _linear_call),
    (eqx.nn.Conv, _conv_call),
    (eqx.nn.Embedding, _embedding_call),
)
_CLASSES: dict[type, type] = {}
_LOCK = threading.Lock()


def lora_class(base: type) -> type:
    """The subclass of an Equinox layer class with an adapter (made once, and kept
    in this module under its name, `LoRALinear`, `LoRAConv2d`, ..., so a checkpoint
    can name it): fields `lora_a`, `lora_b` and `lora_settings` (static)."""
    with _LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            call = next(call for plain, call in _CALLS if issubclass(base, plain))
            name = "LoRA" + base.__name__
            namespace = {
                "__annotations__": {
                    "lora_a": jax.Array,
                    "lora_b": jax.Array,
                    "lora_settings": Settings,
                },
                "lora_a": None,
                "lora_b": None,
                "lora_settings": eqx.field(static=True, default=Settings(1, 1.0)),
                "__call__": call,
                "_lora_base": base,
                "__module__": __name__,
                "__qualname__": name,
            }
            cls = _CLASSES[base] = type(name, (base,), namespace)
            globals()[name] = cls
    return cls


def _plain(module: Any, cls: type, changes: dict[str, Any]) -> Any:
    """An instance of `cls` with `module`'s fields of `cls`, `changes` replacing some
    (no `__init__`: the arrays are taken as they are)."""
    new = object.__new__(cls)
    for f in dataclasses.fields(cls):
        value = changes[f.name] if f.name in changes else getattr(module, f.name)
        object.__setattr__(new, f.name, value)
    if cls is eqx.nn.Conv and "weight" in changes and "bias" in changes:
        object.__setattr__(new, "use_bias", False)
        object.__setattr__(new, "out_channels", changes["weight"].shape[0])
    return new


def _target(path: Path, node: Tree, module: Any) -> Target | None:
    cls = kind(node)
    if not isinstance(cls, type):
        return None
    settings = getattr(module, "lora_settings", None)
    name = getattr(cls, "_lora_base", cls).__name__
    if issubclass(cls, eqx.nn.Linear) and module.in_features != "scalar":
        shape = node.weight.shape
        return Target(
            path, "linear", "weight", "peft", shape[:-2], shape[-1:], shape[-2],
            name, settings,
        )  # fmt: skip
    if issubclass(cls, eqx.nn.Conv) and module.groups == 1:
        shape = node.weight.shape
        lead = len(shape) - module.num_spatial_dims - 2
        return Target(
            path, "conv", "weight", "peft", shape[:lead], shape[lead + 1 :],
            shape[lead], name, settings,
        )  # fmt: skip
    if issubclass(cls, eqx.nn.Embedding):
        shape = node.weight.shape
        return Target(
            path, "embed", "weight", "peft", shape[:-2], shape[-2:-1], shape[-1],
            name, settings,
        )  # fmt: skip
    return None


def _model(tree: Tree) -> tuple[Any, Any]:
    native = to_native(tree)
    return native if isinstance(native, tuple) else (native, None)


def _tree(model: Any, state: Any) -> Tree:
    return to_neutral(model if state is None else (model, state))


def targets(tree: Tree) -> list[Target]:
    model, _ = _model(tree)
    found = (_target(path, node, at(model, path)) for path, node in walk(tree))
    return [t for t in found if t is not None]


def _replace(model: Any, paths: list[Path], new: list[Any]) -> Any:
    if not paths:
        return model
    where = lambda m: [at(m, p) for p in paths]  # noqa: E731
    return eqx.tree_at(where, model, replace=new)


def inject(tree: Tree, adapters: list[Injection]) -> Tree:
    model, state = _model(tree)
    new = []
    for target, a, b, settings, _ in adapters:
        layer = at(model, target.path)
        cls = lora_class(getattr(type(layer), "_lora_base", type(layer)))
        fields = {"lora_a": a, "lora_b": b, "lora_settings": settings}
        new.append(_plain(layer, cls, fields))
    model = _replace(model, [t.target.path for t in adapters], new)
    return _tree(model, state)


def strip(tree: Tree, weights: dict[Path, Any]) -> Tree:
    model, state = _model(tree)
    paths = [p for p, node in walk(tree) if hasattr(kind(node), "_lora_base")]
    new = []
    for path in paths:
        layer = at(model, path)
        changes = {"weight": weights[path]} if path in weights else {}
        new.append(_plain(layer, type(layer)._lora_base, changes))
    return _tree(_replace(model, paths, new), state)


register_frame("equinox", Frame(targets, inject, strip, like))
