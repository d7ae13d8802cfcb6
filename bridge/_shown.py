"""How a message shows text it did not write (names from a file, a user's keys):
escaped (no control character reaches a terminal), shortened, and lists bounded."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


LONGEST = 60
"""The most characters of one shown value."""

MOST = 5
"""The most values of a list shown; the rest are counted."""


def shown(value: Any, longest: int = LONGEST) -> str:
    """`value` as `repr` writes it (control characters escaped), at most `longest`
    characters (`'abc...'` beyond).

    ```python
    >>> print(shown("a\\x1b[31mb"))
    'a\\x1b[31mb'

    ```
    """
    text = repr(value)
    if len(text) > longest:
        omitted = len(text) - (longest - 3)
        text = f"{text[: longest - 3]}... ({omitted} more characters)"
    return text


def some(values: Iterable[Any], most: int = MOST, show: Any = shown) -> str:
    """At most `most` of `values`, each `show`n, then how many more: a bounded list.

    ```python
    >>> some(range(7), most=3, show=str)
    '0, 1, 2 and 4 more'

    ```
    """
    values = list(values)
    out = ", ".join(show(v) for v in values[:most])
    return out + (f" and {len(values) - most} more" if len(values) > most else "")
