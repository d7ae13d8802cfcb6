"""Checks of the public functions' arguments, made at the entry points: a wrong type
is a `TypeError`, a wrong value a `ValueError`, and both name the argument (never an
`AttributeError` or `re.error` from deep inside)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any


def type_error(argument: str, expected: str, value: Any) -> TypeError:
    return TypeError(f"`{argument}` must be {expected}, got {type(value).__name__}.")


def check_bool(value: Any, argument: str) -> None:
    if not isinstance(value, bool):
        raise type_error(argument, "True or False", value)


def check_str(value: Any, argument: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str):
        raise type_error(argument, "a str" + (" or None" if optional else ""), value)


def check_name(value: Any, argument: str) -> None:
    """A non-empty string (a stream name, a module name)."""
    check_str(value, argument)
    if not value:
        raise ValueError(f"`{argument}` must be a non-empty name, got ''.")


def check_pattern(pattern: Any, argument: str) -> re.Pattern:
    """A regular expression (a str or a compiled pattern), compiled."""
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise type_error(argument, "a regular expression (str)", pattern)
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(
            f"`{argument}`: {pattern!r} is not a valid regular expression ({error})."
        ) from None


def check_rules(rules: Any, argument: str = "rules") -> None:
    """None, or a mapping of regular expressions to replacement strings."""
    if rules is None:
        return
    if not isinstance(rules, Mapping):
        raise type_error(argument, "a dict of regex -> replacement, or None", rules)
    for pattern, replacement in rules.items():
        check_pattern(pattern, f"{argument}[{pattern!r}]")
        if not isinstance(replacement, str):
            raise type_error(
                f"{argument}[{pattern!r}]", "a replacement string", replacement
            )


def check_names(value: Any, argument: str) -> tuple[str, ...]:
    """A non-empty sequence (not a str) of distinct non-empty names without dots."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise type_error(argument, "a tuple of names", value)
    names = tuple(value)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise type_error(argument, "a tuple of str names", bad[0])
    if not names or any(not n or "." in n for n in names):
        raise ValueError(
            f"`{argument}` must be one or more non-empty names without dots, "
            f"got {names!r}."
        )
    if len(set(names)) != len(names):
        raise ValueError(f"`{argument}` names a part twice: {names!r}.")
    return names


def check_int(
    value: Any, argument: str, *, low: int, high: int, optional: bool = False
) -> None:
    """An int (not a bool) in `[low, high)`, or None when optional."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(argument, "an int" + (" or None" if optional else ""), value)
    if not low <= value < high:
        shown = value if abs(value) < 10**30 else f"an int of {value.bit_length()} bits"
        raise ValueError(f"`{argument}` must be in [{low}, {high}), got {shown}.")
