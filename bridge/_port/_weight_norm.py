"""A weight-normed layer seen as a plain one: `g * v / ||v||` pairs with a `weight`.

A weight-normed `Conv`, `ConvTranspose` or `Dense` (kinds `WeightNormConv`,
`WeightNormConvTranspose`, `WeightNormDense`: `codecs/_weight_norm.py`) pairs with
another weight-normed layer by its own kind, `v` and `g` carried as they are (their
layouts changed, no arithmetic: bit-exact). It is also a candidate of the plain kind,
through a view (`folded`):

- decoded, its kernel is `g * (v / ||v||)`, the norm over the axes where `g` has
  length 1, as `torch._weight_norm` computes it: the weight the layer computes with;
- encoded from a plain kernel `w`, `v = w` and `g = ||w||` over the same axes: the
  standard decomposition, a re-parametrisation (the layer computes `w` again, up to
  rounding), never a copy of arrays the source does not have. Where `||w|| = 0` (an
  all-zero output row), `v` is ones and `g = 0`: the layer computes the zeros
  (`v = 0` would make it compute `0 * 0 / 0`, NaN).

Flax modules holding `weight_v`/`weight_g` store `v` in the axis order their code
reads it in (transformers' `FlaxConvWithWeightNorm`: `(out, in, k)`, transposed before
the convolution). `read_axes` takes that order from the forward pass on the example
inputs (the convolution or product the changed weight feeds); without one, in PyTorch's
order `(out, in, *spatial)`, whose names `weight_v`/`weight_g` are (a `bias` that
does not fit it is refused).
"""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp

from .._adapters._registry import CANONICAL_LAYOUT, TORCH_LAYOUT, layout_of
from .._paths import Path
from . import _errors, _shapes
from ._codec import Codec, Leaves, codec_of
from ._layer import ARRAY, Layer, read_specs
from .codecs._weight_norm import (
    LINEN_SCALE,
    WEIGHT_NORM,
    WEIGHT_NORM_CONV_TRANSPOSE,
)


_PLAIN = {wn: plain for plain, wn in WEIGHT_NORM.items()}
_VIEWS: dict[int, Codec] = {}
_OF: dict[int, Codec] = {}  # a view's id -> the weight-norm codec it views


def _norm(x: Any, scale_shape: tuple[int, ...]) -> Any:
    """`||x||` over the axes where `scale_shape` is 1, kept as axes of length 1."""
    axes = tuple(a for a, n in enumerate(scale_shape) if n == 1)
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=axes, keepdims=True))


def folded(codec: Codec) -> Codec:
    """The plain-kind view (`Conv`, `Dense`) of a weight-norm codec."""
    view = _VIEWS.get(id(codec))
    if view is not None:
        return view

    def decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        canonical = codec.decode(leaves, hyper)
        v, g = jnp.asarray(canonical.pop("kernel")), canonical.pop("scale")
        canonical["kernel"] = v * (g / _norm(v, tuple(g.shape)))
        return canonical

    def encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
        spec = _shapes.decoded(codec, like, hyper)
        w = jnp.asarray(canonical["kernel"])
        norm = _norm(w, tuple(spec["scale"].shape))
        # where ||w|| = 0, `v = w` would compute 0 * 0 / 0 = NaN: any nonzero `v`
        # with `g = 0` computes the zeros
        v = jnp.where(norm == 0, jnp.ones_like(w), w)
        g = norm.astype(spec["scale"].dtype)
        return codec.encode({**canonical, "kernel": v, "scale": g}, like, hyper)

    view = Codec(
        _PLAIN[codec.kind],
        codec.framework,
        lambda cls, leaves: False,  # offered by `with_folded`, never recognised
        decode,
        encode,
        codec.hyperparameters,
        layout=f"{codec.layout}; weight = g * v / ||v||".lstrip("; "),
        defaults=codec.defaults,
    )
    _VIEWS[id(codec)] = view
    _OF[id(view)] = codec
    return view


def is_folded(codec: Codec) -> bool:
    """Whether `codec` is the plain-kind view of a weight-normed layer."""
    return id(codec) in _OF


def with_folded(codecs: tuple[Codec, ...]) -> tuple[Codec, ...]:
    """`codecs` with the plain-kind view of a weight-norm candidate, after it (so
    that two weight-normed layers pair by their own kind)."""
    out = list(codecs)
    for codec in codecs:
        plain = _PLAIN.get(codec.kind)
        if plain is not None and plain not in {c.kind for c in codecs}:
            out.append(folded(codec))
    return tuple(out)


def read_axes(layers: list[Layer], trace: Any, problems: list[str]) -> list[Layer]:
    """Each weight-normed layer's `v` axes as the forward pass reads them: the
    convolution (or product) that the weight computed from `v` element by element
    feeds, as its stored axes `(out, in, *spatial)`.

    A layer wrapped by Linen's `nn.WeightNorm` whose scale's length fits several
    kernel axes takes its `feature_axes` from the axis the pass reshapes the scale
    to (`Trace.scale_axes`), else stays unknown (refused).

    A Flax layer takes them (`hyper["axes"]`); it is read in PyTorch's order
    without them. Returns the layers told other axes than that (their shapes are to
    be read again: `_layer.read_specs`). A Flax layer whose `bias` does not fit
    PyTorch's order and whose axes the pass does not tell is a problem; so is a
    PyTorch layer read as a convolution whose weight the pass convolves transposed
    (or as a `ConvTranspose` whose weight it convolves plainly): either loses its
    weight-norm kinds."""
    told = []
    for x in layers:
        if "feature_axes" in x.unknown.values() and LINEN_SCALE in x.held:
            axis = None if trace is None or not trace() else trace.scale_axes()
            axis = None if axis is None else axis.get(x.held[LINEN_SCALE])
            if axis is not None:
                x.hyper["feature_axes"] = (axis,)
                told.append(x)
            continue
        codec = next((c for c in x.codecs if c.kind in _PLAIN), None)
        v = next((n for n in _V if n in x.leaves), None)
        layout = None if codec is None else layout_of(codec.framework)
        if codec is None or v is None or layout not in (CANONICAL_LAYOUT, TORCH_LAYOUT):
            continue
        base = x.real if x.index is not None else x.path
        path = base + x.paths.get(v, (v,))
        axes = _traced(x, trace, path, v)
        plain = axes is None or axes == tuple(range(len(axes)))
        if layout == CANONICAL_LAYOUT:
            if not _transposed(x, trace, path, axes, problems):
                continue
            if "turned" in x.hyper:  # read again as the pass reads it
                told.append(x)
                continue
        if layout == TORCH_LAYOUT:
            if codec.kind == WEIGHT_NORM["ConvTranspose"]:  # (in, out, *k) read
                if axes is not None and axes[:2] != (1, 0):
                    problems.append(
                        _errors.PLAIN_WEIGHT_NORM_TRANSPOSE.format(where=x.where)
                    )
                    _drop(x)
            elif not plain:
                problems.append(_errors.TRANSPOSED_WEIGHT_NORM.format(where=x.where))
                _drop(x)
            continue
        if not plain:
            x.hyper["axes"] = axes
            told.append(x)
        elif "axes" in x.unknown.values():
            problems.append(
                _errors.WEIGHT_NORM_AXES.format(
                    where=x.where,
                    shape=tuple(x.leaves[v].shape),
                    bias=tuple(x.leaves["bias"].shape),
                    why=_NO_EXAMPLE if trace is None else _NOT_SEEN,
                )
            )
            _drop(x)
    return told


def _transposed(
    x: Layer, trace: Any, path: Any, axes: tuple[int, ...] | None, problems: list[str]
) -> bool:
    """Whether a Flax layer holding `weight_v` (recognised as a `Conv`) is still to
    be read (its `v` axes): where the pass applies the weight transposed
    (`Trace.transposed`), it becomes a `ConvTranspose` (`hyper["turned"]`: whether
    the pass reverses its kernel axes first; `hyper["axes"]` as the pass reads
    them). A pass that reverses some kernel axes and not others, or a channel
    axis, is a problem."""
    turned = None
    if axes is not None and len(axes) >= 3:
        turned = trace.transposed().get(path)
    if turned is None:
        return True
    if x.index is not None:
        turned = frozenset(a - (a > x.axis) for a in turned)
    assert axes is not None
    if turned and turned != set(axes[2:]):
        problems.append(
            _errors.REVERSED_WEIGHT_NORM.format(
                where=x.where, axes=sorted(turned), kernel=axes[2:]
            )
        )
        _drop(x)
        return False
    _as_transposed(x)
    x.hyper["turned"] = bool(turned)
    x.hyper["axes"] = axes
    return True


def _as_transposed(x: Layer) -> None:
    """`x`'s weight-normed `Conv` codecs (and their view) replaced by its
    framework's `ConvTranspose` ones."""
    transposed = {c.framework: c for c in WEIGHT_NORM_CONV_TRANSPOSE}
    codecs = []
    for c in x.codecs:
        if c.kind == WEIGHT_NORM["Conv"]:
            c = transposed[c.framework]
        elif is_folded(c) and c.kind == "Conv":
            c = folded(transposed[c.framework])
        codecs.append(c)
    for kind in ("Conv", WEIGHT_NORM["Conv"]):
        x.unknown.pop(kind, None)
        x.specs.pop(kind, None)
    x.codecs = tuple(codecs)


def _drop(x: Layer) -> None:
    """`x` without its weight-norm kinds (and their unknown settings)."""
    gone = {c.kind for c in x.codecs if c.kind in _PLAIN or is_folded(c)}
    x.codecs = tuple(c for c in x.codecs if c.kind not in gone)
    for k in gone:
        x.unknown.pop(k, None)


_V = ("weight_v", "parametrizations/weight/original1")
"""The entry holding `v` (Flax's and PyTorch's old hook; PyTorch's parametrization)."""
_NO_EXAMPLE = (
    "Give example inputs (example=(x,)): the forward pass shows which axes its "
    "convolution (or product) reads."
)
_NOT_SEEN = (
    "The forward pass on the example inputs convolves (or multiplies) no weight "
    "computed from it element by element."
)
"""The frameworks whose weight-norm codecs read `v`'s axes from the forward pass."""


def _traced(x: Layer, trace: Any, path: Any, v: str) -> tuple[int, ...] | None:
    """`v`'s stored axes as `(out, in, *spatial)` where the pass tells them."""
    if trace is None or not trace():
        return None
    axis = x.axis if x.index is not None else None
    rank = len(x.leaves[v].shape)
    kernel = trace.kernels().get(path)
    if kernel is not None and rank >= 3:
        found = tuple(kernel)
    else:
        contraction = trace.contractions().get(path)
        if contraction is None or rank != 2 or contraction.batch:
            return None
        if len(contraction.inputs) != 1 or len(contraction.outputs) != 1:
            return None
        found = (contraction.outputs[0], contraction.inputs[0])
    if axis is not None:
        found = tuple(a - (a > axis) for a in found)
    return found if sorted(found) == list(range(rank)) else None


_LINEN_SCALE_KEY = re.compile(r"^(.+)/([^/]+)/scale$")
"""The key Linen's `nn.WeightNorm` keeps a wrapped layer's scale under, in its own
scope: `<layer name>/<array path>/scale`."""


def linen_weight_norms(
    layers: list[Layer], framework: str, problems: list[str]
) -> None:
    """Linen layers wrapped by `nn.WeightNorm` made weight-normed layers, in place.

    `nn.WeightNorm(nn.Dense(4))` keeps the `Dense`'s `kernel` (`v`) and `bias` where
    the `Dense` is (`Dense_0`), and the scale (`g`) in its own scope, keyed by the
    `Dense`'s name (`WeightNorm_0/'Dense_0/kernel/scale'`), a loose array by
    itself. The sibling layer of that name becomes a `WeightNorm{Dense,Conv,
    ConvTranspose}` (of its candidate kinds) holding the scale (`Layer.held`), and
    the loose array goes. A wrapper normalising other arrays than the `kernel` (a
    `variable_filter` matching the bias) is a problem; a scale whose layer is not
    a sibling stays a loose array (unpaired: refused, never ported apart)."""
    at_path = {x.path: x for x in layers if x.index is None}
    scales: dict[Path, dict[str, Layer]] = {}
    for x in layers:
        match = _LINEN_SCALE_KEY.match(str(x.path[-1])) if x.path else None
        if x.kinds != (ARRAY,) or x.index is not None or match is None:
            continue
        wrapped = x.path[:-2] + tuple(match.group(1).split("/"))
        if wrapped in at_path:
            scales.setdefault(wrapped, {})[match.group(2)] = x
    for path, found in scales.items():
        layer = at_path[path]
        if set(found) != {"kernel"}:
            problems.append(
                _errors.LINEN_WEIGHT_NORM.format(where=layer.where, names=sorted(found))
            )
            continue
        scale = found["kernel"]
        kinds = [WEIGHT_NORM[k] for k in layer.kinds if k in WEIGHT_NORM]
        wrapped_codecs = tuple(c for k in kinds if (c := codec_of(k, framework)))
        if not wrapped_codecs or "kernel" not in layer.leaves:
            continue
        new = Layer(
            layer.path,
            with_folded(wrapped_codecs),
            {**layer.leaves, LINEN_SCALE: scale.leaves["array"]},
            {**layer.paths, LINEN_SCALE: (LINEN_SCALE,)},
            {},
            held={LINEN_SCALE: scale.path},
        )
        read_specs(new, problems)
        layers[layers.index(layer)] = new
        layers.remove(scale)
