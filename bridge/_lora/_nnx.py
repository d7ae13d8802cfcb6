"""LoRA on Flax NNX models: adapters as `nnx.Param`s on their layer, which runs them.

A layer with an adapter keeps its class's behaviour and state and gains `lora_a`,
`lora_b` (`nnx.Param`), `lora_settings` (static) and, with dropout, an
`nnx.Dropout` named `lora_dropout` (its RNG stream in the model's state, so the
step's RNG handling advances it; `model.eval()` turns it off). Its class becomes a
subclass made once per layer class (`LoRALinear` for `nnx.Linear`, ...) whose
`__call__` adds the low-rank path to the layer's own output, as qwix swaps the class
of the models it intercepts.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import jax
from flax import nnx

from .._adapters._native import check_model, like, to_native, to_neutral
from .._paths import Path, at, path_str
from .._tree import Tree, framework, kind, walk
from . import _forward
from ._linen import conv_flax
from ._settings import (
    A,
    B,
    Frame,
    Injection,
    QwixAdapter,
    Settings,
    Target,
    register_frame,
)


_CLASSES: dict[type, type] = {}
_LOCK = threading.Lock()


def _call(self, inputs, *args, **kwargs):
    out = type(self)._lora_base.__call__(self, inputs, *args, **kwargs)
    return out + delta(self, inputs).astype(out.dtype)


def lora_class(base: type) -> type:
    """The subclass of an NNX layer class that runs an adapter (made once)."""
    with _LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            name = "LoRA" + base.__name__
            cls = _CLASSES[base] = type(
                name,
                (base,),
                {
                    "__call__": _call,
                    "_lora_base": base,
                    "__module__": __name__,
                    "__qualname__": name,
                },
            )
    return cls


def delta(layer: Any, x: jax.Array) -> jax.Array:
    """The adapter's output for the layer's input `x`, in the layer's output shape."""
    settings: Settings = layer.lora_settings
    a, b = layer.lora_a[...], layer.lora_b[...]
    if isinstance(layer, nnx.Embed):
        return _forward.embed_flax(x, a, b, settings.scaling)
    if "lora_dropout" in vars(layer):
        x = layer.lora_dropout(x)
    if isinstance(layer, nnx.Conv):
        return conv_flax(layer, x, a, b, settings.scaling)
    n_in = len(layer.in_features) if isinstance(layer, nnx.LinearGeneral) else 1
    out = _forward.dense_flax(x, a, b, settings.scaling, n_in)
    out_features = (
        layer.out_features
        if isinstance(layer, nnx.LinearGeneral)
        else (layer.out_features,)
    )
    return out.reshape(out.shape[:-1] + tuple(out_features))


def _target(path: Path, node: Tree, module: Any) -> Target | None:
    cls = kind(node)
    if not isinstance(cls, type):
        return None
    settings = getattr(module, "lora_settings", None)
    name = getattr(cls, "_lora_base", cls).__name__
    if issubclass(cls, nnx.Embed):
        shape = node.embedding.shape
        return Target(
            path, "embed", "embedding", "flax", shape[:-2], shape[-2:-1], shape[-1],
            name, settings,
        )  # fmt: skip
    if issubclass(cls, nnx.LinearGeneral):
        n_in, n_out = len(module.in_features), len(module.out_features)
        if tuple(module.axis) != tuple(range(-n_in, 0)) or module.batch_axis:
            return None  # contracts other axes than the trailing ones
        shape = node.kernel.shape
        lead = len(shape) - n_in - n_out
        return Target(
            path, "linear", "kernel", "flax", shape[:lead],
            (math.prod(shape[lead : lead + n_in]),), math.prod(shape[lead + n_in :]),
            name, settings,
        )  # fmt: skip
    if issubclass(cls, nnx.Linear):
        shape = node.kernel.shape
        return Target(
            path, "linear", "kernel", "flax", shape[:-2], shape[-2:-1], shape[-1],
            name, settings,
        )  # fmt: skip
    if issubclass(cls, nnx.Conv) and module.feature_group_count == 1:
        shape = node.kernel.shape
        lead = len(shape) - len(module.kernel_size) - 2
        return Target(
            path, "conv", "kernel", "flax", shape[:lead], shape[lead:-1], shape[-1],
            name, settings,
        )  # fmt: skip
    return None


def targets(tree: Tree) -> list[Target]:
    native = to_native(tree)
    found = (_target(path, node, at(native, path)) for path, node in walk(tree))
    return [t for t in found if t is not None]


_STACKED_DROPOUT = """\
{where}: LoRA dropout on a stack of NNX layers (made under nnx.vmap) is not \
supported: its random stream would need the stack's axes. Use dropout=0.0, or put \
adapters on the layers before stacking them."""


def inject(tree: Tree, adapters: list[Injection]) -> Tree:
    native = to_native(tree)
    for n, (target, a, b, settings, key) in enumerate(adapters):
        layer = at(native, target.path)
        base = getattr(type(layer), "_lora_base", type(layer))
        layer.lora_a = nnx.Param(a)
        layer.lora_b = nnx.Param(b)
        layer.lora_settings = settings
        if "lora_dropout" in vars(layer):
            del layer.lora_dropout
        if settings.dropout:
            if target.stack:
                raise ValueError(_STACKED_DROPOUT.format(where=target.where))
            # no key: read (load_peft) or carried (port) adapters, in inference mode
            # as PEFT's from_pretrained gives them (`.train()` turns dropout on)
            stream = jax.random.fold_in(jax.random.key(0), n) if key is None else key
            layer.lora_dropout = nnx.Dropout(
                settings.dropout, deterministic=key is None, rngs=nnx.Rngs(stream)
            )
        object.__setattr__(layer, "__class__", lora_class(base))
    return to_neutral(native)


def strip(tree: Tree, weights: dict[Path, Any]) -> Tree:
    native = to_native(tree)
    for path, node in walk(tree):
        base = getattr(kind(node), "_lora_base", None)
        if base is None:
            continue
        module = at(native, path)
        if path in weights:
            name = "embedding" if isinstance(module, nnx.Embed) else "kernel"
            getattr(module, name).set_value(weights[path])
        for attr in (A, B, "lora_settings", "lora_dropout"):
            if attr in vars(module):
                delattr(module, attr)
        object.__setattr__(module, "__class__", base)
    return to_neutral(native)


_QWIX_ATTRIBUTES = ("qwix_path", "disable_quant_stats_update", "qwix_rngs")


def qwix_read(tree: Tree) -> tuple[Tree, list[QwixAdapter]]:
    """The model without qwix: its root's class the one qwix intercepted, qwix's
    attributes gone, and the `<param>_lora_a`/`_lora_b` parameters taken out."""
    native = to_native(tree)
    unquantized = getattr(type(native), "_unquantized_type", None)  # qwix's class
    if unquantized is not None:
        object.__setattr__(native, "__class__", unquantized)
    found = []
    for path, _ in walk(tree):
        module = at(native, path)
        if not isinstance(module, nnx.Module):
            continue
        names = list(vars(module))
        for name in names:
            if name in _QWIX_ATTRIBUTES or name.endswith("_lora_einsum_str"):
                delattr(module, name)
            elif name.endswith("_lora_a"):
                param = name.removesuffix("_lora_a")
                a = getattr(module, name)[...]
                b = getattr(module, param + "_lora_b", None)
                found.append(QwixAdapter(path, param, a, None if b is None else b[...]))
                delattr(module, name)
                if b is not None:
                    delattr(module, param + "_lora_b")
    return to_neutral(native), found


register_frame("nnx", Frame(targets, inject, strip, like, qwix=qwix_read))


# --- Flax's own LoRA modules, read as bridge adapters ---------------------------------

_STANDALONE = (
    "{where}: an nnx.LoRA without base_module is a low-rank layer with no weight of "
    "its own; bridge's adapters sit on a layer (nnx.LoRA(..., base_module="
    "nnx.Linear(...)) or nnx.LoRALinear)"
)
_BASE = (
    "{where}: nnx.LoRA around a {cls}: bridge reads an nnx.LoRA whose base_module is "
    "an nnx.Linear (its x @ lora_a @ lora_b is a dense layer's adapter)"
)
_DTYPE = (
    "{where}: the nnx.LoRA computes in {dtype} while its lora_a is {a}: bridge's "
    "adapters compute in lora_a's dtype (as PEFT's); cast lora_a or set dtype=None"
)
_NOT_NNX = (
    "bridge.from_nnx_lora reads Flax NNX models (nnx.LoRA, nnx.LoRALinear); got a "
    "{framework} model."
)
_CANNOT_READ = """\
bridge.from_nnx_lora cannot read this model's LoRA modules: {n} problem(s), nothing \
was changed.
{problems}"""


def from_nnx_lora(model: Any) -> Any:
    """Flax's own LoRA modules as bridge adapters.

    Every `nnx.LoRALinear` becomes an `nnx.Linear` holding its `lora.lora_a` and
    `lora.lora_b` as bridge's `lora_a` and `lora_b`; every `nnx.LoRA(...,
    base_module=linear)` becomes `linear` with them. Flax's LoRA has no scaling:
    the adapters get `alpha = rank` (a scaling of 1), so the model computes what it
    computed (`x W + b + (x A) B`). Then `bridge.save_peft`, `bridge.merge_lora`,
    `bridge.port` and the training step work on them as on any bridge adapter.

    **Arguments:**

    - `model`: an `nnx.Module`, or a `bridge.Tree` of one.

    **Returns:**

    The model with bridge adapters, in the form it was given; the given model is not
    changed and shares its arrays with the result.

    **Raises:**

    `ValueError` listing every `nnx.LoRA` that cannot be read (no `base_module`, a
    base that is not an `nnx.Linear`, a `dtype` other than `lora_a`'s), or when the
    model holds no Flax LoRA module.

    **Example:**

    ```python
    >>> import jax.numpy as jnp, bridge
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.LoRALinear(4, 3, lora_rank=2, rngs=nnx.Rngs(0)))
    >>> model.layers[0].lora.lora_b[...] = jnp.ones((2, 3))
    >>> read = bridge.from_nnx_lora(model)
    >>> read.layers[0].lora_a.shape, read.layers[0].lora_settings.scaling
    ((4, 2), 1.0)
    >>> x = jnp.ones((1, 4))
    >>> bool(jnp.allclose(read(x), model(x)))
    True

    ```
    """
    check_model(model, "model")
    tree = to_neutral(model)
    if framework(tree) != "nnx":
        raise TypeError(_NOT_NNX.format(framework=framework(tree) or "partial-Tree"))
    native = to_native(tree)
    kinds = {path: kind(node) for path, node in walk(tree)}
    problems: list[str] = []
    read: list[tuple[Path, Any]] = []  # (path of the layer, its nnx.LoRA)
    for path, cls in kinds.items():
        if not isinstance(cls, type) or not issubclass(cls, (nnx.LoRA, nnx.LoRALinear)):
            continue
        where = path_str(path) or "(root)"
        if issubclass(cls, nnx.LoRALinear):
            layer = at(native, path)
            lora = layer.lora
            del layer.lora
            object.__setattr__(layer, "__class__", nnx.Linear)
        elif path and _is(kinds.get(path[:-1]), nnx.LoRALinear):
            continue  # a LoRALinear's own `lora`: read with it
        else:
            lora = at(native, path)
            layer = lora.base_module
            if layer is None or type(layer) is not nnx.Linear:
                cls_name = "None" if layer is None else type(layer).__name__
                text = _STANDALONE if layer is None else _BASE
                problems.append(text.format(where=where, cls=cls_name))
                continue
            _set_child(at(native, path[:-1]), path[-1], layer)
        a = lora.lora_a[...]
        if lora.dtype is not None and jax.numpy.dtype(lora.dtype) != a.dtype:
            problems.append(_DTYPE.format(where=where, dtype=lora.dtype, a=a.dtype))
        read.append((path, lora))
    if not read and not problems:
        problems.append("the model holds no nnx.LoRA or nnx.LoRALinear")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(_CANNOT_READ.format(n=len(problems), problems=lines))
    plain = to_neutral(native)
    found = {t.path: t for t in targets(plain)}
    injections = []
    for path, lora in read:
        a, b = lora.lora_a[...], lora.lora_b[...]
        rank = a.shape[-1]
        injections.append(
            Injection(found[path], a, b, Settings(rank, float(rank)), None)
        )
    out = inject(plain, injections)
    return out if isinstance(model, Tree) else like(model, out)


def _is(cls: Any, base: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, base)


def _set_child(parent: Any, key: Any, child: Any) -> None:
    if isinstance(key, int):
        parent[key] = child
    else:
        setattr(parent, key, child)


# --- back to Flax's own LoRA modules ----------------------------------------------

_NOT_LINEAR = (
    "{where} ({cls}): nnx.LoRALinear is an nnx.Linear with an adapter; Flax has no "
    "LoRA module for this kind of layer (keep bridge's, from bridge.to_native, or fold "
    "it in with bridge.merge_lora)"
)
_STACKED = (
    "{where}: a stack of layers (made under nnx.vmap) holds one adapter per layer; "
    "nnx.LoRALinear holds one (keep bridge's layers, or build the stack of "
    "nnx.LoRALinear yourself)"
)
_DROPOUT = (
    "{where}: the adapter has dropout {rate}; nnx.LoRA has none (make the adapter "
    "with dropout=0.0, or keep bridge's layers)"
)
_MIXED = (
    "{where}: the adapters are {a}, the kernel {kernel}: nnx.LoRALinear adds the "
    "adapter's output in its own dtype ({a}) where bridge casts it to the layer's "
    "({kernel}); cast the adapters to {kernel} first"
)
_CANNOT_WRITE = """\
bridge.to_nnx_lora cannot give these adapters to Flax's LoRA modules: {n} \
problem(s), nothing was changed.
{problems}"""


def to_nnx_lora(model: Any) -> Any:
    """An NNX model whose adapted layers are Flax's own `nnx.LoRALinear`.

    The way back from `bridge.from_nnx_lora`: every `nnx.Linear` holding a bridge
    adapter (from `bridge.lora`, `bridge.load_peft`, `bridge.port`) becomes an
    `nnx.LoRALinear` with the same `kernel` and `bias` and `lora.lora_a (in, rank)`,
    `lora.lora_b (rank, out)` as `nnx.LoRAParam`s. Flax's LoRA has no scaling: the
    adapter's `alpha / rank` (or `alpha / sqrt(rank)`) is folded into `lora_b`, so
    the model computes what it computed, up to rounding (`x A (s B)` for `s (x A)
    B`). Then `nnx.LoRAParam` filters select the adapters (`nnx.Optimizer(model, tx,
    wrt=nnx.LoRAParam)`), and `bridge.from_nnx_lora` reads them again.

    Only adapters that fit Flax's modules are written: each on an `nnx.Linear` (not
    `LinearGeneral`, `Conv`, `Embed`), not in a stack, without dropout, in the
    kernel's dtype. Others are refused by name (`bridge.to_native` runs every
    adapter in bridge's own layer classes).

    **Arguments:**

    - `model`: an NNX model with adapters, or a `bridge.Tree` of one.

    **Returns:**

    The model with `nnx.LoRALinear` layers, in the form it was given; the given
    model is not changed.

    **Raises:**

    `ValueError` listing every adapter that does not fit, or when the model holds
    none; `TypeError` for a model of another framework.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, bridge
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
    >>> adapted = bridge.lora(model, ["layers.0"], rank=2, alpha=4,
    ...                       key=jax.random.key(0))
    >>> flax_lora = bridge.to_nnx_lora(adapted)
    >>> type(flax_lora.layers[0]).__name__, flax_lora.layers[0].lora.lora_a.shape
    ('LoRALinear', (4, 2))

    ```
    """
    check_model(model, "model")
    tree = to_neutral(model)
    if framework(tree) != "nnx":
        raise TypeError(
            _NOT_NNX.replace("reads", "writes")
            .format(framework=framework(tree) or "partial-Tree")
            .replace("from_nnx_lora", "to_nnx_lora")
        )
    found = [t for t in targets(tree) if t.settings is not None]
    problems: list[str] = []
    if not found:
        problems.append("the model holds no LoRA adapter (bridge.lora puts them on)")
    native = to_native(tree)
    for t in found:
        layer = at(native, t.path)
        settings: Settings = layer.lora_settings
        if type(layer)._lora_base is not nnx.Linear:
            problems.append(_NOT_LINEAR.format(where=t.where, cls=t.cls))
        elif t.stack:
            problems.append(_STACKED.format(where=t.where))
        elif settings.dropout:
            problems.append(_DROPOUT.format(where=t.where, rate=settings.dropout))
        elif layer.lora_a[...].dtype != layer.kernel[...].dtype:
            a, kernel = layer.lora_a[...].dtype, layer.kernel[...].dtype
            problems.append(_MIXED.format(where=t.where, a=a, kernel=kernel))
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(_CANNOT_WRITE.format(n=len(problems), problems=lines))
    for t in found:
        layer = at(native, t.path)
        a, b = layer.lora_a[...], layer.lora_b[...]
        scaling = layer.lora_settings.scaling
        for attr in (A, B, "lora_settings", "lora_dropout"):
            if attr in vars(layer):
                delattr(layer, attr)
        object.__setattr__(layer, "__class__", nnx.LoRALinear)
        lora = nnx.LoRA(
            a.shape[0], a.shape[1], b.shape[1], dtype=a.dtype, param_dtype=a.dtype,
            rngs=nnx.Rngs(0),
        )  # fmt: skip
        lora.lora_a = nnx.LoRAParam(a)
        lora.lora_b = nnx.LoRAParam(b * jax.numpy.asarray(scaling, b.dtype))
        layer.lora = lora
    out = to_neutral(native)
    return out if isinstance(model, Tree) else like(model, out)
