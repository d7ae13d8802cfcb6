"""`bridge convert --to-layout`: a checkpoint's arrays in another framework's layout,
through the port codecs, without the model.

To Flax: an Equinox checkpoint records each module's class and settings, so each layer
a codec recognises is decoded to the canonical layout, which is Flax's (Dense kernel
`(in, out)`, HWIO convolutions, BatchNorm `mean`/`var` as `batch_stats`).

To Equinox: each layer of a Flax checkpoint (Linen or NNX) that the codecs recognise
is decoded to the canonical layout, the Equinox layer of the same kind and shapes is
built abstractly (`jax.eval_shape`, no memory) to learn the names, shapes and roles
`bridge.from_equinox` gives it (which biases, which `State` entries), and the
Equinox codec encodes the arrays into it. Settings the arrays do not show (strides,
padding, epsilon, momentum) are recorded as Flax's defaults. Arrays in no layer
with a role never ported (NNX's RNG state) are left out: Equinox models hold none.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._adapters._equinox import from_equinox
from .._adapters._native import to_native
from .._paths import Path, parse
from .._port._codec import codec_of
from .._port._layers import Layer, find_layers
from .._tree import Tree
from ._checkpoint import VERSION, Contents, Stored, describe, dotted, file_tree


LAYOUTS = ("flax", "equinox")
BATCH_NORM_MODES = ("batch", "ema")
_STATISTICS = ("mean", "var")  # the canonical BatchNorm entries: role batch_stats

_NO_EQUINOX = (
    "unsupported: {where} ({kinds}) has no Equinox counterpart a codec knows; "
    "register an Equinox codec for it (bridge.register_codec)"
)
_CANNOT_CONVERT = """\
{path} cannot be converted to the {layout} layout: {n} problem(s), nothing was written.
{problems}"""
_EQUINOX_ONLY = """\
{options} only apply when converting a Flax checkpoint to the Equinox layout, and
{path} is converted from the {source} layout to the {layout} layout. Leave them out."""
_RENAME_UNUSED = "rename {rule!r}: matches no layer (layers: {layers})"
_RENAME_CLASH = "rename: {sources} would all be called {target!r}"

_BUILDS: dict[str, Callable[[dict[str, Any], str], Any]] = {}


def _build(kind: str):
    def register(fn):
        _BUILDS[kind] = fn
        return fn

    return register


@_build("Dense")
def _dense(c, mode):
    (n_in, n_out), dtype = c["kernel"].shape, c["kernel"].dtype
    return eqx.nn.Linear(
        n_in, n_out, use_bias="bias" in c, dtype=dtype, key=jax.random.key(0)
    )


def _conv_args(c) -> tuple[int, dict[str, Any]]:
    """The number of spatial dimensions, and the arguments of an Equinox convolution."""
    kernel = c["kernel"]
    *size, n_in, n_out = kernel.shape
    return len(size), dict(
        in_channels=n_in,
        out_channels=n_out,
        kernel_size=tuple(size),
        use_bias="bias" in c,
        dtype=kernel.dtype,
        key=jax.random.key(0),
    )


# the classes an Equinox model of 1, 2 or 3 spatial dimensions uses (bridge.save
# records them)
_CONVS = {1: eqx.nn.Conv1d, 2: eqx.nn.Conv2d, 3: eqx.nn.Conv3d}
_CONV_TRANSPOSES = {
    1: eqx.nn.ConvTranspose1d,
    2: eqx.nn.ConvTranspose2d,
    3: eqx.nn.ConvTranspose3d,
}


@_build("Conv")
def _conv(c, mode):
    n, args = _conv_args(c)
    return _CONVS[n](**args, padding="SAME")


@_build("ConvTranspose")
def _conv_transpose(c, mode):
    n, args = _conv_args(c)
    return _CONV_TRANSPOSES[n](**args)


@_build("Embed")
def _embed(c, mode):
    table = c["embedding"]
    return eqx.nn.Embedding(*table.shape, dtype=table.dtype, key=jax.random.key(0))


def _affine(c):
    ref = c.get("scale", c.get("bias"))
    return dict(use_weight="scale" in c, use_bias="bias" in c, dtype=ref.dtype), ref


@_build("LayerNorm")
def _layer_norm(c, mode):
    args, ref = _affine(c)
    return eqx.nn.LayerNorm(ref.shape, eps=1e-6, **args)


@_build("RMSNorm")
def _rms_norm(c, mode):
    args, ref = _affine(c)
    return eqx.nn.RMSNorm(ref.shape, eps=1e-6, **args)


@_build("GroupNorm")
def _group_norm(c, mode):
    ref = c.get("scale", c.get("bias"))
    (channels,) = ref.shape
    groups = 32 if channels % 32 == 0 else 1  # Flax's default when it divides
    return eqx.nn.GroupNorm(
        groups, channels, eps=1e-6, channelwise_affine=bool(c), dtype=ref.dtype
    )


@_build("BatchNorm")
def _batch_norm(c, mode):
    mean = c["mean"]
    return eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        mean.shape[0],
        "batch",
        channelwise_affine="scale" in c or "bias" in c,
        momentum=0.99,
        mode=mode,
        dtype=c.get("scale", mean).dtype,
    )


@_build("MultiHeadAttention")
def _attention(c, mode):
    query, value, out = c["query/kernel"], c["value/kernel"], c["out/kernel"]
    return eqx.nn.MultiheadAttention(
        num_heads=query.shape[1],
        query_size=query.shape[0],
        key_size=c["key/kernel"].shape[0],
        value_size=value.shape[0],
        output_size=out.shape[-1],
        qk_size=query.shape[2],
        vo_size=value.shape[2],
        use_query_bias="query/bias" in c,
        use_key_bias="key/bias" in c,
        use_value_bias="value/bias" in c,
        use_output_bias="out/bias" in c,
        dtype=query.dtype,
        key=jax.random.key(0),
    )


def relayout(
    contents: Contents,
    arrays: dict[str, Any],
    layout: str,
    *,
    rename: Sequence[str] = (),
    batch_norm_mode: str | None = None,
) -> tuple[Contents, dict[str, Any]]:
    """The checkpoint's `contents` and `arrays` (by dotted name) in `layout`.

    **Arguments:**

    - `contents`, `arrays`: a checkpoint, from `open_checkpoint` and `read`.
    - `layout`: `"flax"` or `"equinox"`.
    - `rename`: to Equinox only, rules `"PATTERN=PATH"`: a layer whose dotted path
      (`Dense_0`, `layers.0`) fully matches the regex `PATTERN` is stored under `PATH`
      (`re.Match.expand`: `r"Dense_(\\d+)=layers.\\1"`), so that Linen auto-names
      become the Equinox model's field names.
    - `batch_norm_mode`: to Equinox only, the `mode` of the Equinox `BatchNorm`s:
      `"batch"` (the default: the statistics as they are, `batch_counter` `2**30` so
      that inference uses them unchanged) or `"ema"`.

    **Returns:**

    New `(contents, arrays)`: unchanged when the file is in `layout` already.

    **Raises:**

    `ValueError`, once, listing every layer no codec knows (by path) and every unused,
    malformed or clashing rename; `ValueError` for an unknown layout or mode, or
    `rename`/`batch_norm_mode` given for another conversion than Flax to Equinox.

    **Example:**

    ```python
    >>> import bridge, tempfile, os
    >>> from flax import nnx
    >>> from bridge._io._checkpoint import open_checkpoint, read
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
    options = [
        o
        for o, v in [("--rename", rename), ("--batch-norm-mode", batch_norm_mode)]
        if v
    ]
    if options and (layout != "equinox" or contents.layout == "equinox"):
        raise ValueError(
            _EQUINOX_ONLY.format(
                options=" and ".join(options),
                path=contents.path,
                source=contents.layout or "unknown",
                layout=layout,
            )
        )
    if contents.layout == layout:
        return contents, arrays
    tree = file_tree(contents, arrays)
    problems: list[str] = []
    layers = find_layers(tree, problems)
    if layout == "equinox":
        mode = batch_norm_mode or "batch"
        return _to_equinox(contents, layers, problems, rename, mode)
    _raise(contents, "Flax", problems)
    return _to_flax(contents, arrays, layers)


def _to_flax(contents: Contents, arrays: dict[str, Any], layers: list[Layer]):
    stored = {s.path: s for s in contents.tensors}
    tensors: list[Stored] = []
    out: dict[str, Any] = {}
    for layer in layers:
        canonical = layer.codecs[0].decode(layer.leaves, layer.hyper)
        for name, array in canonical.items():
            role = "batch_stats" if name in _STATISTICS else "params"
            path = layer.path + parse(name, "/")
            _add(out, tensors, path, role, array)
        for relative in layer.paths.values():
            stored.pop(layer.path + relative)
    for s in stored.values():  # what no layer holds (RNG state): as it is
        tensors.append(s)
        out[s.key] = arrays[s.key]
    return _contents(contents, None, "flax", (), tensors), out


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
    for (layer, kind), path in zip(chosen, paths):
        described, encoded = _encode_layer(layer, kind, mode)
        for s in described.tensors:
            _add(
                out, tensors, path + s.path, s.role, encoded["/".join(map(str, s.path))]
            )
        modules += [(path + p, cls, fields) for p, cls, fields in described.modules]
    return _contents(contents, "equinox", "equinox", tuple(modules), tensors), out


def _encode_layer(layer: Layer, kind: str, mode: str) -> tuple[Contents, dict]:
    """What `bridge.save` writes for the Equinox layer of this kind and shapes (built
    abstractly), and the layer's arrays encoded into it by the Equinox codec."""
    flax, equinox = layer.codec(kind), codec_of(kind, "equinox")
    assert equinox is not None  # _equinox_kind checked it
    canonical = flax.decode(layer.leaves, layer.hyper)
    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in canonical.items()}
    target: Tree = jax.eval_shape(lambda: _neutral(_BUILDS[kind](specs, mode)))
    described, flat = describe(target, None)
    like = {"/".join(map(str, s.path)): flat[s.key] for s in described.tensors}
    native = to_native(target)
    hyper = equinox.hyperparameters(native[0] if isinstance(native, tuple) else native)
    decode = equinox.decode
    needed = jax.eval_shape(lambda leaves: decode(leaves, hyper), like)
    for name, value in equinox.defaults.items():  # e.g. one of scale/bias absent
        if name in needed and name not in canonical:
            canonical[name] = jnp.full(needed[name].shape, value, needed[name].dtype)
    return described, equinox.encode(canonical, like, hyper)


def _raise(contents: Contents, layout: str, problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            _CANNOT_CONVERT.format(
                path=contents.path, layout=layout, n=len(problems), problems=lines
            )
        )


def _neutral(built: Any) -> Tree:
    return from_equinox(*built) if isinstance(built, tuple) else from_equinox(built)


def _equinox_kind(layer: Layer, problems: list[str]) -> str:
    """The kind to build: a Linen layer named in `setup` may fit several kinds whose
    Equinox arrays are the same (`Conv` or `ConvTranspose`, `LayerNorm` or
    `GroupNorm`); the first in `_BUILDS` order is recorded."""
    kinds = [k for k in _BUILDS if k in layer.kinds and codec_of(k, "equinox")]
    if not kinds:
        kinds_text = "/".join(layer.kinds)
        problems.append(_NO_EQUINOX.format(where=layer.where, kinds=kinds_text))
        return ""
    return kinds[0]


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
    for rule, _, _ in rules:
        if rule not in used:
            layers = [dotted(p) for p in paths]
            problems.append(_RENAME_UNUSED.format(rule=rule, layers=layers))
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


def _contents(contents: Contents, fw, layout, modules, tensors) -> Contents:
    return Contents(
        contents.path,
        contents.format,
        fw,
        layout,
        VERSION,
        modules,
        contents.metadata,
        tuple(tensors),
    )
