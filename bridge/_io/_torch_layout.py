"""A model of any framework in PyTorch layout and names, without a PyTorch model:
what `bridge.save_pretrained`, `bridge.save_state_dict` and `bridge convert --to-layout
torch` write.

Each layer the codecs recognise is decoded to the canonical (Flax) layout and encoded
by its PyTorch-layout codec (`nn.Linear` weight `(out, in)`, OIHW convolutions,
`running_mean`/`running_var`, fused attention `in_proj_weight`, ...). A layer is named
by its dotted path (`layers.0`), or by the `rules` that paired the PyTorch model's
layers with this model's on import, read backwards (see `bridge._port._reverse`), so
that `module.load_state_dict(strict=True)` finds the names it expects.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from .._adapters._registry import (
    Adapter,
    LayoutWriter,
    listed,
    of_layout,
    registered,
)
from .._lazy import materialise
from .._paths import Path, path_str
from .._port._codec import codec_of
from .._port._computed import computed
from .._port._errors import SETTINGS
from .._port._find import find_layers
from .._port._layer import ARRAY, Layer, tell_settings
from .._port._order import normalised
from .._port._reverse import reverse_rules
from .._port._side import read_side
from .._port._trace import Example, Trace
from .._port.codecs._torch import kinds_by_name
from .._tree import Tree, framework, native_order, native_paths


LAYOUT = "torch"
"""The layout this module writes: the adapter of that layout writes it (its
`writer`: its own Trees, the codecs' view of a layer known by name, the entries
written fresh), its codecs encode each layer."""


def _writer() -> tuple[Adapter, LayoutWriter]:
    adapter = of_layout(LAYOUT)
    assert adapter.writer is not None
    return adapter, adapter.writer


def _own(tree: Tree) -> bool:
    """Whether `tree` is of the adapter that writes the layout (then written as it
    is, by the adapter)."""
    adapter = registered(framework(tree))
    return adapter is not None and adapter.layout == LAYOUT


_NO_TORCH_CODEC = (
    "unsupported: {where} ({kinds}) has no PyTorch-layout codec; register one "
    "(bridge.register_codec with framework='torch')"
)
_MALFORMED = (
    "shape: {where} would be written as {name!r} with {shapes}, which is not a "
    "PyTorch {kind} (a stack of layers no codec recognised, a 3-D kernel under a "
    "Linear name?); give the model with its layers recognised, or port it into the "
    "PyTorch model first (bridge.port(model, torch_module))"
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
    kinds: dict[str, str] | None = None,
    family: str | None = None,
    known: Collection[str] | None = None,
    example: Example | None = None,
) -> dict[str, np.ndarray]:
    """`tree`'s arrays in PyTorch layout, by the names a PyTorch model gives them.

    `rules` are import rules (`{PyTorch layer regex: this model's layer path}`, as
    given to `bridge.port`), read backwards; `rename` (instead) maps the layers'
    paths forwards, as `bridge convert --rename` does; `prefix` is put before every
    name. Raises `ValueError` listing every layer without a PyTorch-layout codec,
    every rule that cannot be read backwards, every unused or malformed rename, and
    every name two layers would share. `kinds`, if given, receives the kind of the
    layer of each name written (`{"fc.weight": "Dense", ...}`). `family`: the
    Hugging Face `model_type` written for, where known (GPT-2's `c_fc` is a
    `Conv1D`, GPT-Neo's an `nn.Linear`). `known`: the names of the PyTorch model
    written for, where given (`like`): a layer it names otherwise takes its name
    there (`fitted`). `example`: inputs of the model, whose
    forward pass (traced abstractly) decides the layouts its arrays leave open (a
    square kernel of a model that stores others `(out, in)`).
    """
    if _own(tree):
        return _writer()[1].own(tree, prefix)
    out = {}
    for layer in torch_layers(tree, rules, prefix, rename, family, known, example):
        encoded = layer.encode(layer.leaves)
        if kinds is not None:
            kinds.update(dict.fromkeys(encoded, layer.kind))
        out.update((name, np.asarray(array)) for name, array in encoded.items())
    return out


class TorchLayer(NamedTuple):
    """One layer of a model in PyTorch layout, not converted yet: `encode(leaves)`
    gives `{PyTorch name: array}` (JAX arrays as the codecs compute them: a sharded
    array stays sharded), so that a writer converts one layer at a time, and
    `jax.eval_shape(encode, leaves)` gives the names, shapes and dtypes without
    computing anything."""

    leaves: dict[str, Any]
    encode: Callable[[dict[str, Any]], dict[str, Any]]
    kind: str = ""  # the layer's kind ("Dense", ...)


def torch_layers(
    tree: Tree,
    rules: Mapping[str, str] | None = None,
    prefix: str = "",
    rename: Rename | None = None,
    family: str | None = None,
    known: Collection[str] | None = None,
    example: Example | None = None,
) -> list[TorchLayer]:
    """`torch_state`, layer by layer and unconverted (see `TorchLayer`); the same
    errors, raised before anything is converted."""
    if _own(tree):
        own = _writer()[1].own
        return [TorchLayer({}, lambda _: own(tree, prefix))]
    problems: list[str] = []
    backwards: dict[str, str] = {}
    try:
        backwards = reverse_rules(rules or {})
    except ValueError as error:
        problems.append(str(error))
    found = find_layers(
        read_side(tree, 0, problems), problems, told=example is not None
    )
    if example is not None:  # the forward pass tells the settings left open
        computed((found, []), (Trace(tree, example, 0, problems), None), problems)
        tell_settings((found, []), problems)
    layers = _in_native_order(tree, found)
    chosen = [(layer, kind) for layer in layers if (kind := _kind(layer, problems))]
    if rename is None:
        indexed = indexed_names(tree) if chosen else {}
        names = [_name(path_str(x.path), backwards, indexed) for x, _ in chosen]
        names = fitted(names, prefix, known)
    else:
        paths = rename([layer.path for layer, _ in chosen], problems)
        names = [dotted_torch(path_str(p)) for p in paths]
    out: list[TorchLayer] = []
    owners: dict[str, list[str]] = {}
    for (layer, kind), name in zip(chosen, names):
        owners.setdefault(name, []).append(layer.where)
        leaves = layer.leaves if layer.arrays is None else layer.arrays
        encoder = _encoder(layer, kind, name, prefix, family)
        out.append(TorchLayer(dict(leaves), encoder, kind))
        if kind != ARRAY:
            _check(layer, kind, name, family, problems)
    for name, wheres in owners.items():
        if len(wheres) > 1 and rename is None:  # `rename` reports its own clashes
            problems.append(_CLASH.format(layers=wheres, name=name))
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(_CANNOT.format(n=len(problems), problems=lines))
    return out


def _encoder(
    layer: Layer, kind: str, name: str, prefix: str, family: str | None
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The function converting `layer`'s leaves to its PyTorch entries."""
    if kind == ARRAY:  # a loose array (ViT's `cls_token`): under its own name
        return lambda leaves: {prefix + name: materialise(leaves["array"])}
    adapter, writer = _writer()
    codec = codec_of(kind, adapter.name)
    assert codec is not None
    # no module: the codec's settings are those a file's reader takes from the name
    # (GPT-2's `c_attn`, `c_proj`, ... are Conv1D, weight (in, out))
    hyper = codec.hyperparameters(writer.node(name, family))

    def encode(leaves: dict[str, Any]) -> dict[str, Any]:
        leaves = {k: materialise(v) for k, v in leaves.items()}
        if layer.index is not None:  # one layer of a stack, at its layer axis
            at = (slice(None),) * layer.axis + (layer.index,)
            leaves = {k: v[at] for k, v in leaves.items()}
        canonical = layer.codec(kind).decode(leaves, layer.hyper)
        encoded = codec.encode(canonical, {}, hyper)
        encoded.update(writer.fresh.get(kind, {}))
        return {
            prefix + ".".join(filter(None, (name, entry.replace("/", ".")))): array
            for entry, array in encoded.items()
        }

    return encode


def _check(
    layer: Layer, kind: str, name: str, family: str | None, problems: list[str]
) -> None:
    """Whether the layer's PyTorch entries (shapes only, `jax.eval_shape`) are what
    its PyTorch codec recognises (a `Linear` weight is 2-D), before anything is
    written: a stack no codec read as one, a 3-D kernel under a `Linear` name."""
    adapter, writer = _writer()
    codec = codec_of(kind, adapter.name)
    assert codec is not None
    hyper = codec.hyperparameters(writer.node(name, family))
    one = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in layer.leaves.items()}
    try:
        encoded = jax.eval_shape(
            lambda x: codec.encode(layer.codec(kind).decode(x, layer.hyper), {}, hyper),
            one,
        )
    except KeyError as error:  # a layout nothing tells (a square GPT-2 name)
        setting = error.args[0] if error.args else ""
        if setting not in SETTINGS:
            raise
        shape = tuple(layer.leaves["kernel"].shape) if "kernel" in layer.leaves else ()
        problems.append(
            f"{layer.where} -> {name}: "
            + SETTINGS[setting].format(where=layer.where, shape=shape)
        )
        return
    if not codec.recognise(None, encoded):
        problems.append(
            _MALFORMED.format(
                where=layer.where,
                name=name,
                kind=kind,
                shapes={k: tuple(v.shape) for k, v in encoded.items()},
            )
        )


def _in_native_order(tree: Tree, layers: list[Layer]) -> list[Layer]:
    """`layers` in the order the model defines its arrays (`native_paths`: NNX
    attribute order, Linen dict order), as `module.state_dict()` lists a PyTorch
    model's: a file written in that order is cut into shards as `save_pretrained`
    cuts the same model's."""
    if not native_order(tree):
        return layers
    position = {path: i for i, path in enumerate(native_paths(tree))}
    end = len(position)

    def first(layer: Layer) -> int:
        base = layer.path if layer.index is None else layer.real  # a stack's arrays
        return min(
            (position.get(base + p, end) for p in layer.paths.values()), default=end
        )

    return sorted(layers, key=first)


def _kind(layer: Layer, problems: list[str]) -> str | None:
    if layer.kinds == (ARRAY,):
        return ARRAY
    name = _writer()[0].name
    kinds = tuple(k for k in layer.kinds if codec_of(k, name) is not None)
    kinds = kinds_by_name(dotted_torch(layer.where), kinds)
    if not kinds:
        problems.append(
            _NO_TORCH_CODEC.format(where=layer.where, kinds="/".join(layer.kinds))
        )
        return None
    return kinds[0]


def fitted(names: list[str], prefix: str, known: Collection[str] | None) -> list[str]:
    """Layer `names` with each that the PyTorch model written for (`known`: its
    names, `prefix` included) lacks renamed to the one layer of it that nothing is
    written under and whose name is the same once normalised, a word repeated
    next to itself said once (`_key`): Flax ResNet's `layer.layer_0`, a module
    holding its list under its own name, is PyTorch's `layer.0`. A name that fits
    none, or several, stays (the reference check lists it)."""
    if not known:
        return names
    layers = {k.rpartition(".")[0] for k in known} | set(known)
    written = {prefix + n for n in names}
    free: dict[tuple, list[str]] = {}
    for other in layers - written:
        free.setdefault(_key(other), []).append(other)
    lacking: dict[tuple, list[int]] = {}
    for i, name in enumerate(names):
        if prefix + name not in layers:
            lacking.setdefault(_key(prefix + name), []).append(i)
    out = list(names)
    for key, at in lacking.items():
        there = free.get(key, [])
        if len(at) == 1 and len(there) == 1 and there[0].startswith(prefix):
            out[at[0]] = there[0][len(prefix) :]
    return out


def _key(name: str) -> tuple:
    """A name's normalised words (`bridge._port._pairing.normalised`), a word
    repeated next to itself said once."""
    words = normalised((name,))
    return tuple(w for i, w in enumerate(words) if i == 0 or w != words[i - 1])


def indexed_names(tree: Tree) -> dict[str, str]:
    """`{keystr path: keystr path}` of the submodules `tree`'s model holds in list
    attributes, as other frameworks index them (`Adapter.listed`: Linen's
    `.layer_0` of `self.layer = [...]` is `.layer[0]`, as in an `nn.ModuleList`)."""
    return {path_str(k): path_str(v) for k, v in listed(tree).items()}


_BOUNDARY = re.compile(r"(?=[.\[])")


def _name(
    where: str, backwards: Mapping[str, str], indexed: Mapping[str, str] | None = None
) -> str:
    """A layer's PyTorch name: by the first rule read backwards that matches its
    path (`keystr` form), else its path with its longest part that `indexed`
    (`indexed_names`) holds indexed."""
    for pattern, replacement in backwards.items():
        match = re.fullmatch(pattern, where)
        if match:
            return dotted_torch(match.expand(replacement))
    if indexed:
        cuts = [m.start() for m in _BOUNDARY.finditer(where) if m.start()]
        for cut in reversed([*cuts, len(where)]):
            head = indexed.get(where[:cut])
            if head is not None:
                return dotted_torch(head + where[cut:])
    return dotted_torch(where)
