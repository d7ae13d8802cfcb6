"""A model of any framework in PyTorch layout and names, without a PyTorch model:
what `bridge.save(..., layout="torch")` and `bridge convert --to-layout torch` write.

Each layer the codecs recognise is decoded to the canonical (Flax) layout and encoded
by its PyTorch-layout codec (`nn.Linear` weight `(out, in)`, OIHW convolutions,
`running_mean`/`running_var`, fused attention `in_proj_weight`, ...). A layer is named
by its dotted path (`layers.0`), or by the `rules` that paired the PyTorch model's
layers with this model's on import, read backwards (see `bridge._port._reverse`), so
that `module.load_state_dict(strict=True)` finds the names it expects.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import numpy as np

from .._adapters._torch import TorchNode, to_torch
from .._lazy import materialise
from .._paths import Path, path_str
from .._port._codec import codec_of
from .._port._layers import ARRAY, Layer, find_layers
from .._port._reverse import reverse_rules
from .._port.codecs._torch import kinds_by_name
from .._tree import Tree, framework


COUNTERS = {"BatchNorm": {"num_batches_tracked": np.zeros((), np.int64)}}
"""Entries a PyTorch layer has that no other framework keeps: written fresh."""

_NO_TORCH_CODEC = (
    "unsupported: {where} ({kinds}) has no PyTorch-layout codec; register one "
    "(bridge.register_codec with framework='torch')"
)
_CLASH = "names: layers {layers} would all be written as {name!r}"
_CANNOT = """\
Cannot write the PyTorch layout: {n} problem(s), nothing was written.
{problems}"""


def dotted_torch(where: str) -> str:
    """A `keystr` path in PyTorch's dotted form: `.layers[0]['a']` -> `layers.0.a`."""
    text = re.sub(r"\[(\d+)\]", r".\1", where)
    text = re.sub(r"\['([^']*)'\]", r".\1", text)
    return text.lstrip(".")


Rename = Callable[[list[Path], list[str]], list[Path]]
"""New paths for layer paths, problems appended to the list (`bridge convert
--rename`)."""


def torch_state(
    tree: Tree,
    rules: Mapping[str, str] | None = None,
    prefix: str = "",
    rename: Rename | None = None,
) -> dict[str, np.ndarray]:
    """`tree`'s arrays in PyTorch layout, by the names a PyTorch model gives them.

    `rules` are import rules (`{PyTorch layer regex: this model's layer path}`, as
    given to `bridge.port`), read backwards; `rename` (instead) maps the layers'
    paths forwards, as `bridge convert --rename` does; `prefix` is put before every
    name. Raises `ValueError` listing every layer without a PyTorch-layout codec,
    every rule that cannot be read backwards, every unused or malformed rename, and
    every name two layers would share.
    """
    if framework(tree) == "torch":
        return to_torch(tree, prefix=prefix or None)
    problems: list[str] = []
    backwards: dict[str, str] = {}
    try:
        backwards = reverse_rules(rules or {})
    except ValueError as error:
        problems.append(str(error))
    layers = find_layers(tree, problems)
    chosen = [(layer, kind) for layer in layers if (kind := _kind(layer, problems))]
    if rename is None:
        names = [_name(path_str(layer.path), backwards) for layer, _ in chosen]
    else:
        paths = rename([layer.path for layer, _ in chosen], problems)
        names = [dotted_torch(path_str(p)) for p in paths]
    out: dict[str, np.ndarray] = {}
    owners: dict[str, list[str]] = {}
    for (layer, kind), name in zip(chosen, names):
        owners.setdefault(name, []).append(layer.where)
        leaves = {k: materialise(v) for k, v in layer.leaves.items()}
        if kind == ARRAY:  # a loose array (ViT's `cls_token`): under its own name
            out[prefix + name] = np.asarray(leaves["array"])
            continue
        canonical = layer.codec(kind).decode(leaves, layer.hyper)
        codec = codec_of(kind, "torch")
        assert codec is not None
        # no module: the codec's settings are those a file's reader takes from the
        # name (GPT-2's `c_attn`, `c_proj`, ... are Conv1D, weight (in, out))
        hyper = codec.hyperparameters(TorchNode(None, "", frozenset(), name))
        encoded = codec.encode(canonical, {}, hyper)
        encoded.update(COUNTERS.get(kind, {}))
        for entry, array in encoded.items():
            key = ".".join(filter(None, (name, entry.replace("/", "."))))
            out[prefix + key] = np.asarray(array)
    for name, wheres in owners.items():
        if len(wheres) > 1 and rename is None:  # `rename` reports its own clashes
            problems.append(_CLASH.format(layers=wheres, name=name))
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(_CANNOT.format(n=len(problems), problems=lines))
    return out


def _kind(layer: Layer, problems: list[str]) -> str | None:
    if layer.kinds == (ARRAY,):
        return ARRAY
    kinds = tuple(k for k in layer.kinds if codec_of(k, "torch") is not None)
    kinds = kinds_by_name(dotted_torch(layer.where), kinds)
    if not kinds:
        problems.append(
            _NO_TORCH_CODEC.format(where=layer.where, kinds="/".join(layer.kinds))
        )
        return None
    return kinds[0]


def _name(where: str, backwards: Mapping[str, str]) -> str:
    for pattern, replacement in backwards.items():
        match = re.fullmatch(pattern, where)
        if match:
            return dotted_torch(match.expand(replacement))
    return dotted_torch(where)
