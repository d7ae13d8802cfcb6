"""A norm read by what it computes, on either side, whatever its class or its
arrays' names.

The traced forward pass says which arrays scale or shift an activation normalised by
its own statistics, and how (`Trace.norms`: PyTorch's recorder, `_jaxpr_norms` for
JAX): `"mean"` (a mean-subtracting norm: LayerNorm, GroupNorm), `"rms"` (`x *
rsqrt(mean(x ** 2) + eps) * w`), `"rms+1"` (the same times `1 + w`: Gemma's,
Griffin's). That decides the layer, not its module's class or name:

- loose arrays (kind `Array`: a module written by hand whose `scale` no codec
  claims) that a norm uses are one norm layer per module (`norm_view`: its own
  names and singleton axes read as Flax's `scale (C,)` and `bias (C,)`);
- a layer a codec read as a norm of another computation (a Linen `RMSNorm` class
  that computes `x * (1 + scale)`) is read as what it computes;
- a norm computing `x * (1 + w)` is also an `RMSNorm` candidate through a view
  (`offset_view`: `scale = 1 + w`, written back `w = scale - 1`), so that it pairs
  with a norm computing `x * w`, the function kept (to rounding).

Without a trace nothing changes here (the codecs' reading stands).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from . import _errors
from ._codec import WRITTEN, Codec, Leaves
from ._layer import ARRAY, Layer, read_specs
from ._trace import Trace


KINDS = {
    "mean": ("LayerNorm", "GroupNorm"),
    "rms": ("RMSNorm",),
    "rms+1": ("GemmaRMSNorm",),
}
"""The layer kinds of a norm by what its trace computes."""

NORMS = frozenset({"LayerNorm", "GroupNorm", "RMSNorm", "GemmaRMSNorm"})
OFFSET, PLAIN = "GemmaRMSNorm", "RMSNorm"

_VIEWS: dict[Any, Codec] = {}
_OFFSETS: set[int] = set()


def norm_view(framework: str, kind: str, names: tuple[tuple[str, str], ...]) -> Codec:
    """The codec of a norm of `kind` whose arrays are `names`, `(its own name,
    Flax's: scale or bias)` each: renamed, and read as 1-D `(C,)` (singleton axes
    dropped: Haiku's `(1, 1, C)`), written back in the stored shape."""
    key = (framework, kind, names)
    if key in _VIEWS:
        return _VIEWS[key]
    own = dict(names)

    def decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        return {own[k]: jnp.reshape(v, (-1,)) for k, v in leaves.items() if k in own}

    def encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
        return {
            k: jnp.reshape(canonical[own[k]], tuple(like[k].shape))
            for k in like
            if k in own and own[k] in canonical
        }

    neutral = 0.0 if kind == OFFSET else 1.0
    view = Codec(
        kind,
        framework,
        lambda cls, leaves: False,  # made from the trace, never recognised
        decode,
        encode,
        layout=WRITTEN,
        defaults={"scale": neutral, "bias": 0.0},
    )
    _VIEWS[key] = view
    return view


def offset_view(codec: Codec) -> Codec:
    """The `RMSNorm` view of a norm computing `x * (1 + w)`: `scale = 1 + w`."""
    key = ("offset", id(codec))
    if key in _VIEWS:
        return _VIEWS[key]

    def decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        canonical = codec.decode(leaves, hyper)
        canonical["scale"] = 1 + jnp.asarray(canonical["scale"])
        return canonical

    def encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
        scale = jnp.asarray(canonical["scale"]) - 1
        return codec.encode({**canonical, "scale": scale}, like, hyper)

    view = Codec(
        PLAIN,
        codec.framework,
        lambda cls, leaves: False,
        decode,
        encode,
        codec.hyperparameters,
        layout=f"{codec.layout}; scale = 1 + weight".lstrip("; "),
        defaults={"scale": 1.0, "bias": 0.0},
    )
    _VIEWS[key] = view
    _OFFSETS.add(id(view))
    return view


def is_offset(codec: Codec) -> bool:
    """Whether `codec` is the `RMSNorm` view of an offset norm (`offset_view`)."""
    return id(codec) in _OFFSETS


def read_norms(
    sides: tuple[list[Layer], list[Layer]],
    traces: tuple[Trace | None, Trace | None],
    problems: list[str],
) -> None:
    """Each side's norms read from its trace (see the module), in place; then, where
    both sides were traced, the `RMSNorm` view of every offset norm (only there:
    the other side's plain norm must be seen computing `x * w`, `unconfirmed`)."""
    traced = [t is not None and bool(t()) for t in traces]
    for layers, trace, ok in zip(sides, traces, traced):
        if ok and trace is not None and trace.norms():
            norms = trace.norms()
            _loose_norms(layers, norms, problems)
            for x in layers:
                _as_computed(x, norms, problems)
    if not all(traced):
        return
    for layers in sides:
        for x in layers:
            if OFFSET in x.kinds and PLAIN not in x.kinds:
                x.codecs = x.codecs + (offset_view(x.codec(OFFSET)),)
                read_specs(x, problems)


def unconfirmed(pairs: list, traces: tuple[Trace | None, Trace | None]) -> list[str]:
    """Pairs through an offset norm's `RMSNorm` view whose other layer its trace
    does not show computing `x * w` (none of its arrays scales a normalisation
    there): which form it computes is not known, so the offset is not applied."""
    out = []
    for s, t, _ in pairs:
        for x, other, trace in ((s, t, traces[1]), (t, s, traces[0])):
            if PLAIN not in x.kinds or not is_offset(x.codec(PLAIN)):
                continue
            if OFFSET in other.kinds or trace is None:
                continue
            if _computes(other, trace.norms()) != "rms":
                out.append(_errors.NORM_FORM.format(offset=x.where, other=other.where))
    return out


def eps_warnings(
    pairs: list, traces: tuple[Trace | None, Trace | None], told: set[tuple[str, str]]
) -> list[str]:
    """A warning per pair of norms whose traced variances are given different
    constants (`eps`: Flax's 1e-6 against Equinox's and PyTorch's 1e-5), the
    outputs then differ a little; `told`: the `(source, target)` pairs whose
    modules' settings already said so (`HYPER`)."""
    if traces[0] is None or traces[1] is None or not traces[0]() or not traces[1]():
        return []
    found = (traces[0].norm_eps(), traces[1].norm_eps())
    out = []
    for s, t, _ in pairs:
        if (s.where, t.where) in told or not (set(s.kinds) | set(t.kinds)) & NORMS:
            continue
        a, b = (_eps(x, e) for x, e in ((s, found[0]), (t, found[1])))
        if a is None or b is None or abs(a - b) <= 1e-5 * max(abs(a), abs(b)):
            continue
        out.append(
            _errors.HYPER.format(
                source=s.where, target=t.where, kind="norm", name="eps", a=a, b=b
            )
        )
    return out


def _eps(x: Layer, found: Any) -> float | None:
    values = {round(found[_leaf(x, e)], 12) for e in x.paths if _leaf(x, e) in found}
    return values.pop() if len(values) == 1 else None


def _leaf(x: Layer, entry: str) -> Any:
    return (x.real if x.index is not None else x.path) + x.paths[entry]


def _computes(x: Layer, norms: dict) -> str | None:
    """What the norm whose arrays `x` holds computes (`"mean"`, `"rms"`,
    `"rms+1"`), None where the trace says no norm uses them, or not one alike."""
    found = {norms.get(_leaf(x, e), "").split(":")[0] for e in x.paths}
    if len(found) != 1:
        return None
    (what,) = found
    return what if what in KINDS else None


def _names(x: Layer, norms: dict) -> tuple[tuple[str, str], ...] | None:
    """`(entry, "scale" or "bias")` for a norm layer's arrays, as the trace saw
    them used: multiplied (its scale) or added after (its bias); None for
    anything else (two scales)."""
    names = tuple(
        (e, "bias" if norms.get(_leaf(x, e), "").endswith(":bias") else "scale")
        for e in x.paths
    )
    roles = [r for _, r in names]
    return names if roles.count("scale") <= 1 and roles.count("bias") <= 1 else None


def _as_computed(x: Layer, norms: dict, problems: list[str]) -> None:
    """A layer read as a norm of another computation than its trace shows: read
    as what it computes (its own arrays renamed), where no candidate kind fits."""
    if not x.codecs or not set(x.kinds) <= NORMS or x.held:
        return
    what = _computes(x, norms)
    if what is None:
        return
    allowed = KINDS[what]
    fitting = tuple(c for c in x.codecs if c.kind in allowed)
    if fitting:
        if fitting != x.codecs:
            x.codecs = fitting
        return
    names = _names(x, norms)
    if names is None:
        return
    framework = x.codecs[0].framework
    x.codecs = tuple(norm_view(framework, kind, names) for kind in allowed)
    x.hyper = {}
    read_specs(x, problems)


def _loose_norms(layers: list[Layer], norms: dict, problems: list[str]) -> None:
    """Loose arrays a norm uses, one norm layer per module (scale, and bias)."""
    modules: dict[Any, list[Layer]] = {}
    for x in layers:
        if x.kinds == (ARRAY,) and x.index is None and _computes(x, norms):
            modules.setdefault(x.path[:-1], []).append(x)
    if not modules:
        return
    replaced: dict[int, Layer] = {}
    dropped: set[int] = set()
    for module, parts in modules.items():
        what = {_computes(x, norms) for x in parts}
        if len(what) != 1 or len(parts) > 2:
            continue
        entries = {str(x.path[-1]): x for x in parts}
        names = tuple(
            (e, "bias" if norms[x.path].endswith(":bias") else "scale")
            for e, x in entries.items()
        )
        if [r for _, r in names].count("scale") > 1:
            continue
        (kind,) = what
        framework = parts[0].codecs[0].framework
        layer = Layer(
            module,
            tuple(norm_view(framework, k, names) for k in KINDS[kind]),
            {e: x.leaves["array"] for e, x in entries.items()},
            {e: (x.path[-1],) for e, x in entries.items()},
            {},
        )
        read_specs(layer, problems)
        if not layer.codecs:
            continue
        replaced[id(parts[0])] = layer
        dropped.update(id(x) for x in parts[1:])
    layers[:] = [replaced.get(id(x), x) for x in layers if id(x) not in dropped]
