"""Checks of the public functions' arguments, made at the entry points: a wrong type
is a `TypeError`, a wrong value a `ValueError`, and both name the argument (never an
`AttributeError` or `re.error` from deep inside)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax.tree_util as jtu
import numpy as np


def is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


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
    """None, or a mapping of regular expressions to replacement strings (or None:
    drop what the pattern matches)."""
    if rules is None:
        return
    if not isinstance(rules, Mapping):
        raise type_error(argument, "a dict of regex -> replacement, or None", rules)
    for pattern, replacement in rules.items():
        check_pattern(pattern, f"{argument}[{pattern!r}]")
        if replacement is not None and not isinstance(replacement, str):
            raise type_error(
                f"{argument}[{pattern!r}]", "a replacement string or None", replacement
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


def check_dtype(value: Any, argument: str = "dtype") -> None:
    """None, or anything `numpy.dtype` understands (`jnp.bfloat16`, `"float16"`)."""
    if value is None:
        return
    try:
        np.dtype(value)
    except TypeError:
        raise TypeError(
            f"`{argument}` must be a dtype (jnp.bfloat16, 'float32', ...) or None, "
            f"got {value!r}."[:300]
        ) from None


def check_callable(value: Any, argument: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not callable(value):
        raise type_error(argument, "a function", value)


def check_pair(value: Any, argument: str, expected: str, item: Any) -> None:
    """None, or a pair `(a, b)` whose members pass `item(member, name)`."""
    if value is None:
        return
    if not isinstance(value, tuple) or len(value) != 2:
        raise type_error(argument, expected, value)
    for i, member in enumerate(value):
        item(member, f"{argument}[{i}]")


def check_inputs(value: Any, argument: str) -> None:
    """None, an input array, or a tuple of inputs (call arguments)."""
    if value is not None and not isinstance(value, tuple) and not is_array(value):
        raise type_error(argument, "an input array, a tuple of inputs, or None", value)


def check_mapping(value: Any, argument: str, *, optional: bool = True) -> None:
    if optional and value is None:
        return
    if not isinstance(value, Mapping):
        raise type_error(argument, "a dict" + (" or None" if optional else ""), value)


def check_pair_or_mapping(value: Any, argument: str) -> None:
    """None, keyword arguments for both sides, or a pair (one side's, the other's)."""
    if isinstance(value, tuple):
        check_pair(value, argument, "a dict or a pair of dicts", check_mapping)
    else:
        check_mapping(value, argument)


def check_step(step: Any, argument: str = "step") -> None:
    """None, or a step count: an int (or an integer scalar array) in `[0, 2**31)`,
    which every optimizer's counter holds (`TrainState`'s int32, NNX's uint32)."""
    if step is None:
        return
    if is_array(step) and np.ndim(step) == 0 and np.issubdtype(step.dtype, np.integer):
        step = int(step)
    check_int(step, argument, low=0, high=2**31)


def check_hashable(value: Any, argument: str) -> None:
    """None, or a hashable name (a mesh axis name)."""
    try:
        hash(value)
    except TypeError:
        raise type_error(argument, "a hashable name (a str) or None", value) from None


def check_extra(extra: Any, argument: str = "extra") -> None:
    """None, or a mapping of non-empty names (str) to arrays."""
    if extra is None:
        return
    if not isinstance(extra, Mapping):
        raise type_error(argument, "a dict of names to arrays, or None", extra)
    for name, value in extra.items():
        if not isinstance(name, str):
            raise type_error(f"{argument}` key `{name!r}", "a str", name)
        if not name:
            raise ValueError(f"`{argument}` names must be non-empty, got ''.")
        if not is_array(value) and not isinstance(value, int | float | bool):
            raise type_error(f"{argument}[{name!r}]", "an array", value)


def check_opt_state(state: Any, argument: str) -> None:
    """An optimizer state: a pytree whose leaves are arrays (or numbers)."""
    for path, leaf in jtu.tree_flatten_with_path(state)[0]:
        if not is_array(leaf) and not isinstance(leaf, int | float | bool):
            raise TypeError(
                f"`{argument}` must be an optimizer state (a pytree of arrays, as "
                f"`tx.init(params)` makes it), but {argument}{jtu.keystr(path)} is "
                f"a {type(leaf).__name__}."
            )


def check_number(value: Any, argument: str, *, optional: bool = False) -> None:
    """An int or a float (not a bool), or None when optional."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise type_error(argument, "a number" + (" or None" if optional else ""), value)


def check_path(value: Any, argument: str) -> None:
    if not isinstance(value, str | os.PathLike):
        raise type_error(argument, "a str or os.PathLike", value)
    if os.fspath(value) in ("", "."):
        raise ValueError(f"`{argument}` must name a file or directory, got {value!r}.")


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
