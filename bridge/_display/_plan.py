"""How a port plan (`bridge.port_plan`) and a report (`bridge.Report`) look in a
notebook: the plan as a table to scan (source ↔ target, the kind, how each pair was
decided, the layout change), runs of the same pairing over numbered layers folded,
what is left or refused highlighted; the report's groups the same way.

Read from the objects' public fields only: a plan's `steps` (each `source`,
`target`, `kind`, `by`, `transform`, `shapes`, `renamed`), `missing`, `unexpected`,
`mismatched`, `dropped`, `computed_by_target`, `computed_by_source`, `constants`,
`warnings`, `tied`, `problems`; a report's `missing`, `unexpected`, `mismatched`,
`dropped`, `computed_by_target`, `computed_by_source`, `tied`, `source`, `target`,
`complete`.
"""

from __future__ import annotations

import re
from typing import Any

from ._outline import Line, Span, html, table_html, treescope


BY = {
    "rule": "a rule you gave",
    "path": "the same path",
    "name": "the same name (case and separators aside)",
    "trace": "the traced computations (order of use, what each computes)",
    "shape": "the only layer of its kind and shapes",
    "order": "kind, shapes and the order the layers were created in",
    "kind": "the only layer of its kind",
}
"""What each `by` of a plan's step means: how the pair was decided."""

GUESSES = frozenset({"shape", "order", "kind"})
"""Pairings by place, not by name or computation: shown as warnings."""

# (title, plan/report field, style): the groups of what a port leaves or refuses
GROUPS = (
    ("problems (the port raises)", "problems", "problem"),
    ("missing: kept as they are", "missing", "warning"),
    ("unexpected: left out", "unexpected", "warning"),
    ("mismatched shapes: the target's values kept", "mismatched", "warning"),
    ("warnings", "warnings", "warning"),
    ("dropped by rules", "dropped", "muted"),
    ("computed by the target: stored tables left out", "computed_by_target", "muted"),
    ("computed by the source: stored tables kept", "computed_by_source", "muted"),
    ("constants both models compute: not moved", "constants", "muted"),
    ("tied: stored once", "tied", "muted"),
)

_NUMBER = re.compile(r"\d+")


def _runs(steps: tuple[Any, ...]) -> list[list[Any]]:
    """The steps in runs, each where its first step is: the steps alike but for
    the first number of their paths, which counts up by one on both sides from
    step to step (the layers of a stack or a list: `layers[0].q -> h.0.q`,
    `layers[1].q -> h.1.q`, ...), are one run; any other step is alone."""

    def key(step: Any) -> tuple:
        first = (_NUMBER.sub("#", step.source, 1), _NUMBER.sub("#", step.target, 1))
        return (*first, step.kind, step.by, step.transform, step.shapes, step.renamed)

    def number(path: str) -> int | None:
        found = _NUMBER.search(path)
        return None if found is None else int(found.group())

    alike: dict[tuple, list[Any]] = {}
    for step in steps:
        alike.setdefault(key(step), []).append(step)
    out, done = [], set()
    for step in steps:
        run = alike[key(step)]
        pairs = [(number(s.source), number(s.target)) for s in run]
        a0, b0 = pairs[0]
        counts = (
            len(run) > 1
            and a0 is not None
            and b0 is not None
            and pairs == [(a0 + i, b0 + i) for i in range(len(run))]
        )
        if not counts:
            out.append([step])
        elif id(run[0]) not in done:
            done.add(id(run[0]))
            out.append(run)
    return out


def _spanned(first: str, last: str) -> str:
    """Two paths of a run as one: `.layers[0..11].q`."""
    end = _NUMBER.search(last)
    if end is None:
        return first
    return _NUMBER.sub(lambda m: f"{m.group()}..{end.group()}", first, 1)


def _row(steps: list[Any]) -> tuple[list[Span], str]:
    first, last = steps[0], steps[-1]
    source = first.source if len(steps) == 1 else _spanned(first.source, last.source)
    target = first.target if len(steps) == 1 else _spanned(first.target, last.target)
    times = f"{len(steps)} × " if len(steps) > 1 else ""
    by = Span(first.by, "warning" if first.by in GUESSES else "ok")
    cells = [
        Span(("~ " if first.renamed else "") + times + source, "name"),
        Span("→", "muted"),
        Span(target, "name"),
        Span(first.kind, "kind"),
        by,
        Span(first.transform or "as stored", "shape"),
        Span(first.shapes, "muted"),
    ]
    return cells, "warning" if first.by in GUESSES and first.renamed else ""


def _summary(plan: Any) -> str:
    counts: dict[str, int] = {}
    for step in plan.steps:
        counts[step.by] = counts.get(step.by, 0) + 1
    by = ", ".join(
        f"{n} by {b}" for b, n in sorted(counts.items(), key=lambda x: -x[1])
    )
    left = [
        f"{len(getattr(plan, f))} {f}"
        for f in ("missing", "unexpected", "mismatched", "problems")
        if getattr(plan, f, ())
    ]
    refused = f" (refused: {len(plan.problems)} problems)" if plan.problems else ""
    return (
        f"Plan{refused}: {len(plan.steps)} layers paired"
        + (f" ({by})" if by else "")
        + (": " + ", ".join(left) if left else "")
    )


def _groups(obj: Any) -> list[Line]:
    """A line per non-empty group of what is left or refused, its entries under it."""
    out = []
    for title, field, style in GROUPS:
        entries = getattr(obj, field, ()) or ()
        if entries:
            head = (Span(f"{title} ({len(entries)})", style),)
            items = tuple(Line((Span(str(e), style),)) for e in entries)
            out.append(Line(head, items, folded=style == "muted"))
    return out


def plan_outline(plan: Any) -> Line:
    """The plan as an outline (treescope): the summary, a line per run of pairs
    (`source -> target (kind, by): transform`), the groups."""
    lines = []
    for run in _runs(plan.steps):
        cells, _ = _row(run)
        spans = (
            cells[0], Span(" -> "), cells[2], Span(" ("), cells[3], Span(", by "),
            cells[4], Span("): "), cells[5],
        )  # fmt: skip
        inner = tuple(
            Line((_row([s])[0][0], Span(" -> "), Span(s.target))) for s in run
        )
        lines.append(Line(spans, inner if len(run) > 1 else (), folded=True))
    return Line((Span(_summary(plan), "head"),), (*lines, *_groups(plan)))


def plan_html(plan: Any) -> str:
    """The plan as an HTML table (Jupyter), a run's rows in a fold of its first
    cell, the groups under it."""
    rows: list[tuple[list[Any], str]] = []
    for run in _runs(plan.steps):
        cells, style = _row(run)
        if len(run) > 1:
            pairs = tuple(
                Line((Span(f"{s.source} → {s.target}", "muted"),)) for s in run
            )
            rows.append(([Line((cells[0],), pairs, folded=True), *cells[1:]], style))
        else:
            rows.append((list(cells), style))
    head = ("source", "", "target", "kind", "paired by", "layout change", "shapes")
    table = table_html(head, rows, _summary(plan))
    keys = ", ".join(f"{b}: {m}" for b, m in BY.items())
    legend = f'<div style="color: #6e7781; font-size: 11px">paired by — {keys}</div>'
    groups = "".join(html(g) for g in _groups(plan))
    return f"<div>{table}{legend}{groups}</div>"


def plan_treescope(plan: Any, path: Any, subtree_renderer: Any) -> Any:
    return treescope(plan_outline(plan), path)


def report_outline(report: Any) -> Line:
    """The report as an outline: whether the port is complete, each group under."""
    done = "complete" if report.complete else "incomplete"
    head = Span(
        f"Report ({done}): {report.source} -> {report.target}",
        "ok" if report.complete else "warning",
    )
    return Line((head,), tuple(_groups(report)))


def report_html(report: Any) -> str:
    return html(report_outline(report))


def report_treescope(report: Any, path: Any, subtree_renderer: Any) -> Any:
    return treescope(report_outline(report), path)
