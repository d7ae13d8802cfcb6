"""LoRA on Flax Linen models: adapters in the `params` collection under their layer,
run by method interception (`nn.intercept_methods`, as qwix does).

`bridge.lora` gives the root module a subclass of its class (made per call, as qwix
does) whose `__call__` runs the original under an interceptor. The interceptor adds
the low-rank path to every `nn.Dense`, `nn.DenseGeneral`, `nn.Conv` and `nn.Embed`
whose `params` hold a `lora_a`, with the settings the subclass keeps by module path.
Dropout on the adapter's input runs when a `"dropout"` random stream is given
(`module.apply(..., rngs={"dropout": key})`, as `make_step` does with `rngs=`).

A Linen Tree holds no submodules, so layers are recognised by their arrays and
names: `embedding` is an embedding; a `kernel` is a convolution's under a name with
`conv` in it, a per-head projection's under `query`/`key`/`value` (inputs: the first
axis) or `out` (inputs: all but the last), a `DenseGeneral_N`'s (inputs: the first
axis), else a dense layer's, `(in, out)` after any stacked axes (`nn.scan`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from .._adapters._native import like, to_native, to_neutral
from .._paths import Path, path_str
from .._tree import Tree, walk
from . import _forward
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


_PER_HEAD_IN = {"query": 1, "key": 1, "value": 1}
_AUTO_DENSE_GENERAL = re.compile(r"^DenseGeneral_\d+$")

_NO_MODULE = """\
LoRA on a Linen model needs its module, which runs the adapters: make the Tree with \
bridge.from_linen(variables, module), or pass (module, variables)."""

_MISFIT = """\
{where}: its LoRA adapter lora_a {a} does not fit the {cls} there, which contracts \
{fan_in} input features. The adapter was shaped from the layer's arrays and name; \
name the layer's inputs by giving it a conventional name, or put adapters on \
another layer."""


def linen_module(tree: Tree) -> nn.Module | None:
    """The Linen module the Tree was made with (None: variables alone)."""
    src = tree._info.source
    return None if src is None else src.record.module.value


def to_linen(tree: Tree) -> dict[str, Any]:
    """The Tree's variables."""
    return like({}, tree)


def from_linen(variables: Any, module: nn.Module | None) -> Tree:
    return to_neutral(variables if module is None else (module, variables))


def _settings_table(module: Any) -> dict[Path, Settings]:
    return dict(getattr(type(module), "_lora_layers", ()))


def _intercept(table: Mapping[Path, Settings], next_fun, args, kwargs, context):
    module = context.module
    if (
        context.method_name != "__call__"
        or not isinstance(module, (nn.Dense, nn.DenseGeneral, nn.Conv, nn.Embed))
        or not module.has_variable("params", A)
    ):
        return next_fun(*args, **kwargs)
    out = next_fun(*args, **kwargs)
    settings = table[tuple(module.path)]
    a = module.get_variable("params", A)
    b = module.get_variable("params", B)
    x = args[0]
    if isinstance(module, nn.Embed):
        return out + _forward.embed_flax(x, a, b, settings.scaling).astype(out.dtype)
    if settings.dropout and module.has_rng("dropout"):
        x = _forward.dropout(x, settings.dropout, module.make_rng("dropout"))
    if isinstance(module, nn.Conv):
        d = conv_flax(module, x, a, b, settings.scaling)
        return out + d.astype(out.dtype)
    n_in = 1
    if isinstance(module, nn.DenseGeneral):
        n_in = len(module.axis) if isinstance(module.axis, tuple) else 1
    fan_in = math.prod(x.shape[x.ndim - n_in :])
    if fan_in != a.shape[0]:
        raise ValueError(
            _MISFIT.format(
                where=path_str(tuple(module.path)),
                a=tuple(a.shape),
                cls=type(module).__name__,
                fan_in=fan_in,
            )
        )
    d = _forward.dense_flax(x, a, b, settings.scaling, n_in)
    return out + d.reshape(out.shape).astype(out.dtype)


def _lora_call(self, *args, **kwargs):
    cls = type(self)
    with nn.intercept_methods(lambda *a: _intercept(cls._lora_table, *a)):
        return cls._lora_base.__call__(self, *args, **kwargs)


def lora_module(module: nn.Module, table: dict[Path, Settings]) -> nn.Module:
    """A copy of `module` whose class runs the adapters of `table` (`{module path:
    Settings}`); an empty table gives the plain module back."""
    base = getattr(type(module), "_lora_base", type(module))
    new = module.clone()
    if table:
        namespace = {
            "__call__": _lora_call,
            "_lora_base": base,
            "_lora_table": dict(table),
            "_lora_layers": tuple(sorted(table.items(), key=lambda kv: str(kv[0]))),
        }
        object.__setattr__(new, "__class__", type(base.__name__, (base,), namespace))
    else:
        object.__setattr__(new, "__class__", base)
    return new


def _target(path: Path, node: Tree, table: dict[Path, Settings]) -> Target | None:
    names = dict(zip(node._info.keys or (), node._children))
    name = str(path[-1]) if path else ""
    if isinstance(names.get("embedding"), jax.Array | jax.ShapeDtypeStruct):
        shape = names["embedding"].shape
        return Target(
            path, "embed", "embedding", "flax", shape[:-2], shape[-2:-1], shape[-1],
            "Embed", table.get(path),
        )  # fmt: skip
    kernel = names.get("kernel")
    if kernel is None or isinstance(kernel, Tree):
        return None
    shape = tuple(kernel.shape)
    if "transpose" in name.lower() or "local" in name.lower():
        return None
    if "conv" in name.lower():
        return Target(
            path, "conv", "kernel", "flax", (), shape[:-1], shape[-1], "Conv",
            table.get(path),
        )  # fmt: skip
    if name in _PER_HEAD_IN or name == "out" or _AUTO_DENSE_GENERAL.match(name):
        core = 3 if len(shape) >= 3 else len(shape)
        lead = len(shape) - core
        n_in = core - 1 if name == "out" else 1
        return Target(
            path, "linear", "kernel", "flax", shape[:lead],
            (math.prod(shape[lead : lead + n_in]),), math.prod(shape[lead + n_in :]),
            "DenseGeneral", table.get(path),
        )  # fmt: skip
    return Target(
        path, "linear", "kernel", "flax", shape[:-2], shape[-2:-1], shape[-1],
        "Dense", table.get(path),
    )  # fmt: skip


def _module(tree: Tree) -> nn.Module:
    module = linen_module(tree)
    if module is None:
        raise ValueError(_NO_MODULE)
    return module


def targets(tree: Tree) -> list[Target]:
    module = linen_module(tree)  # None for a file's Tree: no adapter settings
    table = {} if module is None else _settings_table(module)
    found = (_target(path, node, table) for path, node in walk(tree))
    return [t for t in found if t is not None]


def _with(variables: Any, path: Path, update: dict[str, Any], drop=()) -> Any:
    """`variables` with the `params` mapping at `path` updated (copies on the path
    only)."""
    out = dict(variables)
    node = out["params"] = dict(out["params"])
    for key in path:
        node[key] = dict(node[key])
        node = node[key]
    for name in drop:
        node.pop(name, None)
    node.update(update)
    return out


def inject(tree: Tree, adapters: list[Injection]) -> Tree:
    module = _module(tree)
    table = _settings_table(module)
    variables = to_linen(tree)
    for target, a, b, settings, _ in adapters:
        variables = _with(variables, target.path, {A: a, B: b})
        table[target.path] = settings
    return from_linen(variables, lora_module(module, table))


def strip(tree: Tree, weights: dict[Path, Any]) -> Tree:
    module = _module(tree)
    variables = to_linen(tree)
    for path in _settings_table(module):
        update = {}
        if path in weights:
            name = (
                "embedding" if "embedding" in _params_at(variables, path) else "kernel"
            )
            update[name] = weights[path]
        variables = _with(variables, path, update, drop=(A, B))
    return from_linen(variables, lora_module(module, {}))


def _params_at(variables: Any, path: Path) -> Mapping[str, Any]:
    node = variables["params"]
    for key in path:
        node = node[key]
    return node


def native(model: Any, tree: Tree) -> Any:
    if isinstance(model, tuple):
        return linen_module(tree), to_linen(tree)
    if isinstance(model, nn.Module):
        return to_native(tree)  # bound
    return to_linen(tree)


def qwix_read(tree: Tree) -> tuple[Tree, list[QwixAdapter]]:
    """The model without qwix: the module of the class qwix intercepted, and the
    `params` without the `<param>_lora_a`/`_lora_b` arrays, which are returned."""
    module = linen_module(tree)
    unquantized = getattr(type(module), "_unquantized_type", None)  # qwix's class
    if module is not None and unquantized is not None:
        module = module.clone()
        object.__setattr__(module, "__class__", unquantized)
    variables = dict(to_linen(tree))
    found: list[QwixAdapter] = []

    def take(node: Mapping[str, Any], path: Path) -> dict[str, Any]:
        out = {}
        for key, value in node.items():
            if isinstance(value, Mapping):
                out[key] = take(value, path + (key,))
            elif key.endswith("_lora_a"):
                param = key.removesuffix("_lora_a")
                b = node.get(param + "_lora_b")
                found.append(QwixAdapter(path, param, value, b))
            elif (
                not key.endswith("_lora_b")
                or key[: -len("_lora_b")] + ("_lora_a") not in node
            ):
                out[key] = value
        return out

    if "params" in variables:
        variables["params"] = take(variables["params"], ())
    return from_linen(variables, module), found


def conv_flax(
    layer: Any, x: jax.Array, a: jax.Array, b: jax.Array, scaling: float
) -> jax.Array:
    """A Linen or NNX convolution's adapter (both name their settings alike):
    `a (*window, in, rank)` applied as a `rank`-channel convolution with the layer's
    strides, padding and dilation (PEFT's `lora_A` is such a `ConvNd`), then
    `b (rank, out)` as a 1x1 convolution (PEFT's `lora_B`). `x`: channels last."""
    conv = nn.Conv(
        features=a.shape[-1],
        kernel_size=layer.kernel_size,
        strides=layer.strides,
        padding=layer.padding,
        input_dilation=layer.input_dilation,
        kernel_dilation=layer.kernel_dilation,
        use_bias=False,
        dtype=a.dtype,
        parent=None,
    )
    h: Any = conv.apply({"params": {"kernel": a}}, x.astype(a.dtype))
    return (h @ b) * jax.numpy.asarray(scaling, a.dtype)


register_frame("linen", Frame(targets, inject, strip, native, qwix=qwix_read))
