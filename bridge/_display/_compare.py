"""How `bridge.compare`'s result looks: the largest difference of the outputs, and
the difference layer by layer along the model (the first layer where two ports part
is what one looks for): a sparkline and the first layer above `TOLERANCE` in a
terminal, a plot (inline SVG: no plotting library) and a table in Jupyter.

Read from the result's public face only: `float(c)`, `c.layers` (each `a`, `b`,
`difference`), `c.why`.
"""

from __future__ import annotations

import html as html_lib
import math
from typing import Any

from ._outline import Line, Span, html, text, treescope


TOLERANCE = 1e-4
"""A layer's difference above which it is said to part (float32 rounding through
different summation orders stays below)."""

FLOOR = 1e-9
"""The smallest difference the sparkline and the plot tell from zero."""

BARS = "▁▂▃▄▅▆▇█"
WIDEST = 60
"""The most bars a sparkline has (a longer model's layers pooled, their largest)."""


def _level(difference: float, top: float) -> float:
    """Where `difference` lies between `FLOOR` and `top`, log scale, 0 to 1."""
    low, high = math.log10(FLOOR), math.log10(max(top, FLOOR * 10))
    return (math.log10(max(difference, FLOOR)) - low) / (high - low)


def sparkline(differences: list[float | None]) -> str:
    """`▁▁▂▃█`: each layer's difference (log scale); `·` where not comparable."""
    if len(differences) > WIDEST:  # pooled: the largest of each bucket
        size = math.ceil(len(differences) / WIDEST)
        buckets = [differences[i : i + size] for i in range(0, len(differences), size)]
        differences = [
            max((d for d in b if d is not None), default=None) for b in buckets
        ]
    top = max((d for d in differences if d is not None), default=0.0)
    return "".join(
        "·" if d is None else BARS[min(7, int(_level(d, top) * 7.999))]
        for d in differences
    )


def _first_above(layers: tuple[Any, ...]) -> Any:
    return next(
        (x for x in layers if x.difference is not None and x.difference > TOLERANCE),
        None,
    )


def comparison_outline(c: Any) -> Line:
    head = Span(f"{float(c):.2e}", "problem" if float(c) > TOLERANCE else "ok")
    spans = (
        Span("Comparison: ", "head"),
        head,
        Span("  # the outputs' largest difference", "muted"),
    )
    if not c.layers:
        return Line(spans, (Line((Span(c.why or "no layer to compare", "muted"),)),))
    values = [x.difference for x in c.layers]
    top = max((d for d in values if d is not None), default=0.0)
    lines = [
        Line((
            Span(f"{len(values)} layers along a: ", "muted"),
            Span(sparkline(values), "shape"),
            Span(f"  (log scale, ▁ {FLOOR:.0e} … █ {top:.1e})", "muted"),
        ))
    ]  # fmt: skip
    first = _first_above(c.layers)
    if first is None:
        lines.append(Line((Span(f"every layer within {TOLERANCE:.0e}", "ok"),)))
    else:
        lines.append(
            Line((
                Span(f"first above {TOLERANCE:.0e}: ", "warning"),
                Span(f"{first.a} -> {first.b}", "name"),
                Span(f"  {first.difference:.2e}", "problem"),
            ))
        )  # fmt: skip
    return Line(spans, tuple(lines))


def comparison_text(c: Any) -> str:
    return text(comparison_outline(c))


def _plot(values: list[float | None], width: int = 480, height: int = 110) -> str:
    """The differences along the model as an inline SVG line plot, log scale, the
    tolerance dashed."""
    top = max((d for d in values if d is not None), default=0.0)
    n = max(len(values) - 1, 1)
    points = [
        (8 + (width - 16) * i / n, height - 10 - (height - 20) * _level(d, top))
        for i, d in enumerate(values)
        if d is not None
    ]
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    y_tol = height - 10 - (height - 20) * _level(TOLERANCE, top)
    dots = "".join(
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="#0969da"/>' for x, y in points
    )
    tolerance = (
        f'<line x1="8" x2="{width - 8}" y1="{y_tol:.1f}" y2="{y_tol:.1f}" '
        'stroke="#cf222e" stroke-dasharray="4 3"/>'
        if 10 <= y_tol <= height - 10
        else ""
    )
    return (
        f'<svg width="{width}" height="{height}" '
        'style="border: 1px solid #d0d7de; background: #fff">'
        f'{tolerance}<polyline points="{path}" fill="none" stroke="#0969da"/>'
        f"{dots}</svg>"
    )


def comparison_html(c: Any) -> str:
    page = html(comparison_outline(c))
    if not c.layers:
        return page
    values = [x.difference for x in c.layers]
    rows = "".join(
        '<tr><td style="padding: 0 8px">'
        f'{html_lib.escape(x.a)}</td><td style="padding: 0 8px">'
        f'{html_lib.escape(x.b)}</td><td style="padding: 0 8px; text-align: right; '
        f'color: {"#cf222e" if (x.difference or 0) > TOLERANCE else "#1f2328"}">'
        f"{'—' if x.difference is None else f'{x.difference:.2e}'}</td></tr>"
        for x in c.layers
    )
    table = (
        '<details><summary style="cursor: pointer">each layer</summary>'
        '<table style="font-family: monospace; font-size: 12px"><thead><tr>'
        "<th>a</th><th>b</th><th>difference</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></details>"
    )
    return f"<div>{page}{_plot(values)}{table}</div>"


def comparison_treescope(c: Any, path: Any, subtree_renderer: Any) -> Any:
    return treescope(comparison_outline(c), path)
