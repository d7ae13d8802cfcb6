"""An outline: lines of styled spans, each with the lines under it, and its three
renderings: plain text (a terminal, one line each, indented), HTML (Jupyter: a fold
per line with lines under it, colours by kind) and treescope's parts (`nnx.display`,
`treescope.show`). What each object shows is built once, as `Line`s, by
`_display._plan`, `_report`, `_compare` and `bridge._tree`.

```python
>>> line = Line((Span("layers[0..11]: ", "name"), Span("12 × ", "count"),
...              Span("Block", "kind")), (Line((Span(".q (Dense)"),)),), folded=True)
>>> print(text(line))
layers[0..11]: 12 × Block
  .q (Dense)

```
"""

from __future__ import annotations

import hashlib
import html as html_lib
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple


class Span(NamedTuple):
    """A piece of a line: its `text` and `style` (`""` plain, `"name"`, `"kind"`
    coloured by its text, `"shape"`, `"count"`, `"muted"`, `"ok"`, `"warning"`,
    `"problem"`, `"head"`)."""

    text: str
    style: str = ""


class Line(NamedTuple):
    """One line and the lines under it; `folded`: shown closed at first where a
    fold can be opened (HTML, treescope), as repeated blocks are."""

    spans: tuple[Span, ...]
    children: tuple[Line, ...] = ()
    folded: bool = False


INDENT = "  "


def text(line: Line) -> str:
    """The outline as text: a line each, indented two spaces per level."""
    return "\n".join(_text_lines(line, 0))


def _text_lines(line: Line, depth: int) -> Iterator[str]:
    yield INDENT * depth + "".join(s.text for s in line.spans).rstrip()
    for child in line.children:
        yield from _text_lines(child, depth + 1)


def count(line: Line) -> int:
    """How many lines `text(line)` has."""
    return 1 + sum(count(c) for c in line.children)


# --- HTML (Jupyter) ---------------------------------------------------------------

_FONT = (
    "font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; "
    "font-size: 12px; line-height: 1.45"
)
_STYLES = {
    "": "",
    "name": "color: #1f2328",
    "shape": "color: #3b5b92",
    "count": "color: #6e7781",
    "muted": "color: #6e7781",
    "ok": "color: #1a7f37",
    "warning": "color: #9a6700; background: #fff8c5",
    "problem": "color: #cf222e; background: #ffebe9; font-weight: 600",
    "head": "font-weight: 600",
}


def hue(key: str) -> int:
    """A stable hue (0-359) for a kind's name: the same kind, the same colour."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:2], "big") % 360


def kind_style(key: str) -> str:
    h = hue(key)
    return (
        f"color: hsl({h}, 60%, 30%); background: hsl({h}, 70%, 94%); "
        "border-radius: 3px; padding: 0 3px"
    )


def _span_html(span: Span) -> str:
    style = (
        kind_style(span.text.strip())
        if span.style == "kind"
        else _STYLES.get(span.style, "")
    )
    body = html_lib.escape(span.text)
    return f'<span style="{style}">{body}</span>' if style else body


def html(line: Line) -> str:
    """The outline as HTML: nested `<details>` folds (native: no script), the
    folded ones closed."""
    return f'<div style="{_FONT}">{_html_line(line)}</div>'


def _html_line(line: Line) -> str:
    head = "".join(_span_html(s) for s in line.spans)
    if not line.children:
        return f'<div style="white-space: pre; padding-left: 1.1em">{head}</div>'
    inner = "".join(_html_line(c) for c in line.children)
    opened = "" if line.folded else " open"
    return (
        f'<details{opened}><summary style="white-space: pre; cursor: pointer">'
        f'{head}</summary><div style="margin-left: 1.4em">{inner}</div></details>'
    )


def table_html(
    head: Iterable[str],
    rows: Iterable[tuple[Iterable[Span | Line], str]],
    caption: str = "",
) -> str:
    """A table (the plan's): `rows` of `(cells, row style)`, each cell a Span, or a
    Line (a fold in the cell: a run of rows)."""
    th = "".join(
        f'<th style="text-align: left; padding: 2px 8px">{html_lib.escape(h)}</th>'
        for h in head
    )
    body = []
    for cells, style in rows:
        tds = "".join(
            '<td style="padding: 1px 8px; white-space: pre; vertical-align: top">'
            f"{_html_line(c) if isinstance(c, Line) else _span_html(c)}</td>"
            for c in cells
        )
        body.append(f'<tr style="{_STYLES.get(style, "")}">{tds}</tr>')
    title = f'<caption style="text-align: left">{html_lib.escape(caption)}</caption>'
    return (
        f'<table style="{_FONT}; border-collapse: collapse">'
        f"{title if caption else ''}<thead><tr>{th}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )


# --- treescope --------------------------------------------------------------------


def treescope(line: Line, path: Any = None) -> Any:
    """The outline as treescope's rendering parts (`__treescope_repr__`): a
    foldable node per line with lines under it. treescope is imported here only,
    when asked (flax depends on it)."""
    from treescope import rendering_parts as parts

    return _treescope_line(line, path, parts)


def _treescope_span(span: Span, parts: Any) -> Any:
    piece = parts.text(span.text)
    if span.style == "kind":
        return parts.custom_style(piece, kind_style(span.text.strip()))
    style = _STYLES.get(span.style, "")
    return parts.custom_style(piece, style) if style else piece


def _treescope_line(line: Line, path: Any, parts: Any) -> Any:
    head = parts.siblings(*(_treescope_span(s, parts) for s in line.spans))
    if not line.children:
        return parts.build_one_line_tree_node(head, path)
    state = (
        parts.ExpandState.WEAKLY_COLLAPSED
        if line.folded
        else parts.ExpandState.WEAKLY_EXPANDED
    )
    children = [_treescope_line(c, None, parts) for c in line.children]
    return parts.build_custom_foldable_tree_node(
        label=head,
        contents=parts.fold_condition(
            collapsed=parts.comment_color(parts.text(f"  ({len(children)} lines)")),
            expanded=parts.indented_children(children),
        ),
        path=path,
        expand_state=state,
    )
