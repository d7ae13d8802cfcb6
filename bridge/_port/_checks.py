"""Step 4 of a port: check the pairs before any array moves.

Every pair: a kind both layers share, its entries (a target entry the source lacks
takes the codec's neutral value; one the source has beyond the target's must hold
it), shapes and dtypes, the target's layout made from the source's canonical arrays
(`PlanRow`), settings one side lacks adopted from the other, hyperparameters that
differ (warnings). Across pairs, what the traced computations contradict: an order
of dependence, a convolution kernel's axes, a per-head reading left open, kinds of
several layouts. Then the layers left unpaired, in the user's words: missing,
unexpected, why (a folder without its head, a side not traced, a prefix), and the
fix where there is one.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._adapters._registry import adapter_named, canonical_adapter
from .._paths import path_str
from . import _errors, _shapes
from ._codec import Codec, same
from ._constants import constants as _constants
from ._feeds import contradicted
from ._general import kernel_path, reading_of
from ._layer import ARRAY, Layer, common_kind, read_specs, same_shapes
from ._norms import eps_warnings, is_offset, unconfirmed
from ._order import idle, normalised
from ._pairing import Pair, undecided
from ._plan import PlanRow
from ._product import unread
from ._side import Side
from ._tables import tables as _tables
from ._trace import Trace
from ._weight_norm import is_folded
from .codecs._dense import DENSE_LINEN, reads_out_in


def _transform(source: Codec, target: Codec, s: Layer, t: Layer) -> str:
    a, b = _applied(source, s), _applied(target, t)
    return "copy" if a == b else f"{a or 'Flax'} -> {b or 'Flax'}"


def _applied(codec: Codec, layer: Layer) -> str:
    """The layout a codec applies to this layer: of a layout that names two (a
    PyTorch dense weight: `nn.Linear`'s or Hugging Face's `Conv1D`), the one the
    layer's settings choose; a Flax kernel the forward pass reads `(out, in)`."""
    if codec is DENSE_LINEN and reads_out_in(layer.leaves, layer.hyper):
        return "kernel (out,in)"
    choices = codec.layout.split(" or ")
    if len(choices) == 2 and "conv1d" in layer.hyper:
        conv1d = [c for c in choices if "Conv1D" in c]
        other = [c for c in choices if "Conv1D" not in c]
        if conv1d and other:
            chosen = layer.hyper["conv1d"]
            if chosen is None:  # the name did not say: the shapes did (in, out)
                weight = layer.leaves.get("weight")
                kernel = layer.specs.get(codec.kind, {}).get("kernel")
                shapes = [getattr(x, "shape", None) for x in (weight, kernel)]
                chosen = shapes[0] is not None and shapes[0] == shapes[1]
            return (conv1d if chosen else other)[0]
    return codec.layout


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _check(
    s: Layer,
    t: Layer,
    kind: str,
    by: str,
    problems: list[str],
    dtype: Any,
    strict: bool,
    casts: list[str],
) -> PlanRow:
    sspec, tspec = s.specs[kind], t.specs[kind]
    defaults = {**s.codec(kind).defaults, **t.codec(kind).defaults}
    names = dict(source=s.where, target=t.where, kind=kind)
    fill, drop = {}, {}
    for entry in tspec.keys() - sspec.keys():
        if entry in defaults:
            fill[entry] = defaults[entry]
        else:
            problems.append(_errors.ENTRY_MISSING.format(entry=entry, **names))
    for entry in sspec.keys() - tspec.keys():
        if entry in defaults:
            drop[entry] = defaults[entry]
        else:
            problems.append(_errors.ENTRY_EXTRA.format(entry=entry, **names))
    fitting = True
    cast = {}  # entries to cast: to `dtype`, or (strict=False) to the target's
    for entry in sspec.keys() & tspec.keys():
        a, b = sspec[entry], tspec[entry]
        want = dtype if dtype is not None and _floating(b.dtype) else b.dtype
        if a.dtype != want and (dtype is not None or not strict):
            cast[entry] = want
            if dtype is None:
                casts.append(f"{s.where} -> {t.where}: {entry} {a.dtype} -> {want}")
            continue
        if a.shape != b.shape:
            fitting = False
            problems.append(
                _errors.SHAPE.format(
                    entry=entry, actual=tuple(a.shape), expected=tuple(b.shape), **names
                )
            )
        elif a.dtype != want:
            fitting = False
            problems.append(
                _errors.DTYPE.format(
                    entry=entry, actual=a.dtype, expected=b.dtype, **names
                )
            )
    tcodec = t.codec(kind)
    transform = _transform(s.codec(kind), tcodec, s, t)
    transform += "".join(f", {k} = {v}" for k, v in sorted(fill.items()))
    if fitting and t.part is None:  # a part is written with its fused layer
        like = {
            k: jax.ShapeDtypeStruct(v.shape, _retyped(v.dtype, dtype))
            for k, v in t.leaves.items()
        }
        canonical = {
            k: jax.ShapeDtypeStruct(v.shape, _retyped(v.dtype, dtype))
            for k, v in tspec.items()
        }
        made = _shapes.encoded(tcodec, canonical, like, t.hyper)
        got = {k: (tuple(v.shape), v.dtype) for k, v in made.items()}
        want = {k: (tuple(v.shape), v.dtype) for k, v in like.items()}
        if got != want:
            problems.append(_errors.UNFIT.format(made=got, like=want, **names))
    return PlanRow(
        s.where,
        t.where,
        kind,
        transform,
        t.shapes(kind),
        by,
        normalised(s.path) != normalised(t.path),
        fill,
        drop,
        cast,
        s,
        t,
    )


def _retyped(dtype: Any, wanted: Any) -> Any:
    return wanted if wanted is not None and _floating(dtype) else dtype


ADOPTED = ("heads",)
"""Settings a layout needs that a state dict or a file does not record (PyTorch's
fused attention weights do not show the number of heads): a layer without one takes
its paired layer's, before any array moves."""


def _adopt(pairs: list[tuple[Layer, Layer]], problems: list[str]) -> None:
    for s, t in pairs:
        for a, b in ((s, t), (t, s)):
            taken = {k: b.hyper[k] for k in ADOPTED if k in b.hyper}
            taken = {k: v for k, v in taken.items() if k not in a.hyper}
            if taken:
                a.hyper.update(taken)
                read_specs(a, problems)


def _kernel(layer: Layer) -> tuple[int, ...] | None:
    """A Dense layer's kernel shape `(in, out)` (Flax layout), else None."""
    spec = (
        layer.specs.get("Dense", {}).get("kernel") if "Dense" in layer.kinds else None
    )
    return None if spec is None or len(spec.shape) != 2 else tuple(spec.shape)


def _fused(sources: list[Layer], targets: list[Layer]) -> list[str]:
    """For each source Dense that pairs with nothing and whose output is that of
    unpaired target Dense siblings side by side (Phi-3's `qkv_proj` for `q_proj`,
    `k_proj`, `v_proj`): a rule cannot split it, `split=` can. One problem per
    name, layer numbers aside."""
    out: dict[str, str] = {}
    for s in sources:
        kernel = _kernel(s)
        if kernel is None or not s.path:
            continue
        parts = [  # (target sibling, its rows)
            (t, k[1])
            for t in targets
            if t.path[:-1] == s.path[:-1]
            and (k := _kernel(t)) is not None
            and k[0] == kernel[0]
        ]
        if len(parts) < 2 or sum(n for _, n in parts) != kernel[1]:
            continue
        dotted = ".".join(map(str, s.path))
        pattern = re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(dotted))
        out.setdefault(
            pattern,
            _errors.FUSED.format(
                source=s.where,
                out=kernel[1],
                parts=", ".join(f"{t.where} ({n} rows)" for t, n in parts),
                pattern=pattern,
            ),
        )
    return list(out.values())


def _absent(source: Side, lone_targets: list[Layer]) -> list[str]:
    """Where target `Dense` layers are missing, the source's arrays its adapter
    says its files lack and nothing fills (`ties_of`: a Hugging Face folder
    without `lm_head.weight` whose `config.json` does not tie it), and why."""
    heads = [t.where for t in lone_targets if "Dense" in t.kinds]
    if not heads:
        return []
    return [
        _errors.HEAD_ABSENT.format(name=tie[0], why=tie[2], targets=", ".join(heads))
        for tie in source.tie_records
        if len(tie) > 2 and not tie[1]
    ]


_POSITIONAL = frozenset({"shape", "order", "kind"})
"""What pairs two layers whose names differ by their place among alike layers, not
by what they compute or are called."""


_NUMBERED = re.compile(r"_\d+$|\[\d+\]$|^\(root\)$")


def _meanings(source: str, target: str) -> bool:
    """Whether two layers' last names were both chosen by their authors
    (`sentiment_head`, `topic_head`), not made by a framework or a list (`Dense_0`,
    `layers_1`, `layers[2]`), and differ: two meanings."""
    a, b = source.rsplit(".", 1)[-1], target.rsplit(".", 1)[-1]
    return a != b and not (_NUMBERED.search(a) or _NUMBERED.search(b))


def _sizes(s: Layer, t: Layer, kind: str) -> str:
    """The entries whose shapes differ between two paired layers, in words."""
    a, b = s.specs[kind], t.specs[kind]
    return "; ".join(
        f"{k} {tuple(a[k].shape)} in the source, {tuple(b[k].shape)} in the target"
        for k in sorted(a.keys() & b.keys())
        if a[k].shape != b[k].shape
    )


def _prefix(pairs: list, sources: list[Layer], targets: list[Layer]) -> list[str]:
    """A prefix whose removal from the source's paths (or addition) names most of
    the target layers that names did not pair, proposed as the fix (one line)."""
    named = {id(p.target) for p in pairs if p.by in ("rule", "path", "name")}
    open_targets = [t for t in targets if id(t) not in named]
    if len(open_targets) < 2:
        return []
    wanted = {normalised(t.path) for t in open_targets}
    best: tuple[int, tuple, bool] = (0, (), False)
    for side, layers, others in ((0, sources, wanted), (1, targets, None)):
        heads = {x.path[:n] for x in layers for n in (1, 2) if len(x.path) > n}
        for head in heads:
            under = [x for x in layers if x.path[: len(head)] == head]
            if side == 0:
                hits = sum(normalised(x.path[len(head) :]) in wanted for x in under)
            else:
                found = {normalised(x.path) for x in sources}
                hits = sum(
                    normalised(x.path[len(head) :]) in found
                    for x in under
                    if id(x) not in named
                )
            if hits > best[0]:
                best = (hits, head, side == 1)
    hits, head, added = best
    if hits < max(2, len(open_targets) // 2):
        return []
    dotted = ".".join(map(str, head)) + "."
    where = re.escape(path_str(head))
    if added:
        return [_errors.PREFIX_ADD.format(n=hits, prefix=dotted, where=path_str(head))]
    return [
        _errors.PREFIX.format(
            n=hits, total=len(open_targets), prefix=dotted, where=where
        )
    ]


def _untraced(traces: tuple[Trace | None, Trace | None]) -> list[str]:
    """Where example inputs were given but a side has no forward pass to trace: one
    problem saying which, and why (layers left unpaired would have been paired by
    it)."""
    sides = [
        (side, trace.why)
        for side, trace in zip(("source", "target"), traces)
        if trace is not None and not trace()
    ]
    if not sides:
        return []
    text = " and the ".join(side for side, _ in sides)
    why = " ".join(w for _, w in sides if w)
    why = why if len(why) <= 300 else why[:300] + " ..."  # transformers lists all
    return [_errors.UNTRACED.format(sides=text) + (f" ({why})" if why else "")]


def untraced_first(
    problems: list[str], traces: tuple[Trace | None, Trace | None]
) -> list[str]:
    """`problems` where a side given example inputs cannot be traced for a reason
    its adapter gives (`Trace.why`: torch not installed): the problems its trace
    would have decided (the ambiguous pairings that say it is missing, `_untraced`'s
    line) are one line leading with that reason; the others as they are."""
    why = [
        (side, trace.why)
        for side, trace in zip(("source", "target"), traces)
        if trace is not None and trace.why and not trace()
    ]
    markers = (_errors.UNTRACED.split("{", 1)[0], "forward pass was traced: it uses")
    decided = [p for p in problems if any(m in p for m in markers)]
    if not why or not decided:
        return problems
    lines = [
        _errors.NOT_TRACED.format(
            side=side, why=text if len(text) <= 300 else text[:300] + " ..."
        )
        for side, text in why
    ]
    return lines + [p for p in problems if p not in decided]


def _stored(codec: Codec) -> str:
    """How a codec's arrays are stored, as far as choosing its kind matters: a
    layout of its own (PyTorch's `OIHW` or flipped `(I, O, *k)`), or Flax's, which
    every kind of the canonical layout shares."""
    flax = adapter_named(codec.framework).layout == canonical_adapter().layout
    return "" if flax else codec.layout


def _open_kinds(pairs: list[Pair]) -> list[str]:
    """Pairs whose arrays fit several kinds of different layouts on both sides (a
    square convolution read from a file, a Conv or a ConvTranspose; a Linen
    `conv` its forward pass did not tell): the shapes cannot say which, so the
    port is refused rather than guessed."""
    out = []
    for s, t, _ in pairs:
        fitting = [k for k in s.kinds if k in t.kinds and same_shapes(s, t, k)]
        transforms = {  # a per-head kernel's Dense view reads it the same way
            (_stored(s.codec(k)), _stored(t.codec(k)))
            for k in fitting
            if reading_of(s.codec(k)) is None
            and reading_of(t.codec(k)) is None
            and not is_folded(s.codec(k))  # nor a weight norm's plain view
            and not is_folded(t.codec(k))
            and not is_offset(s.codec(k))  # nor an offset norm's plain view
            and not is_offset(t.codec(k))
        }
        if len(transforms) > 1:
            out.append(
                _errors.OPEN_KIND.format(
                    source=s.where,
                    target=t.where,
                    kinds=" and a ".join(fitting),
                    shapes=s.shapes(fitting[0]),
                )
            )
    return out


def _contradicted(pairs: list[Pair], traces: tuple[Any, Any]) -> list[str]:
    """Pairs the forward passes contradict (`_feeds.contradicted`), refused,
    whatever paired them but rules (the user's word)."""
    if traces[0] is None or traces[1] is None or not traces[0]() or not traces[1]():
        return []
    checked = [p for p in pairs if p.by != "rule"]
    return [
        _errors.CONTRADICTED.format(
            a=a.source.where,
            b=b.source.where,
            ta=a.target.where,
            tb=b.target.where,
            by=a.by if a.by == b.by else f"{a.by}, {b.by}",
            a_re=re.escape(a.source.where),
            b_re=re.escape(b.source.where),
        )
        for a, b in contradicted(checked, traces)
    ]


def _conv_layouts(pairs: list[Pair], traces: tuple[Any, Any]) -> list[str]:
    """`Conv` layers read in Flax's layout (`(*spatial, in, out)`, a codec that
    decodes nothing) whose kernel the forward pass convolves with other axes (a
    custom module storing `(out, in, *spatial)`, a square kernel whose shapes fit
    either): refused, naming the axes."""
    out = []
    for s, t, _ in pairs:
        if common_kind(s, t) != "Conv":
            continue
        for side, x in ((0, s), (1, t)):
            trace = traces[side]
            if (
                trace is None
                or x.index not in (None, 0)
                or x.codec("Conv").decode is not same
            ):
                continue
            spec = (trace() and trace.kernels().get(kernel_path(x))) or None
            if spec is None:
                continue
            if x.index is not None:
                spec = tuple(a - (a > x.axis) for a in spec)
            n = len(spec)
            want = (n - 1, n - 2, *range(n - 2))
            if spec != want:
                out.append(
                    _errors.CONV_AXES.format(
                        where=x.where,
                        shape=tuple(x.leaves["kernel"].shape),
                        out=spec[0],
                        inp=spec[1],
                        spatial=spec[2:],
                    )
                )
    return out


def _undecided(pairs: list[Pair]) -> list[str]:
    """A per-head kernel paired through its `Dense` view whose shapes fit several
    readings (`Layer.undecided`): refused, example inputs decide."""
    out = []
    for s, t, _ in pairs:
        if common_kind(s, t) != "Dense":
            continue
        for x, other in ((s, t), (t, s)):
            if x.undecided and x.index in (None, 0):
                shape = tuple(x.leaves["kernel"].shape)
                out.append(
                    _errors.AXES.format(
                        where=x.where,
                        shape=shape,
                        other=other.where,
                        fused=tuple(x.specs["Dense"]["kernel"].shape),
                        readings="; ".join(r.words() for r in x.undecided),
                    )
                )
    return out


class Checked(NamedTuple):
    """The pairs checked: a `PlanRow` each (`steps`), the warnings (settings and
    dtypes that differ, positional pairs of meaningful names), and with
    `strict=False` the pairs whose shapes differ (the target keeps its values)."""

    steps: tuple[PlanRow, ...]
    warnings: tuple[str, ...]
    mismatched: tuple[str, ...]


def check_pairs(
    pairs: list[Pair],
    sides: tuple[Side, Side],
    strict: bool,
    dtype: Any,
    problems: list[str],
) -> Checked:
    """Every pair checked, its problems added to `problems`."""
    traces = (sides[0].trace, sides[1].trace)
    _adopt([(p.source, p.target) for p in pairs], problems)
    problems += _undecided(pairs)
    problems += _open_kinds(pairs)
    problems += _contradicted(pairs, traces)
    problems += _conv_layouts(pairs, traces)
    problems += unconfirmed(pairs, traces)
    steps, warnings, casts, mismatched = [], [], [], []
    dtype = None if dtype is None else jnp.dtype(dtype)
    for s, t, by in pairs:
        kind = common_kind(s, t)
        if kind is None:  # a rule across kinds, already reported
            continue
        found: list[str] = []
        step = _check(s, t, kind, by, found, dtype, strict, casts)
        sizes = _sizes(s, t, kind)
        if sizes and not strict:  # the target keeps its values
            mismatched.append(f"{s.where} -> {t.where} ({kind}): {sizes}")
            continue
        problems += found
        steps.append(step)
        for name in sorted(s.hyper.keys() & t.hyper.keys()):
            a, b = s.hyper[name], t.hyper[name]
            if a != b:
                warnings.append(
                    _errors.HYPER.format(
                        source=s.where, target=t.where, kind=kind, name=name, a=a, b=b
                    )
                )
    told = {(s.where, t.where) for s, t, _ in pairs if _epsilons(s, t)}
    warnings += eps_warnings(pairs, traces, told)
    if casts:
        warnings.append(_errors.CAST.format(casts="\n    ".join(casts)))
    guessed = [
        f"{x.source} -> {x.target} ({x.by})"
        for x in steps
        if x.renamed and x.by in _POSITIONAL and _meanings(x.source, x.target)
    ]
    if guessed and sides[0].framework == sides[1].framework:
        traced = [None if t is None else bool(t()) for t in traces]
        warnings.append(
            _errors.POSITIONAL.format(
                pairs="\n    ".join(guessed), decide=undecided(traced)
            )
        )
    return Checked(tuple(steps), tuple(warnings), tuple(mismatched))


def _idle(sides: tuple[Side, Side]) -> Any:
    """`idle(layer, side)`: the words saying that its side's traced forward pass
    does not use the layer (empty where it does, or nothing was traced)."""
    uses = [(side.trace() or {}) if side.trace is not None else {} for side in sides]

    def words(x: Layer, side: int) -> str:
        if not uses[side] or x.tied or not idle(x, uses[side]):
            return ""
        return _errors.IDLE.format(side=sides[side].name)

    return words


def _epsilons(s: Layer, t: Layer) -> bool:
    """Whether both layers' modules give their `epsilon` (compared by `HYPER`)."""
    return "epsilon" in s.hyper and "epsilon" in t.hyper


class Unpaired(NamedTuple):
    """The layers left: those no layer of the other side fills or takes
    (`sources`, `targets`), and those that need none, by where (stored tables one
    side computes, constants both compute)."""

    sources: list[Layer]
    targets: list[Layer]
    computed_by_target: tuple[str, ...]
    computed_by_source: tuple[str, ...]
    constants: tuple[str, ...]


def check_unpaired(
    found: Any, sides: tuple[Side, Side], strict: bool, problems: list[str]
) -> Unpaired:
    """The layers `found` (`_planning.Found`) left unpaired, less those that need
    no partner; with `strict`, each a problem, with why and the fix."""
    pairs = found.pairs
    # a name of a tied array whose array goes (or comes) through another name
    delivered = [
        {h for p in pairs for h in (p.source, p.target)[side].tied} for side in (0, 1)
    ]
    lone_sources = [s for s in found.lone_sources if not s.tied & delivered[0]]
    lone_targets = [t for t in found.lone_targets if not t.tied & delivered[1]]
    tables = (
        _tables(lone_sources, found.sources),
        _tables(lone_targets, found.targets),
    )
    lone_sources = [s for s in lone_sources if id(s) not in tables[0]]
    lone_targets = [t for t in lone_targets if id(t) not in tables[1]]
    alike = _constants(pairs, (lone_sources, lone_targets), sides)
    lone_sources = [s for s in lone_sources if id(s) not in alike]
    lone_targets = [t for t in lone_targets if id(t) not in alike]
    computed_tables = [
        text.format(where=x.where, kind="/".join(x.kinds), shapes=x.shapes(), variant=v)
        for text, stored in zip(
            (_errors.COMPUTED_BY_TARGET, _errors.COMPUTED_BY_SOURCE), tables
        )
        for x, v in stored.values()
        if v.startswith("sinusoidal")  # a table may be learned: refused with strict;
    ]  # inverse frequencies, position ids and masks are only ever computed
    idle = _idle(sides)
    missing = [
        _errors.MISSING.format(
            target=t.where, kind="/".join(t.kinds), shapes=t.shapes()
        )
        + idle(t, 1)
        for t in lone_targets
    ]
    unexpected = [
        _errors.UNEXPECTED.format(
            source=s.where,
            kind="/".join(s.kinds),
            shapes=s.shapes(),
            source_re=re.escape(s.where),
        )
        + idle(s, 0)
        for s in lone_sources
    ]
    unexpected += _fused(lone_sources, lone_targets)
    offset = [s.where for s in lone_sources if s.kinds == ("GemmaRMSNorm",)]
    if offset:  # what no rule fixes: the fix
        some = ", ".join(offset[:3]) + (", ..." if len(offset) > 3 else "")
        unexpected.append(_errors.ONE_PLUS_WEIGHT.format(n=len(offset), some=some))
    traces = (sides[0].trace, sides[1].trace)
    if strict:
        problems += computed_tables + missing + unexpected
    if missing and strict:  # a head a folder lacks, and why
        problems += _absent(sides[0], lone_targets)
    if (missing or unexpected) and strict:  # what would have paired them
        problems += _untraced(traces)
        problems += unread((lone_sources, lone_targets), traces)
    if problems:
        problems += _prefix(pairs, found.sources, found.targets)
    for side, layers, stored in zip(sides, (lone_sources, lone_targets), tables):
        loose = [x.where for x in layers if x.kinds == (ARRAY,) and id(x) not in stored]
        fix = side.hidden_wrappers() if problems and loose else None
        if fix:
            problems.append(
                _errors.HIDDEN_WRAPPER.format(side=side.name, loose=loose, fix=fix)
            )
    return Unpaired(
        lone_sources,
        lone_targets,
        tuple(x.where for x, _ in tables[0].values()),
        tuple(x.where for x, _ in tables[1].values()),
        tuple(x.where for x in alike.values()),
    )
