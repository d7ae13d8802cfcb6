"""Rules read backwards: the `rules` that paired a PyTorch model's layers with a Flax
or Equinox model's on import name the PyTorch layers again on export.

A rule `{pattern: replacement}` is reversible when `pattern` is literal text and
capturing groups only, and `replacement` refers to every group (`\\1`, `\\g<1>`,
`\\g<name>`): `r"\\.encoder\\.layer\\[(\\d+)\\]\\.output\\.dense"` ->
`r".layers[\\1].mlp.out"` reverses to `r"\\.layers\\[(?P<g1>\\d+)\\]\\.mlp\\.out"` ->
`r".encoder.layer[\\g<g1>].output.dense"`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from re import _constants, _parser  # pyright: ignore[reportAttributeAccessIssue]

from .._shown import some


_NOT_REVERSIBLE = """\
rule {pattern!r} -> {replacement!r} cannot be read backwards for export: {reason}.
Write it with literal text and capturing groups only, each group used in the
replacement (e.g. r"\\.h\\[(\\d+)\\]\\.attn" -> r".blocks[\\1].attention"), or give
the export rules yourself."""

_DROPPED = """\
rules {patterns} leave the source layers they match out (a replacement None), so
they cannot be read backwards for export: the model holds no such layers to name.
Give the export rules without them (e.g. `{{k: v for k, v in rules.items() if v is not
None}}`)."""

_REF = re.compile(r"\\(\d+)|\\g<(\w+)>")


def _groups(pattern: str) -> list[tuple[int, int, str | None]]:
    """The spans `(start, end)` of the top-level capturing groups, with their names;
    raises ValueError for a nested or non-capturing group."""
    spans: list[tuple[int, int, str | None]] = []
    depth, start, name, i, in_class = 0, 0, None, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            if depth == 0:
                start = i
                named = re.match(r"\(\?P<(\w+)>", pattern[i:])
                if pattern.startswith("(?", i) and not named:
                    raise ValueError("it has a group that is not a capturing group")
                name = named.group(1) if named else None
            elif not pattern.startswith("(?:", i):
                raise ValueError("it has a nested capturing group")
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                spans.append((start, i + 1, name))
        i += 1
    return spans


def reverse_rule(pattern: str, replacement: str) -> tuple[str, str]:
    """`(pattern, replacement)` that undoes the rule: what the rule made, back to
    what it matched. Raises ValueError, with the rule, when it cannot."""
    try:
        spans = _groups(pattern)
        literals, bodies, names = [], [], []
        last = 0
        for start, end, name in spans:
            literals.append(parse_literal(pattern[last:start]))
            inner = pattern[start + 1 : end - 1]
            if name is not None:
                inner = inner[len(f"?P<{name}>") :]
            bodies.append(inner)
            names.append(name)
            last = end
        literals.append(parse_literal(pattern[last:]))
        out_pattern, last, used = [], 0, set()
        for ref in _REF.finditer(replacement):
            out_pattern.append(re.escape(_unescape(replacement[last : ref.start()])))
            key = ref.group(1) or ref.group(2)
            if key.isascii() and key.isdigit():
                k = int(key) - 1
            elif key in names:
                k = names.index(key)
            else:
                raise ValueError(f"it refers to group {key!r}, which it does not have")
            if not 0 <= k < len(bodies):
                raise ValueError(f"it refers to group {key}, which it does not have")
            if k in used:
                out_pattern.append(f"(?P=g{k + 1})")
            else:
                out_pattern.append(f"(?P<g{k + 1}>{bodies[k]})")
                used.add(k)
            last = ref.end()
        out_pattern.append(re.escape(_unescape(replacement[last:])))
        if len(used) != len(bodies):
            raise ValueError("its replacement leaves out a group")
        out_replacement = ""
        for i, text in enumerate(literals):
            out_replacement += text.replace("\\", "\\\\")
            if i < len(bodies):
                out_replacement += f"\\g<g{i + 1}>"
        return "".join(out_pattern), out_replacement
    except ValueError as error:
        raise ValueError(
            _NOT_REVERSIBLE.format(
                pattern=pattern, replacement=replacement, reason=error
            )
        ) from None


def parse_literal(text: str) -> str:
    """The text a regex without groups matches, when it matches only that text."""
    chars = []
    for op, value in _parser.parse(text):
        if op is not _constants.LITERAL:
            raise ValueError(f"{text!r} is not literal text")
        chars.append(chr(value))
    return "".join(chars)


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def reverse_rules(rules: Mapping[str, str | None]) -> dict[str, str]:
    """Every rule reversed (ValueError naming every rule to None, else the first
    that cannot be reversed)."""
    dropped = [p for p, r in rules.items() if r is None]
    if dropped:
        raise ValueError(_DROPPED.format(patterns=some(dropped)))
    return dict(reverse_rule(p, r) for p, r in rules.items() if r is not None)
