"""`bridge convert --to-layout`: a checkpoint's arrays in another framework's layout,
through the port codecs, without the model.

To Flax: an Equinox checkpoint records each module's class and settings, so each layer
a codec recognises is decoded to the canonical layout, which is Flax's (Dense kernel
`(in, out)`, HWIO convolutions, BatchNorm `mean`/`var` as `batch_stats`).

To Equinox: each layer of a Flax checkpoint (Linen or NNX) that the codecs recognise
is decoded to the canonical layout, the Equinox layer of the same kind and shapes is
built abstractly by the Equinox codec's `build` (under `jax.eval_shape`, no memory;
a codec without one is reported by path) to learn the names, shapes and roles
`bridge.from_equinox` gives it (which biases, which `State` entries), and the
Equinox codec encodes the arrays into it. Settings the arrays do not show (strides,
padding, epsilon, momentum) are recorded as Flax's defaults. Arrays in no layer
with a role never ported (NNX's RNG state) are left out: Equinox models hold none.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._adapters._native import to_native, to_neutral
from .._adapters._registry import adapter_named, canonical_adapter, names, of_layout
from .._paths import Path, parse
from .._port._codec import WRITTEN, codec_of, codecs, filled
from .._port._find import find_layers
from .._port._layer import NOT_PORTED, Layer
from .._port._side import read_side
from .._port.codecs._torch import kinds_by_name
from .._tree import Tree, native_rank
from . import _training
from ._classes import resolve
from ._contents import VERSION, Contents, Stored, dotted
from ._model import describe, file_tree
from ._torch_layout import torch_layers


LAYOUTS = ("flax", "equinox", "torch")
BATCH_NORM_MODES = ("batch", "ema")
_STATISTICS = ("mean", "var")  # the canonical BatchNorm entries: role batch_stats

_NO_EQUINOX = (
    "unsupported: {where} ({kinds}) has no Equinox counterpart a codec knows; "
    "register an Equinox codec of kind {kind!r} with a `build` "
    "(bridge.register_codec(bridge.Codec(kind={kind!r}, framework='equinox', ..., "
    "build=...)), see docs/guides/codecs.md)"
)
_NO_FLAX = (
    "unsupported: {where} ({kinds}) has no Flax counterpart: in the Flax layout its "
    "arrays would read as another layer's (a Gemma norm's x * (1 + weight) as Flax "
    "RMSNorm's x * scale). Load the file into the model itself instead: "
    "bridge.load(path, like=model)"
)
_NO_BUILD = (
    "unsupported: {where} ({kinds}): the Equinox codec of kind {kind!r} has no "
    "`build`, so the Equinox layer cannot be made without the model; give the codec "
    "a `build(canonical, options)` (see bridge.Codec)"
)
_CANNOT_CONVERT = """\
{path} cannot be converted to the {layout} layout: {n} problem(s), nothing was written.
{problems}"""
_OPTIONS_ELSEWHERE = """\
{options} only apply when converting a checkpoint to another layout (--rename: to the
Equinox or PyTorch layout; --batch-norm-mode: to the Equinox layout), and {path} is
converted from the {source} layout to the {layout} layout. Leave them out."""
_UNKNOWN_CLASS = (
    "unsupported: {where} is a {cls} in the file, a class no {framework} codec "
    "knows (it may compute something else than the layer its arrays look like); "
    "import the module that defines it and register a codec for it "
    "(bridge.register_codec, bridge.Codec.same_layout)"
)
_TRAINING_STATE = """\
{path} is a training checkpoint ({parts}): --to-layout converts a model's weights,
and the optimizer's arrays cannot follow them without the optimizer. To resume in
the other framework, load this file there directly, weights and optimizer state
ported together: bridge.load(path, like=model, opt_state_like=tx.init(...)). To
convert the weights alone, leaving the training state out, pass --weights-only
(`weights_only=True`)."""
_RENAME_UNUSED = (
    "rename '{rule}': matches no layer. A rename's PATTERN must match a layer's "
    "whole dotted path (re.fullmatch){hint}. The layers: {layers}"
)
_RENAME_PART = (
    "; it matches the start of '{name}': capture the rest and put it back, '{fix}'"
)


def _unused(rule: str, pattern: re.Pattern, replacement: str, names: list[str]) -> str:
    """The problem of a rename that fully matches no layer path: what it should
    match, and the capturing form when it matches the start of one."""
    hint = ""
    for name in names:
        if pattern.match(name):
            rest = pattern.groups + 1
            fix = f"{pattern.pattern}(.*)={replacement}\\{rest}"
            hint = _RENAME_PART.format(name=name, fix=fix)
            break
    shown = names[:8] + ([f"... {len(names)} in all"] if len(names) > 8 else [])
    return _RENAME_UNUSED.format(rule=rule, hint=hint, layers=", ".join(shown))


_RENAME_CLASH = "rename: {sources} would all be called {target!r}"


def relayout(
    contents: Contents,
    arrays: dict[str, Any],
    layout: str,
    *,
    rename: Sequence[str] = (),
    batch_norm_mode: str | None = None,
    weights_only: bool = False,
) -> tuple[Contents, dict[str, Any]]:
    """The checkpoint's `contents` and `arrays` (by dotted name) in `layout`.

    **Arguments:**

    - `contents`, `arrays`: a checkpoint, from `open_checkpoint` and `read`.
    - `layout`: `"flax"`, `"equinox"` or `"torch"`.
    - `rename`: to Equinox or PyTorch, rules `"PATTERN=PATH"`: a layer whose dotted
      path (`Dense_0`, `layers.0`) fully matches the regex `PATTERN` is stored under
      `PATH` (`re.Match.expand`: `r"Dense_(\\d+)=layers.\\1"`), so that Linen
      auto-names become the Equinox model's field names, or a PyTorch module's
      names (`r"layers\\.(\\d+)=\\1"` for an `nn.Sequential`). The first rule that
      matches wins; a rename from one conversion is undone by its reverse rule.
    - `batch_norm_mode`: to Equinox only, the `mode` of the Equinox `BatchNorm`s:
      `"batch"` (the default: the statistics as they are, `batch_counter` `2**30` so
      that inference uses them unchanged) or `"ema"`.
    - `weights_only`: leave a training checkpoint's training state (optimizer
      state, step, extras) out and convert its weights; without it, a training
      checkpoint is refused.

    **Returns:**

    New `(contents, arrays)`: unchanged when the file is in `layout` already.

    **Raises:**

    `ValueError`, once, listing every layer no codec knows (by path) and every unused,
    malformed or clashing rename; `ValueError` for an unknown layout or mode,
    `rename`/`batch_norm_mode` given for a conversion they do not apply to, or a
    training checkpoint without `weights_only`.

    **Example:**

    ```python
    >>> import bridge, tempfile, os
    >>> from flax import nnx
    >>> from bridge._io._read import open_checkpoint, read
    >>> path = os.path.join(tempfile.mkdtemp(), "linear.safetensors")
    >>> bridge.save(path, nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> contents = open_checkpoint(path)
    >>> converted, arrays = relayout(contents, read(contents), "equinox")
    >>> converted.framework, arrays["weight"].shape
    ('equinox', (3, 2))

    ```
    """
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown layout {layout!r}: choose one of {LAYOUTS}.")
    if batch_norm_mode not in (None, *BATCH_NORM_MODES):
        raise ValueError(
            f"Unknown BatchNorm mode {batch_norm_mode!r}: choose one of "
            f"{BATCH_NORM_MODES}."
        )
    changes = contents.layout != layout
    options = [
        o
        for o, v, to in [
            ("--rename", rename, ("equinox", "torch")),
            ("--batch-norm-mode", batch_norm_mode, ("equinox",)),
        ]
        if v and not (changes and layout in to)
    ]
    if options:
        raise ValueError(
            _OPTIONS_ELSEWHERE.format(
                options=" and ".join(options),
                path=contents.path,
                source=contents.layout or "unknown",
                layout=layout,
            )
        )
    if contents.layout == layout:
        return contents, arrays
    if contents.training:
        if not weights_only:
            parts = ", ".join(_training.summary(contents, lambda n: f"{n} B")[:2])
            raise ValueError(_TRAINING_STATE.format(path=contents.path, parts=parts))
        contents, arrays = model_only(contents, arrays)
    tree = file_tree(contents, arrays)
    rank = native_rank(tree)
    if layout == "torch":
        return _to_torch(contents, tree, rename, arrays)
    problems: list[str] = []
    layers = find_layers(read_side(tree, 0, problems), problems, loose=False)
    layers.sort(key=lambda layer: rank(layer.path))  # written in the file's order
    _unknown_classes(contents, layers, problems)
    if contents.layout == "torch":  # no classes: names decide between candidates
        for layer in layers:
            kinds = kinds_by_name(dotted(layer.path), layer.kinds)
            layer.codecs = tuple(c for c in layer.codecs if c.kind in kinds)
    if layout == "equinox":
        mode = batch_norm_mode or "batch"
        return _to_equinox(contents, layers, problems, rename, mode)
    flax = canonical_adapter().name
    for layer in layers:
        if all(_counterpart(kind, flax) is None for kind in layer.kinds):
            kinds = "/".join(layer.kinds)
            problems.append(_NO_FLAX.format(where=layer.where, kinds=kinds))
    _raise(contents, "Flax", problems)
    return _to_flax(contents, arrays, layers)


def model_only(
    contents: Contents, arrays: dict[str, Any]
) -> tuple[Contents, dict[str, Any]]:
    """A training checkpoint's model alone: its optimizer state, step and extras
    left out."""
    model, _ = _training.split(contents)
    model = dataclasses.replace(model, training="")
    return model, {s.key: arrays[s.key] for s in model.tensors}


def _unknown_classes(
    contents: Contents, layers: list[Layer], problems: list[str]
) -> None:
    """A layer the file records the class of is converted only when a codec of the
    file's framework knows that class: arrays alone do not tell a Gemma
    `x * (1 + scale)` norm from Flax's RMSNorm."""
    recorded = {tuple(path): cls for path, cls, _ in contents.modules}
    fw = contents.framework
    if fw not in names() or not adapter_named(fw).records_classes:
        return
    for layer in layers:
        name = recorded.get(layer.path)
        if name is None:
            continue
        cls = resolve(name)
        if cls is None or not any(c.recognise(cls, layer.leaves) for c in codecs(fw)):
            problems.append(
                _UNKNOWN_CLASS.format(where=layer.where, cls=name, framework=fw)
            )


def _to_flax(contents: Contents, arrays: dict[str, Any], layers: list[Layer]):
    stored = {s.path: s for s in contents.tensors}
    tensors: list[Stored] = []
    out: dict[str, Any] = {}
    groups: list[tuple[list[str], list[str]]] = []
    for layer in layers:
        canonical = layer.codecs[0].decode(layer.leaves, layer.hyper)
        written = len(tensors)
        for name, array in canonical.items():
            role = "batch_stats" if name in _STATISTICS else "params"
            path = layer.path + parse(name, "/")
            _add(out, tensors, path, role, array)
        sources = [stored.pop(layer.path + p).key for p in layer.paths.values()]
        groups.append((sources, [s.key for s in tensors[written:]]))
    for s in stored.values():  # what no layer holds (RNG state): as it is
        if s.role in NOT_PORTED:  # PyTorch's num_batches_tracked
            continue
        tensors.append(s)
        out[s.key] = arrays[s.key]
        groups.append(([s.key], [s.key]))
    order = _carried(contents, groups)
    return _contents(contents, None, "flax", (), tensors, order), out


def _to_torch(
    contents: Contents, tree: Tree, rename: Sequence[str], given: dict[str, Any]
) -> tuple[Contents, dict[str, Any]]:
    def renamed(paths: list[Path], problems: list[str]) -> list[Path]:
        return _renamed(paths, rename, problems)

    arrays: dict[str, Any] = {}
    groups: list[tuple[list[str], list[str]]] = []
    names = {id(array): name for name, array in given.items()}  # the tree's leaves
    for layer in torch_layers(tree, rename=renamed if rename else None):
        encoded = layer.encode(layer.leaves)
        arrays.update((name, np.asarray(array)) for name, array in encoded.items())
        sources = [names[id(a)] for a in layer.leaves.values() if id(a) in names]
        groups.append((sources, list(encoded)))
    role_of = of_layout("torch").role_of or (lambda name: "params")
    tensors = [
        Stored(
            name,
            parse(name, "."),
            role_of(name),
            tuple(a.shape),
            str(a.dtype),
        )
        for name, a in arrays.items()
    ]
    order = _carried(contents, groups)
    converted = _contents(contents, "torch", "torch", (), tensors, order)
    metadata = {**converted.metadata, "format": "pt"}
    return dataclasses.replace(converted, metadata=metadata), arrays


def _to_equinox(
    contents: Contents,
    layers: list[Layer],
    problems: list[str],
    rename: Sequence[str],
    mode: str,
):
    chosen = [(layer, _equinox_kind(layer, problems)) for layer in layers]
    paths = _renamed([layer.path for layer in layers], rename, problems)
    _raise(contents, "Equinox", problems)
    tensors: list[Stored] = []
    modules: list[tuple[Path, str, dict[str, Any]]] = []
    out: dict[str, Any] = {}
    groups: list[tuple[list[str], list[str]]] = []
    for (layer, kind), path in zip(chosen, paths):
        described, encoded = _encode_layer(layer, kind, mode)
        written = len(tensors)
        for s in described.tensors:
            _add(
                out, tensors, path + s.path, s.role, encoded["/".join(map(str, s.path))]
            )
        modules += [(path + p, cls, fields) for p, cls, fields in described.modules]
        sources = [dotted(layer.path + p) for p in layer.paths.values()]
        groups.append((sources, [s.key for s in tensors[written:]]))
    order = _carried(contents, groups)
    converted = _contents(
        contents, "equinox", "equinox", tuple(modules), tensors, order
    )
    return converted, out


def _encode_layer(layer: Layer, kind: str, mode: str) -> tuple[Contents, dict]:
    """What `bridge.save` writes for the Equinox layer of this kind and shapes (built
    abstractly), and the layer's arrays encoded into it by the Equinox codec."""
    flax, equinox = layer.codec(kind), codec_of(kind, "equinox")
    assert equinox is not None and equinox.build is not None  # _equinox_kind checked
    build, options = equinox.build, {"batch_norm_mode": mode}
    canonical = flax.decode(layer.leaves, layer.hyper)
    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in canonical.items()}
    target: Tree = jax.eval_shape(lambda: to_neutral(build(specs, options)))
    described, flat = describe(target, None)
    like = {"/".join(map(str, s.path)): flat[s.key] for s in described.tensors}
    native = to_native(target)
    hyper = equinox.hyperparameters(native[0] if isinstance(native, tuple) else native)
    decode = equinox.decode
    needed = jax.eval_shape(lambda leaves: decode(leaves, hyper), like)
    canonical = filled(canonical, needed, equinox.defaults)  # e.g. scale/bias absent
    return described, equinox.encode(canonical, like, hyper)


def _raise(contents: Contents, layout: str, problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            _CANNOT_CONVERT.format(
                path=contents.path, layout=layout, n=len(problems), problems=lines
            )
        )


def _equinox_kind(layer: Layer, problems: list[str]) -> str:
    """The kind to build: a Linen layer named in `setup` may fit several kinds whose
    Equinox arrays are the same (`Conv` or `ConvTranspose`, `LayerNorm` or
    `GroupNorm`); the kind whose Equinox codec was registered first is recorded."""
    order = [c.kind for c in reversed(codecs("equinox")) if c.layout != WRITTEN]
    known = sorted((k for k in layer.kinds if k in order), key=order.index)
    buildable = [k for k in known if _builds(k)]
    if buildable:
        return buildable[0]
    names = dict(where=layer.where, kinds="/".join(layer.kinds))
    if known:
        problems.append(_NO_BUILD.format(kind=known[0], **names))
    else:
        problems.append(_NO_EQUINOX.format(kind=layer.kinds[0], **names))
    return ""


def _counterpart(kind: str, framework: str) -> Any:
    """The codec of `kind` in `framework` that stands for a layer of that framework
    (None for one that reads only modules written by hand: `WRITTEN`)."""
    codec = codec_of(kind, framework)
    return None if codec is None or codec.layout == WRITTEN else codec


def _builds(kind: str) -> bool:
    codec = codec_of(kind, "equinox")
    return codec is not None and codec.build is not None


def _renamed(paths: list[Path], rename: Sequence[str], problems: list[str]):
    """Each layer path after the first `rename` rule that fully matches it."""
    rules = []
    for rule in rename:
        pattern, sep, replacement = rule.partition("=")
        if not sep:
            problems.append(f"rename {rule!r}: expected PATTERN=PATH")
            continue
        try:
            rules.append((rule, re.compile(pattern), replacement))
        except re.error as error:
            problems.append(f"rename {rule!r}: PATTERN is not a regex: {error}")
    used: set[str] = set()
    out: list[Path] = []
    for path in paths:
        name = dotted(path)
        for rule, pattern, replacement in rules:
            match = pattern.fullmatch(name)
            if match:
                used.add(rule)
                try:
                    name = match.expand(replacement)
                except re.error as error:
                    problems.append(f"rename {rule!r}: bad PATH: {error}")
                break
        out.append(parse(name) if name else ())  # "": the root
    for rule, pattern, replacement in rules:
        if rule not in used:
            names = [dotted(p) for p in paths]
            problems.append(_unused(rule, pattern, replacement, names))
    by_target: dict[Path, list[str]] = {}
    for old, new in zip(paths, out):
        by_target.setdefault(new, []).append(dotted(old))
    for new, olds in by_target.items():
        if len(olds) > 1:
            problems.append(_RENAME_CLASH.format(sources=olds, target=dotted(new)))
    return out


def _add(out: dict, tensors: list[Stored], path: Path, role: str, array: Any) -> None:
    name = dotted(path)
    out[name] = array
    tensors.append(Stored(name, path, role, np.shape(array), str(array.dtype)))


def _contents(contents: Contents, fw, layout, modules, tensors, order) -> Contents:
    return Contents(
        contents.path,
        contents.format,
        fw,
        layout,
        VERSION,
        modules,
        contents.metadata,
        tuple(tensors),
        order=order,
    )


def _carried(
    contents: Contents, groups: list[tuple[list[str], list[str]]]
) -> tuple[str, ...]:
    """The order of use `contents` records (`Contents.order`), for the converted
    arrays: `groups` pairs each layer's names in `contents` with the names its
    arrays are written under, which take the rank of the layer's first array used
    (a layer's arrays are used together), in the order written; arrays of a layer
    the record does not name are left out of it."""
    if not contents.order:
        return ()
    rank = {name: i for i, name in enumerate(contents.order)}
    ranked = []
    for sources, written in groups:
        first = min((rank[s] for s in sources if s in rank), default=None)
        if first is not None:
            ranked += [(first, k, name) for k, name in enumerate(written)]
    return tuple(name for *_, name in sorted(ranked))
