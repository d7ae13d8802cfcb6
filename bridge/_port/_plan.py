"""`port_plan`: which source layer goes where, how, and what does not fit."""

from __future__ import annotations

import re
import shutil
import textwrap
from dataclasses import dataclass, field
from typing import Any

from .._display._plan import plan_html, plan_treescope
from .._tree import Tree
from ._codec import Codec
from ._layer import Layer


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
    - `computed_by_target`: source layers without a target layer that hold what
      the target computes from its config: a stored sinusoidal position table
      (`embed_positions.weight` of transformers' Marian, Pegasus, RoFormer; left
      out only with `strict=False`, else an error: a table may be learned), rotary
      inverse frequencies, position ids, a causal mask (left out). Recognised by
      their values, never by name: a learned array is `unexpected`.
    - `computed_by_source`: target layers without a source layer whose values are
      such an array, which the source computes: they keep their values (a table
      only with `strict=False`).
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
    _channel_first: tuple[bool, bool] = field(default=(False, False), repr=False)
    """Per side, whether its traced pass took the example images channels first
    (`Trace.channel_first`): run so again where the port checks its outputs."""

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

    _repr_html_ = plan_html
    __treescope_repr__ = plan_treescope


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
