"""`port_plan`: which source layer goes where, how, and what does not fit."""

from __future__ import annotations

import itertools
import re
import shutil
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from .._adapters._native import check_model, placeholders, to_neutral
from .._adapters._registry import adapter_named, canonical_adapter, ties_of
from .._arguments import check_inputs, check_pair_or_mapping, check_rules
from .._embed._as_linen import hidden_wrappers
from .._paths import Path, parse, path_str
from .._tree import Tree, framework
from . import _errors, _shapes
from ._codec import Codec, same
from ._computed import computed
from ._constants import constants as _constants
from ._general import choose, dense_view, kernel_path, reading_of, wanted_shapes
from ._heads import with_heads
from ._layers import (
    ARRAY,
    Layer,
    find_layers,
    read_specs,
    tell_settings,
    with_ties,
)
from ._pairing import (
    Order,
    Pair,
    common_kind,
    dependence,
    normalised,
    pair,
    same_shapes,
    undecided,
)
from ._product import products, unread
from ._tables import tables as _tables
from ._trace import Example, Trace
from ._weight_norm import is_folded, read_axes
from .codecs._dense import DENSE_LINEN, reads_out_in


@dataclass(frozen=True, eq=False)
class PlanRow:
    """One layer moved: `source` path -> `target` path, its `kind`, the `transform`
    applied (`", bias = 0.0"` when the source has no bias) and the canonical (Flax)
    shapes. `by` says what paired them (`"rule"`, `"path"`, `"name"`, `"shape"`,
    `"order"`, `"kind"`); `renamed` is True when their names differ (even after
    normalisation: `layers_3` and `layers[3]` are the same name). `fill` are entries
    the target has and the source lacks (given their neutral value), `drop` entries
    the source has and the target lacks (which must hold their neutral value)."""

    source: str
    target: str
    kind: str
    transform: str
    shapes: str
    by: str = "rule"
    renamed: bool = False
    fill: dict[str, float] = field(default_factory=dict, repr=False)
    drop: dict[str, float] = field(default_factory=dict, repr=False)
    cast: dict[str, Any] = field(default_factory=dict, repr=False)
    _source: Layer | None = field(default=None, repr=False)
    _target: Layer | None = field(default=None, repr=False)

    @property
    def source_codec(self) -> Codec:
        assert self._source is not None
        return self._source.codec(self.kind)

    @property
    def target_codec(self) -> Codec:
        assert self._target is not None
        return self._target.codec(self.kind)


WIDTH = 100
"""The width a plan's table folds at (`Plan.table`)."""


@dataclass(frozen=True, eq=False)
class Plan:
    """What `bridge.port` does: `str(plan)` is a table, one row per layer.

    **Attributes:**

    - `steps`: tuple of `PlanRow`s (`source`, `target`, `kind`, `transform`, `shapes`),
      in the target's definition order.
    - `missing`: target layers no source layer fills (they keep their values; only
      with `strict=False`, else an error).
    - `unexpected`: source layers that go nowhere (only with `strict=False`).
    - `warnings`: hyperparameters that differ between paired layers.
    - `tied`: names that share one array in a PyTorch-layout source or target
      (`"lm_head.weight = wte.weight"`): kept once in the Tree, written under both
      names by `bridge.to_torch`; and how one array filled (or was filled by)
      several layers (`".wte.embedding -> .embed_tokens, .lm_head"`: a JAX
      model's embedding its head reads, `_heads.py`), with why where a folder's
      `config.json` told it.
    - `problems`: what `bridge.port` would raise for (shapes, dtypes, ambiguous
      pairings, unsupported layers, rules that do not apply; with `strict`, missing
      and unexpected layers too). Empty when the port can run.
    - `mismatched`: with `strict=False`, paired layers whose shapes differ
      (`".head -> .classifier: kernel (8, 10) in the source, (8, 5) in the
      target"`): the target keeps its own values there, as Hugging Face's
      `ignore_mismatched_sizes=True` does. With `strict=True` they are problems.
    - `dropped`: source layers a rule `{pattern: None}` leaves out.
    - `computed_by_target`: source layers without a target layer that hold a
      stored sinusoidal position table (`embed_positions.weight` of transformers'
      Marian, Pegasus, RoFormer), which the target computes: left out (only with
      `strict=False`, else an error). Recognised by their values, never by name:
      a learned table is `unexpected`.
    - `computed_by_source`: target layers without a source layer whose values are
      such a table, which the source computes: they keep their values (only with
      `strict=False`, else an error).
    - `constants`: loose arrays of either side without a counterpart that equal a
      constant the other side's model keeps out of its state, beside the layer
      theirs is paired with (PyTorch's non-persistent buffers: Gemma 3's
      `embed_scale`): computed alike by both, a target's keeps its value, a
      source's is not written (`bridge._port._constants`).
    """

    steps: tuple[PlanRow, ...]
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    _source: Tree | None = field(default=None, repr=False)
    _target: Tree | None = field(default=None, repr=False)
    mismatched: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    computed_by_target: tuple[str, ...] = ()
    computed_by_source: tuple[str, ...] = ()
    constants: tuple[str, ...] = ()

    def __str__(self) -> str:
        """The table (`table`), folded to the terminal's width (`$COLUMNS`, else
        100 columns)."""
        return self.table(shutil.get_terminal_size((WIDTH, 24)).columns)

    def table(self, width: int = WIDTH) -> str:
        """The plan as text: one row per layer, as wide as it needs; wider than
        `width` columns, each row folds onto two lines (the transform and the shapes
        on the second), so that nothing is cut."""
        head = ("~", "source", "target", "kind", "by", "transform")
        head += ("shapes (Flax layout)",)
        rows = [head] + _runs(
            [
                (
                    "~" if s.renamed else "",
                    s.source,
                    s.target,
                    s.kind,
                    s.by,
                    s.transform,
                    s.shapes,
                )
                for s in self.steps
            ]
        )
        lines = _columns(rows)
        if max(map(len, lines)) > width:
            folded = _columns([r[:5] for r in rows])
            if max(map(len, folded)) > width:  # each row on lines of its own
                lines = [
                    "source -> target (kind, by)",
                    "    transform; shapes (Flax layout)",
                    "-" * min(width, 40),
                ]
                for r in rows[1:]:
                    lines += _wrapped(f"{r[0] or ' '} {r[1]}", width, "    ")
                    lines += _wrapped(
                        f"    -> {r[2]} ({r[3]}, {r[4]})", width, "       "
                    )
                    lines += _wrapped(f"    {r[5]}; {r[6]}", width, "      ")
            else:
                lines = [folded[0], "    transform; shapes (Flax layout)", folded[1]]
                for r, line in zip(rows[1:], folded[2:]):
                    lines += [line, *_wrapped(f"    {r[5]}; {r[6]}", width, "      ")]
        if any(s.renamed for s in self.steps):
            lines.append("~: the names differ; check that these layers correspond.")
        for title, entries in (
            ("missing (kept as they are)", self.missing),
            ("unexpected (left out)", self.unexpected),
            ("mismatched shapes (the target's values kept)", self.mismatched),
            ("dropped by rules", self.dropped),
            (
                "computed by the target (stored tables, left out)",
                self.computed_by_target,
            ),
            ("computed by the source (stored tables, kept)", self.computed_by_source),
            ("constants both models compute (not moved)", self.constants),
            ("warnings", self.warnings),
            ("tied (stored once)", self.tied),
            ("problems (bridge.port raises)", self.problems),
        ):
            if entries:
                lines.append(f"{title}:")
                lines += [f"  {e}" for e in entries]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Plan({len(self.steps)} steps)\n{self}"


_NUMBER = re.compile(r"\d+")


def _wrapped(text: str, width: int, indent: str) -> list[str]:
    """`text` on lines of at most `width` columns (a word longer than that, a long
    path, on a line of its own), the lines after the first indented by `indent`."""
    return textwrap.wrap(
        text,
        max(width, 20),
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
        drop_whitespace=True,
    ) or [text]


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as aligned columns, a rule under the first; the last column unpadded."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1]
        for r in rows
    ]
    rule = "  ".join("-" * w for w in widths) + "  " + "-" * len(rows[0][-1])
    lines.insert(1, rule)
    return [line.rstrip() for line in lines]


def _runs(rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Rows that differ only by the first number of their source path and of their
    target path, both counting up by one from row to row (the layers of a stack or
    a list), as one row, where the first of them was: `.blocks[0..11].Dense_0 ->
    .layers[0..11].dense`."""
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(_pattern(row), []).append(i)
    out: list[tuple[str, ...]] = []
    for i, row in enumerate(rows):
        members = groups.get(_pattern(row), [i])
        numbers = [(_first(rows[j][1]), _first(rows[j][2])) for j in members]
        counts = len(members) > 1 and all(
            a is not None and b is not None for a, b in numbers
        )
        if (
            counts
            and all(
                (a2, b2) == (a1 + 1, b1 + 1)  # pyright: ignore[reportOptionalOperand]
                for (a1, b1), (a2, b2) in zip(numbers, numbers[1:])
            )
        ):
            if i == members[0]:
                last = rows[members[-1]]
                out.append((row[0], _span(row[1], last[1]), _span(row[2], last[2])))
                out[-1] += row[3:]
            continue
        out.append(row)
    return out


def _pattern(row: tuple[str, ...]) -> tuple:
    return (row[0], _NUMBER.sub("#", row[1], 1), _NUMBER.sub("#", row[2], 1)) + row[3:]


def _first(path: str) -> int | None:
    match = _NUMBER.search(path)
    return None if match is None else int(match.group())


def _span(first: str, last: str) -> str:
    """`.blocks[0].x` and `.blocks[11].x` as `.blocks[0..11].x`."""
    end = _NUMBER.search(last)
    assert end is not None
    return _NUMBER.sub(lambda m: f"{m.group()}..{end.group()}", first, 1)


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
    if fitting:
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


def make_plan(
    source: Any,
    target: Any,
    rules: Mapping[str, str | None] | None,
    strict: bool,
    dtype: Any = None,
    example: Example | None = None,
    source_uses: Mapping[Path, tuple[int, ...]] | None = None,
) -> tuple[Plan, list[str]]:
    """The plan and every problem found (empty: `port` may run it). With `example`
    inputs, layers that names do not pair are paired in the order the two forward
    passes use them (`_trace`); `source_uses`, the order a file records, stands for
    the source's."""
    source, target = to_neutral(source), to_neutral(target)
    problems: list[str] = []
    traces = (
        _tracer(source, example, 0, problems, source_uses),
        _tracer(target, example, 1, problems),
    )
    axes: tuple[dict[Path, Any], dict[Path, Any]] = ({}, {})
    first: list[str] = []
    ties = (_ties(source), _ties(target))
    read = _paired(source, target, rules, first, traces, axes, ties=ties)
    if first or read[4] or read[5]:  # ties a traced model shows (a folder's)
        traced = (_traced_ties(traces[0], ties[0]), _traced_ties(traces[1], ties[1]))
        if traced != ties:
            ties, first = traced, []
            read = _paired(source, target, rules, first, traces, axes, ties=ties)
    opened = _opened(read[0], read[1], read[4], read[5])
    if opened != (frozenset(), frozenset()):  # an attention against projections
        first = []
        read = _paired(source, target, rules, first, traces, axes, opened, ties)
    open_ = [(side, p, c) for side in (0, 1) for p, c in axes[side].items()]
    fixed: tuple[dict[Path, Any], dict[Path, Any]] = ({}, {})
    for (side, path, _), axis in _traced_axes(open_, traces).items():
        fixed[side][path] = axis  # the forward pass scans the stack over `axis`
    if fixed[0] or fixed[1]:
        first = []
        chosen = (dict(fixed[0]), dict(fixed[1]))
        read = _paired(source, target, rules, first, traces, chosen, opened, ties)
        open_ = [x for x in open_ if x[1] not in fixed[x[0]]]
    if not open_:
        problems += first
    else:  # stacks whose layer axis the shapes leave open: the other side decides
        fitting = []
        for choice in itertools.product(*(c for _, _, c in open_)):
            chosen = (dict(fixed[0]), dict(fixed[1]))
            for (side, path, _), axis in zip(open_, choice):
                chosen[side][path] = axis
            trial: list[str] = []
            attempt = _paired(
                source, target, rules, trial, traces, chosen, opened, ties
            )
            if not trial and not attempt[4] and not attempt[5]:
                fitting.append(attempt)
        if len(fitting) == 1:
            read = fitting[0]
        else:
            problems += first
            for side, path, candidates in open_:
                problems.append(
                    _errors.STACK_AXIS.format(
                        where=f"{('source', 'target')[side]} {path_str(path)}",
                        axes=list(candidates),
                        lengths="several",
                    )
                )
    sources, targets, told, pairs, lone_sources, lone_targets, dropped = read
    # a name of a tied array whose array goes (or comes) through another name
    delivered = [
        {h for p in pairs for h in (p.source, p.target)[side].tied} for side in (0, 1)
    ]
    lone_sources = [s for s in lone_sources if not s.tied & delivered[0]]
    lone_targets = [t for t in lone_targets if not t.tied & delivered[1]]
    _adopt([(p.source, p.target) for p in pairs], problems)
    problems += _undecided(pairs)
    problems += _open_kinds(pairs)
    problems += _contradicted(pairs, traces)
    problems += _conv_layouts(pairs, traces)
    steps, warnings, casts, mismatched = [], list(told), [], []
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
    if casts:
        warnings.append(_errors.CAST.format(casts="\n    ".join(casts)))
    guessed = [
        f"{x.source} -> {x.target} ({x.by})"
        for x in steps
        if x.renamed and x.by in _POSITIONAL and _meanings(x.source, x.target)
    ]
    if guessed and framework(source) == framework(target):
        traced = [None if t is None else bool(t()) for t in traces]
        warnings.append(
            _errors.POSITIONAL.format(
                pairs="\n    ".join(guessed), decide=undecided(traced)
            )
        )
    tables = (_tables(lone_sources, sources), _tables(lone_targets, targets))
    lone_sources = [s for s in lone_sources if id(s) not in tables[0]]
    lone_targets = [t for t in lone_targets if id(t) not in tables[1]]
    alike = _constants(pairs, (lone_sources, lone_targets), (source, target))
    lone_sources = [s for s in lone_sources if id(s) not in alike]
    lone_targets = [t for t in lone_targets if id(t) not in alike]
    computed_tables = [
        text.format(where=x.where, kind="/".join(x.kinds), shapes=x.shapes(), variant=v)
        for text, found in zip(
            (_errors.COMPUTED_BY_TARGET, _errors.COMPUTED_BY_SOURCE), tables
        )
        for x, v in found.values()
    ]
    missing = [
        _errors.MISSING.format(
            target=t.where, kind="/".join(t.kinds), shapes=t.shapes()
        )
        for t in lone_targets
    ]
    unexpected = [
        _errors.UNEXPECTED.format(
            source=s.where,
            kind="/".join(s.kinds),
            shapes=s.shapes(),
            source_re=re.escape(s.where),
        )
        for s in lone_sources
    ]
    unexpected += _fused(lone_sources, lone_targets)
    offset = [s.where for s in lone_sources if s.kinds == ("GemmaRMSNorm",)]
    if offset:  # what no rule fixes: the fix
        some = ", ".join(offset[:3]) + (", ..." if len(offset) > 3 else "")
        unexpected.append(_errors.ONE_PLUS_WEIGHT.format(n=len(offset), some=some))
    if strict:
        problems += computed_tables + missing + unexpected
    if missing and strict:  # a head a folder lacks, and why
        problems += _absent(source, lone_targets)
    if (missing or unexpected) and strict:  # what would have paired them
        problems += _untraced(traces)
        problems += unread((lone_sources, lone_targets), traces)
    if problems:
        problems += _prefix(pairs, sources, targets)
    for side, tree, layers, stored in (
        ("source", source, sources, tables[0]),
        ("target", target, targets, tables[1]),
    ):
        loose = [x.where for x in layers if x.kinds == (ARRAY,) and id(x) not in stored]
        fix = hidden_wrappers(tree) if problems and loose else None
        if fix:
            problems.append(
                _errors.HIDDEN_WRAPPER.format(side=side, loose=loose, fix=fix)
            )
    problems[:] = _untraced_first(problems, traces)
    plan = Plan(
        tuple(steps),
        tuple(t.where for t in lone_targets),
        tuple(s.where for s in lone_sources),
        tuple(warnings),
        _tie_lines(pairs, (ties_of(source), ties_of(target))),
        tuple(problems),
        source,
        target,
        tuple(mismatched),
        tuple(s.where for s in dropped),
        tuple(x.where for x, _ in tables[0].values()),
        tuple(x.where for x, _ in tables[1].values()),
        tuple(x.where for x in alike.values()),
    )
    return plan, problems


def _absent(source: Tree, lone_targets: list[Layer]) -> list[str]:
    """Where target `Dense` layers are missing, the source's arrays its adapter
    says its files lack and nothing fills (`ties_of`: a Hugging Face folder
    without `lm_head.weight` whose `config.json` does not tie it), and why."""
    heads = [t.where for t in lone_targets if "Dense" in t.kinds]
    if not heads:
        return []
    return [
        _errors.HEAD_ABSENT.format(name=tie[0], why=tie[2], targets=", ".join(heads))
        for tie in ties_of(source)
        if len(tie) > 2 and not tie[1]
    ]


def _tie_lines(pairs: list[Pair], ties: tuple[Any, Any]) -> tuple[str, ...]:
    """The plan's lines for arrays held once under several names (`ties`: each
    side's `(name, same as)`): where they pair with several layers,
    `.shared.weight -> .encoder.embed_tokens, .decoder.embed_tokens` (one source
    array fills them) or `.a, .b -> .shared.weight` (one target array holds them:
    their values must be equal); else `lm_head.weight = wte.weight`. A tie
    inferred (a folder's `config.json`) says why: `(config.json: ...)`."""
    lines = []
    for side in (0, 1):
        ends = [(p.source, p.target)[:: 1 - 2 * side] for p in pairs]
        held = sorted({h for mine, _ in ends for h in mine.tied}, key=path_str)
        why = {parse(t[1]): f" ({t[2]})" for t in ties[side] if len(t) > 2 and t[1]}
        shown = set()
        for h in held:
            others = [other.where for mine, other in ends if h in mine.tied]
            if len(others) < 2:
                continue
            shown.add(h)
            if side == 0:
                lines.append(f"{path_str(h)} -> {', '.join(others)}{why.get(h, '')}")
            else:
                lines.append(
                    f"{', '.join(others)} -> {path_str(h)} (one array: their "
                    "values must be equal)"
                )
        lines += [
            f"{t[0]} = {t[1]}{why.get(parse(t[1]), '')}"
            for t in ties[side]
            if t[1] and parse(t[1]) not in shown
        ]
    return tuple(lines)


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


def _dropped(
    rules: Mapping[str, str | None] | None, sources: list[Layer], problems: list[str]
) -> tuple[dict[str, str], list[Layer], list[Layer]]:
    """The rules that pair, the source layers left, and those a rule
    `{pattern: None}` drops (a pattern that drops nothing is a problem)."""
    rules = dict(rules or {})
    drops = [p for p, r in rules.items() if r is None]
    dropped = [x for x in sources if any(re.fullmatch(p, x.where) for p in drops)]
    for p in drops:
        if not any(re.fullmatch(p, x.where) for x in sources):
            problems.append(
                _errors.RULE_UNUSED.format(pattern=p, layers=[x.where for x in sources])
            )
    kept = [x for x in sources if x not in dropped]
    return {p: r for p, r in rules.items() if r is not None}, kept, dropped


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


_SPLIT_WHERE_ALONE = frozenset({"MultiHeadAttention"})
"""Kinds read as their sublayers on a side where the other side has none of them
(`nnx.MultiHeadAttention`'s `query`/`key`/`value`/`out` against Hugging Face's
`q_proj`/`k_proj`/`v_proj`/`o_proj`)."""


def _opened(
    sources: list[Layer],
    targets: list[Layer],
    lone_sources: list[Layer],
    lone_targets: list[Layer],
) -> tuple[frozenset[str], frozenset[str]]:
    """Per side, the kinds of `_SPLIT_WHERE_ALONE` of its unpaired layers that the
    other side has no layer of."""
    kinds = [{k for x in side for k in x.kinds} for side in (sources, targets)]
    lone = [{k for x in side for k in x.kinds} for side in (lone_sources, lone_targets)]
    return (
        frozenset(_SPLIT_WHERE_ALONE & lone[0] - kinds[1]),
        frozenset(_SPLIT_WHERE_ALONE & lone[1] - kinds[0]),
    )


def _paired(
    source: Tree,
    target: Tree,
    rules: Mapping[str, str | None] | None,
    problems: list[str],
    traces: tuple[Any, Any],
    axes: tuple[dict[Path, Any], dict[Path, Any]],
    opened: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset()),
    ties: tuple[dict[Path, Path], dict[Path, Path]] = ({}, {}),
) -> tuple[
    list[Layer], list[Layer], list[str], list[Pair], list[Layer], list[Layer], list
]:
    """Both sides' layers (stacks' layer axes from `axes`, a layer per tied name
    from `ties`), settings told, and their pairing: `(sources, targets, told,
    pairs, lone sources, lone targets, source layers dropped by rules)`."""
    sources = find_layers(
        source, problems, told=True, axes=axes[0], views=True, opened=opened[0]
    )
    targets = find_layers(
        target, problems, told=True, axes=axes[1], views=True, opened=opened[1]
    )
    sources = with_ties(source, sources, ties[0], problems, views=True)
    targets = with_ties(target, targets, ties[1], problems, views=True)
    with_heads((sources, targets), traces, problems)
    products((sources, targets), traces, problems)
    computed((sources, targets), traces, problems)
    for side, trace in ((sources, traces[0]), (targets, traces[1])):
        for x in read_axes(side, trace, problems):  # weight norms' `v` layouts
            read_specs(x, problems)
    told = tell_settings((sources, targets), problems)
    _read_views(sources, targets, traces[0], problems)
    _read_views(targets, sources, traces[1], problems)
    orders = (
        Order(source, {x.stack[0] for x in sources if x.stack}, traces[0]),
        Order(target, {x.stack[0] for x in targets if x.stack}, traces[1]),
    )
    kept, sources, dropped = _dropped(rules, sources, problems)
    pairs, lone_sources, lone_targets = pair(sources, targets, kept, problems, orders)
    return sources, targets, told, pairs, lone_sources, lone_targets, dropped


def _ties(tree: Tree) -> dict[Path, Path]:
    """`{leaf path of a tied name: the leaf path the Tree holds the array at}`
    that the Tree's adapter knows (a PyTorch module's or state dict's ties)."""
    return {parse(tie[0]): parse(tie[1]) for tie in ties_of(tree) if tie[1]}


def _traced_ties(trace: Trace | None, known: dict[Path, Path]) -> dict[Path, Path]:
    """`known` and the ties the side's traced model shows (a Hugging Face folder
    stores a tied array once; the model built from its `config.json` holds it
    under every name), asked only where a side's forward pass is traced anyway."""
    if trace is None or _own_trace(trace) is None or not trace():
        return known
    return {**known, **trace.ties()}


def _own_trace(trace: Trace) -> Any:
    """The adapter's own trace (a framework JAX does not trace: PyTorch), or
    None: only such a trace can show ties the Tree does not hold."""
    name = framework(trace.tree)
    return None if name is None else adapter_named(name).trace


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


def _untraced_first(
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


def _traced_axes(open_: list, traces: tuple[Any, Any]) -> dict[tuple, int]:
    """`{(side, stack path, candidates): axis}` for the stacks whose layer axis
    the shapes leave open and a traced forward pass scans over (every array of the
    stack the scan iterates over at one stored axis, among the candidates)."""
    out = {}
    for side, path, candidates in open_:
        trace = traces[side]
        if trace is None or not trace():
            continue
        found = {
            a
            for p, a in trace.layer_axes().items()
            if p[: len(path)] == path and len(p) > len(path)
        }
        if len(found) == 1 and next(iter(found)) in candidates:
            out[(side, path, candidates)] = found.pop()
    return out


def _read_views(
    layers: list[Layer], others: list[Layer], trace: Any, problems: list[str]
) -> None:
    """Each per-head kernel's reading (`_general.choose`): the forward pass's on the
    example inputs, else the one its shapes allow, else those whose fused shape the
    other side has; where several remain the layer is `undecided`. A kernel the
    trace shows applied per head loses its `Dense` view."""
    viewed = [x for x in layers if x.readings]
    if not viewed:
        return
    wanted = wanted_shapes(others)
    traced = {} if trace is None else (trace() and trace.contractions()) or {}
    for x in viewed:
        view = next(c for c in x.codecs if reading_of(c) is not None)
        shape = tuple(x.leaves["kernel"].shape)
        axis = x.axis if x.index is not None else None
        choice = choose(shape, x.readings, traced.get(kernel_path(x)), wanted, axis)
        if choice is None:
            x.codecs = tuple(c for c in x.codecs if c is not view)
            x.specs.pop("Dense", None)
            continue
        x.undecided = choice.undecided
        chosen = dense_view(view.framework, choice.reading)
        if chosen is not view:
            x.codecs = tuple(chosen if c is view else c for c in x.codecs)
            read_specs(x, problems)


def _contradicted(pairs: list[Pair], traces: tuple[Any, Any]) -> list[str]:
    """Pairs the forward passes contradict: in the source layer `a` feeds `b`
    (`b`'s input is computed from `a`'s arrays), in the target `b`'s partner feeds
    `a`'s. Names (or order) paired them, the computation says otherwise: refused,
    whatever paired them but rules (the user's word)."""
    if traces[0] is None or traces[1] is None or not traces[0]() or not traces[1]():
        return []
    checked = [p for p in pairs if p.by != "rule" and p.source.index is None]
    checked = [p for p in checked if p.target.index is None]
    # a tied array's names share its bit: each seems to feed what the others do
    checked = [p for p in checked if not p.source.tied and not p.target.tied]
    if len(checked) < 2:
        return []
    sides = []
    for side, trace in enumerate(traces):
        found = dependence(trace, [(p.source, p.target)[side] for p in checked])
        sides.append(([f[0] for f in found], [f[1] for f in found]))
    (s_own, s_feeds), (t_own, t_feeds) = sides
    out = []
    for i, j in itertools.permutations(range(len(checked)), 2):
        if s_own[i] & s_feeds[j] and t_own[j] & t_feeds[i]:  # i before j; j before i
            a, b = checked[i], checked[j]
            out.append(
                _errors.CONTRADICTED.format(
                    a=a.source.where,
                    b=b.source.where,
                    ta=a.target.where,
                    tb=b.target.where,
                    by=a.by if a.by == b.by else f"{a.by}, {b.by}",
                    a_re=re.escape(a.source.where),
                    b_re=re.escape(b.source.where),
                )
            )
    return out


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


def _tracer(
    tree: Tree,
    example: Example | None,
    side: int,
    problems: list[str],
    recorded: Mapping[Path, tuple[int, ...]] | None = None,
) -> Trace | None:
    """The side's `Trace` (the order of use `recorded` in a file standing for its
    forward pass), or None without example inputs."""
    if example is None:
        return None
    return Trace(tree, example, side, problems, recorded)


def port_plan(
    source: Any,
    target: Any,
    *,
    rules: Mapping[str, str | None] | None = None,
    example: Any = None,
    example_kwargs: Mapping[str, Any]
    | tuple[Mapping[str, Any], Mapping[str, Any]]
    | None = None,
) -> Plan:
    """Show how `bridge.port(source, target)` would pair layers, before moving anything.

    **Arguments:**

    - `source`, `target`: models of any framework, as `bridge.port` takes them.
    - `rules`, `example`, `example_kwargs`: as in `bridge.port` (with example
      inputs, the `by` column says `trace` for layers paired in the order the
      forward passes use them).

    **Returns:**

    A `Plan`; `print(plan)` shows one row per layer: `~` when the two names differ,
    source path, target path, layer kind, what paired them (`path`, `name`, `rule`,
    `shape`, `order`, `kind`: see the guide "How layers are paired"), the transform
    applied (`copy`, `Flax -> weight (out, in)`, `Flax -> stats in State`, ...), and the
    shapes in Flax's layout; then the missing and unexpected layers, the hyperparameter
    warnings, and the problems `bridge.port` would raise for. `port_plan` itself never
    raises for them: it is the place to look at them.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, flax.linen as nn, equinox as eqx, bridge
    >>> dense = nn.Dense(3)
    >>> variables = dense.init(jax.random.key(0), jnp.ones((1, 2)))
    >>> linear = eqx.nn.Linear(2, 3, key=jax.random.key(1))
    >>> print(bridge.port_plan((dense, variables), linear))
    ~  source  target  kind   by    transform                shapes (Flax layout)
    -  ------  ------  -----  ----  -----------------------  --------------------
       (root)  (root)  Dense  path  Flax -> weight (out,in)  kernel (2, 3), bias (3,)

    ```
    """
    check_model(source, "source")
    check_model(target, "target")
    check_rules(rules)
    check_inputs(example, "example")
    check_pair_or_mapping(example_kwargs, "example_kwargs")
    given = None if example is None else Example(example, example_kwargs)
    plan, _ = make_plan(source, placeholders(target), rules, False, None, given)
    return plan
