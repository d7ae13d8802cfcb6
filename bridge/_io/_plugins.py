"""Plug-ins: what a kind of stored weights adds to `save` and `load`, registered from
the layer above `_io` (quantized schemes: `bridge._quant/_plugin.py`), so that `_io`
never names them nor imports that layer.

`load` is a few steps (`bridge._io._checkpoint`), and at each it asks every
registered plug-in, in registration order, what it can do for this file:

- `check(request)`: refuse arguments it cannot serve, before the file is opened
  (`keep_quantized=True` without `like`);
- `dense(contents, arrays, dtype)`: the file's arrays (`{name: LazyArray}`, as its
  format reads them lazily) as a dense model holds them (each quantized weight's
  tensors as one `LazyArray` that dequantizes them), or None when it has nothing to
  change. Both the lazy read of a port and the read without `like` take it;
- `fill(contents, request)`: `like` filled from the file its own way (`Filled`), or
  None to leave the file to the ordinary readers (quantized weights kept as
  `QuantizedArray`s with `keep_quantized=True`).

A plug-in that serves one argument of `load` names it (`option`, a `Request` field):
its `check` and `fill` are asked only when that argument is given. (A format whose
files name layers their own way renames them itself: `Format.rename`.)

`save` asks `check_save(path, tree)` of each (weights kept quantized are refused) and
takes `save_quantized(path, model, name)`'s scheme from the plug-in whose
`quantizers` has that name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._lazy import LazyArray
from .._tree import Tree
from ._contents import Contents
from ._format import load_builtins


class Request(NamedTuple):
    """What `bridge.load` was asked, its arguments checked; `target`: `like`'s Tree
    (its leaves placeholders), None without `like`. See `bridge.load` for each."""

    path: Path
    like: Any
    target: Tree | None
    dtype: Any
    rules: Mapping[str, str | None] | None
    prefix: str
    strict: bool
    example: Any
    example_kwargs: Any
    keep_quantized: bool
    opt_state_like: Any

    @property
    def as_saved(self) -> bool:
        """Whether the file's names are taken as they are (no `rules`, no `prefix`):
        else it is always ported, by its paths."""
        return self.rules is None and not self.prefix


class Filled(NamedTuple):
    """`like` filled from a file: `model` (of `like`'s kind), `source` (the file's
    Tree the optimizer state is ported along, or None where none was made), `plan`
    (the port's `bridge.Plan`, reported as `from_pretrained` reports it; None for a
    file read straight into `like`)."""

    model: Any
    source: Tree | None
    plan: Any


class Quantizer(NamedTuple):
    """A scheme of `save_quantized(path, model, name)`: `state(state,
    linear)` gives the PyTorch-layout `{name: array}` with the weights of the linear
    layers `linear` (dotted layer names) quantized; `config(folder)` writes what a
    reader needs beside the file (the `quantization_config` of `config.json`)."""

    name: str
    state: Callable[[Mapping[str, np.ndarray], set[str]], dict[str, np.ndarray]]
    config: Callable[[Path], None]


class Plugin(NamedTuple):
    """What one kind of stored weights adds to `save` and `load` (see the module's
    note); a capability left None is not asked."""

    name: str
    option: str | None = None
    check: Callable[[Request], None] | None = None
    dense: (
        Callable[[Contents, Mapping[str, LazyArray], Any], dict[str, LazyArray] | None]
        | None
    ) = None
    fill: Callable[[Contents, Request], Filled | None] | None = None
    check_save: Callable[[Path, Tree], None] | None = None
    quantizers: tuple[Quantizer, ...] = ()


_PLUGINS: dict[str, Plugin] = {}


def register_plugin(plugin: Plugin) -> Plugin:
    """Register `plugin` (a second one of the same name is refused) and return it."""
    if not isinstance(plugin, Plugin):
        raise TypeError(f"`plugin` must be a Plugin, got {type(plugin).__name__}.")
    if plugin.name in _PLUGINS:
        raise ValueError(f"A plug-in named {plugin.name!r} is registered already.")
    _PLUGINS[plugin.name] = plugin
    return plugin


def plugins() -> tuple[Plugin, ...]:
    """Every registered plug-in, in registration order (bridge's own registered
    first, as the formats are: `_format.load_builtins`)."""
    load_builtins()
    return tuple(_PLUGINS.values())


def asked(request: Request) -> tuple[Plugin, ...]:
    """The plug-ins `request` asks for: those serving no one argument, and those
    whose argument (`Plugin.option`) it gives."""
    return tuple(p for p in plugins() if p.option is None or getattr(request, p.option))


def dense(
    contents: Contents, arrays: Mapping[str, LazyArray], dtype: Any
) -> dict[str, LazyArray] | None:
    """`arrays` as the first plug-in that changes them gives them (see `Plugin`),
    or None when none does."""
    for plugin in plugins():
        if plugin.dense is not None:
            found = plugin.dense(contents, arrays, dtype)
            if found is not None:
                return found
    return None


_UNKNOWN = """\
`scheme` must be one of {schemes}, got {got!r}."""


def quantizer(name: str | None) -> Quantizer | None:
    """The registered `Quantizer` called `name` (None for None); a `ValueError`
    naming the schemes there are for any other name."""
    if name is None:
        return None
    known = [q for p in plugins() for q in p.quantizers]
    for q in known:
        if q.name == name:
            return q
    raise ValueError(_UNKNOWN.format(schemes=tuple(q.name for q in known), got=name))
