"""`port_plan` and the plan `port` runs: the steps from two models to a `Plan`.

1. read each side once (`_side.read_side`: the Tree, its adapter's answers, its
   wrapped models, ties, and its forward pass on the example inputs, traced when a
   step first asks);
2. find each side's layers (`_find`), then what the traced computations say of
   them (`_heads`, `_product`, `_computed`, `_weight_norm`, `_general`'s readings);
3. pair them (`_pairing`: rules, names, kinds and shapes in the order of use or of
   creation), read again where the pairing shows more (`_found`);
4. check every pair and the layers left (`_checks`); the result is a `Plan`
   (`_plan`), which `_run` executes.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from .._adapters._native import check_model, placeholders
from .._arguments import check_inputs, check_pair_or_mapping, check_rules
from .._paths import Path, parse, path_str
from . import _errors, _split
from ._checks import check_pairs, check_unpaired, untraced_first
from ._computed import computed
from ._find import find_layers, with_ties
from ._general import choose, dense_view, kernel_path, reading_of, wanted_shapes
from ._heads import with_heads
from ._layer import Layer, read_specs, tell_settings
from ._norms import read_norms
from ._order import Order
from ._pairing import Pair, pair
from ._plan import Plan
from ._product import biases_apart, lookups, products
from ._side import Side, read_side
from ._trace import Example
from ._weight_norm import read_axes


class Found(NamedTuple):
    """Both sides' layers and their pairing (steps 2 and 3)."""

    sources: list[Layer]
    targets: list[Layer]
    told: list[str]  # settings one side told the other (warnings)
    pairs: list[Pair]
    lone_sources: list[Layer]
    lone_targets: list[Layer]
    dropped: list[Layer]  # source layers a rule `{pattern: None}` leaves out


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
    the source's.

    The steps, in order: read each side (`_side`), find its layers (`_find` and the
    readings of the traced computation), pair them (`_pairing`), check every pair
    and the layers left (`_checks`)."""
    problems: list[str] = []
    sides = (
        read_side(source, 0, problems, example, source_uses),
        read_side(target, 1, problems, example),
    )
    found = _found(sides, rules, problems)
    checked = check_pairs(found.pairs, sides, strict, dtype, problems)
    left = check_unpaired(found, sides, strict, problems)
    problems[:] = untraced_first(problems, (sides[0].trace, sides[1].trace))
    plan = Plan(
        checked.steps,
        tuple(t.where for t in left.targets),
        tuple(s.where for s in left.sources),
        tuple(found.told) + checked.warnings,
        _tie_lines(found.pairs, (sides[0].tie_records, sides[1].tie_records)),
        tuple(problems),
        sides[0].tree,
        sides[1].tree,
        checked.mismatched,
        tuple(s.where for s in found.dropped),
        left.computed_by_target,
        left.computed_by_source,
        left.constants,
        (_channel_first(sides[0]), _channel_first(sides[1])),
    )
    return plan, problems


def _channel_first(side: Side) -> bool:
    """Whether the side's pass took the example images channels first."""
    return side.trace is not None and side.trace.channel_first


def _found(
    sides: tuple[Side, Side],
    rules: Mapping[str, str | None] | None,
    problems: list[str],
) -> Found:
    """Both sides' layers, paired (`_paired`), read again where the first
    pairing shows what else the sides say: the ties a traced model shows (a
    folder's), an attention to read as its projections where the other side has
    them apart, a stack's layer axis the shapes leave open (the traced scan's
    axis, else the one choice that pairs everything)."""
    axes: tuple[dict[Path, Any], dict[Path, Any]] = ({}, {})
    first: list[str] = []
    ties = (sides[0].ties, sides[1].ties)
    read = _paired(sides, rules, first, axes, ties=ties)
    if first or read.lone_sources or read.lone_targets:  # ties a traced model shows
        traced = (_traced_ties(sides[0], ties[0]), _traced_ties(sides[1], ties[1]))
        if traced != ties:
            ties, first = traced, []
            read = _paired(sides, rules, first, axes, ties=ties)
    opened = _opened(read)
    if opened != (frozenset(), frozenset()):  # an attention against projections
        first = []
        read = _paired(sides, rules, first, axes, opened, ties)
    open_ = [(side, p, c) for side in (0, 1) for p, c in axes[side].items()]
    fixed: tuple[dict[Path, Any], dict[Path, Any]] = ({}, {})
    for (side, path, _), axis in _traced_axes(open_, sides).items():
        fixed[side][path] = axis  # the forward pass scans the stack over `axis`
    if fixed[0] or fixed[1]:
        first = []
        chosen = (dict(fixed[0]), dict(fixed[1]))
        read = _paired(sides, rules, first, chosen, opened, ties)
        open_ = [x for x in open_ if x[1] not in fixed[x[0]]]
    if not open_:
        read, first = _with_parts(read, sides, rules, first, axes, opened, ties)
        problems += first
        return _with_biases(read, sides, problems)
    fitting = []  # stacks whose layer axis the shapes leave open: the other side
    for choice in itertools.product(*(c for _, _, c in open_)):
        chosen = (dict(fixed[0]), dict(fixed[1]))
        for (side, path, _), axis in zip(open_, choice):
            chosen[side][path] = axis
        trial: list[str] = []
        attempt = _paired(sides, rules, trial, chosen, opened, ties)
        if not trial and not attempt.lone_sources and not attempt.lone_targets:
            fitting.append(attempt)
    if len(fitting) == 1:
        return _with_biases(fitting[0], sides, problems)
    problems += first
    for side, path, candidates in open_:
        problems.append(
            _errors.STACK_AXIS.format(
                where=f"{sides[side].name} {path_str(path)}",
                axes=list(candidates),
                lengths="several",
            )
        )
    return read


def _with_parts(
    read: Found,
    sides: tuple[Side, Side],
    rules: Mapping[str, str | None] | None,
    first: list[str],
    axes: tuple[dict[Path, Any], dict[Path, Any]],
    opened: tuple[frozenset[str], frozenset[str]],
    ties: tuple[dict[Path, Path], dict[Path, Path]],
) -> tuple[Found, list[str]]:
    """`read` again with each fused Dense the first pairing left against layers
    that split it read as its parts (`_split.fused`), where both forward passes are
    traced (the example inputs then check which part is which); else as it was."""
    if not all(side.trace is not None and side.trace() for side in sides):
        return read, first
    found = _split.fused((read.sources, read.targets))
    if not found:
        return read, first
    split = (
        {x.path: found[id(x)] for x in read.sources if id(x) in found},
        {x.path: found[id(x)] for x in read.targets if id(x) in found},
    )
    again: list[str] = []
    attempt = _paired(sides, rules, again, axes, opened, ties, split)
    return attempt, again


def _with_biases(read: Found, sides: tuple[Side, Side], problems: list[str]) -> Found:
    """`read` with the biases one side holds apart from their products joined to
    them (`_product.biases_apart`)."""
    if not read.lone_sources and not read.lone_targets:
        return read
    traces = (sides[0].trace, sides[1].trace)
    lone = biases_apart(
        read.pairs, (read.lone_sources, read.lone_targets), traces, problems
    )
    return read._replace(lone_sources=lone[0], lone_targets=lone[1])


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


_SPLIT_WHERE_ALONE = frozenset({"MultiHeadAttention"})
"""Kinds read as their sublayers on a side where the other side has none of them
(`nnx.MultiHeadAttention`'s `query`/`key`/`value`/`out` against Hugging Face's
`q_proj`/`k_proj`/`v_proj`/`o_proj`)."""


def _opened(read: Found) -> tuple[frozenset[str], frozenset[str]]:
    """Per side, the kinds of `_SPLIT_WHERE_ALONE` of its unpaired layers that the
    other side has no layer of."""
    kinds = [
        {k for x in side for k in x.kinds} for side in (read.sources, read.targets)
    ]
    lone = [
        {k for x in side for k in x.kinds}
        for side in (read.lone_sources, read.lone_targets)
    ]
    return (
        frozenset(_SPLIT_WHERE_ALONE & lone[0] - kinds[1]),
        frozenset(_SPLIT_WHERE_ALONE & lone[1] - kinds[0]),
    )


def _paired(
    sides: tuple[Side, Side],
    rules: Mapping[str, str | None] | None,
    problems: list[str],
    axes: tuple[dict[Path, Any], dict[Path, Any]],
    opened: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset()),
    ties: tuple[dict[Path, Path], dict[Path, Path]] = ({}, {}),
    split: tuple[dict[Path, int], dict[Path, int]] = ({}, {}),
) -> Found:
    """Both sides' layers (stacks' layer axes from `axes`, a layer per tied name
    from `ties`, the kinds in `opened` read as their sublayers), what the traced
    computations say of them, settings told, and their pairing."""
    found = []
    for side in sides:
        layers = find_layers(
            side,
            problems,
            told=True,
            axes=axes[side.index],
            views=True,
            opened=opened[side.index],
        )
        found.append(with_ties(side, layers, ties[side.index], problems, views=True))
    sources, targets = found
    traces = (sides[0].trace, sides[1].trace)
    with_heads((sources, targets), traces, problems)
    products((sources, targets), traces, problems)
    lookups((sources, targets), traces, problems)
    computed((sources, targets), traces, problems)
    read_norms((sources, targets), traces, problems)
    for layers, trace in ((sources, traces[0]), (targets, traces[1])):
        for x in read_axes(layers, trace, problems):  # weight norms' `v` layouts
            read_specs(x, problems)
    for layers, parts in ((sources, split[0]), (targets, split[1])):
        if parts:
            layers[:] = [
                y
                for x in layers
                for y in (
                    _split.parts(x, parts[x.path], problems)
                    if x.path in parts and x.index is None
                    else [x]
                )
            ]
    told = tell_settings((sources, targets), problems)
    _read_views(sources, targets, traces[0], problems)
    _read_views(targets, sources, traces[1], problems)
    orders = tuple(
        Order(
            side.tree, {x.stack[0] for x in layers if x.stack}, trace, side.auto_named
        )
        for side, layers, trace in zip(sides, (sources, targets), traces)
    )
    kept, sources, dropped = _dropped(rules, sources, problems)
    pairs, lone_sources, lone_targets = pair(sources, targets, kept, problems, orders)
    return Found(sources, targets, told, pairs, lone_sources, lone_targets, dropped)


def _order(side: Side, layers: list[Layer]) -> Order:
    stacks = {x.stack[0] for x in layers if x.stack}
    return Order(side.tree, stacks, side.trace, side.auto_named)


def _traced_ties(side: Side, known: dict[Path, Path]) -> dict[Path, Path]:
    """`known` and the ties the side's traced model shows (a Hugging Face folder
    stores a tied array once; the model built from its `config.json` holds it
    under every name), asked only where a side's forward pass is traced anyway."""
    if side.trace is None or not side.own_trace() or not side.trace():
        return known
    return {**known, **side.trace.ties()}


def _traced_axes(open_: list, sides: tuple[Side, Side]) -> dict[tuple, int]:
    """`{(side, stack path, candidates): axis}` for the stacks whose layer axis
    the shapes leave open and a traced forward pass scans over (every array of the
    stack the scan iterates over at one stored axis, among the candidates)."""
    out = {}
    for side, path, candidates in open_:
        trace = sides[side].trace
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
