"""`trainable`: which leaves of a model a training step may change, as a filter spec."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu

from .._arguments import check_pattern
from .._kept._array import quantized_positions
from .._tree import Tree, leaf_roles


_SELECTS_NOTHING = """\
`where` selects no trainable parameter: {detail}.
bridge.trainable marks the `params` leaves under what `where` selects; batch statistics,
RNG state and caches are never trainable. Select a module or parameter, e.g.
`lambda t: t.layers[-1]`, or a regular expression over keystr paths such as
r'{example}' (the paths are listed by `jax.tree_util.tree_leaves_with_path(tree)`)."""

_FOREIGN = """\
`where` returned {count} object(s) that are not part of `tree` ({names}).
`where` must return parts of the Tree it is given, as for `eqx.tree_at`: a node such as
`t.layers[-1]`, a leaf such as `t.head.kernel`, or a tuple of them. Read the parts
from its argument, not from another Tree or model."""


class _Mark:
    """Stands for leaf `index` while `where` looks at the Tree."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def trainable(tree: Tree, where: Callable[[Tree], Any] | str | re.Pattern) -> Tree:
    """A filter spec: True for the `params` leaves under what `where` selects.

    The spec has the structure of `tree`, so it works with `eqx.partition(tree, spec)`
    and `bridge.make_step(loss_fn, optimizer, spec)`. It is the short form of the
    Equinox pattern
    `eqx.tree_at(where, jax.tree_util.tree_map(lambda _: False, tree), replace=...)`,
    with two differences: selecting a module selects all its parameters, and leaves
    of other roles (batch statistics, RNG state, caches: see `bridge.roles`) are
    never trainable.

    **Arguments:**

    - `tree`: a `bridge.Tree` (from `bridge.to_neutral(model)`).
    - `where`: what to train, either
        - a callable like `eqx.tree_at`'s, which takes the Tree and returns a part of
          it or a tuple of parts: `lambda t: t.layers[-1]`,
          `lambda t: (t.head.kernel, t.head.bias)`;
        - or a regular expression (a `str` or `re.Pattern`), searched in each leaf's
          `jax.tree_util.keystr` path: `r"^\\.head\\."`, `r"layers\\[(8|9)\\]"`.

    **Returns:**

    A `bridge.Tree` of the same structure as `tree` with a `bool` at each leaf.

    **Raises:**

    `ValueError` when `where` selects no `params` leaf, and when a callable `where`
    returns something that is not part of `tree`.

    **Example:**

    ```python
    >>> import bridge
    >>> from flax import nnx
    >>> bn = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    >>> spec = bridge.trainable(bridge.from_nnx(bn), lambda t: t)
    >>> spec.scale, spec.mean
    (True, False)
    >>> bridge.trainable(bridge.from_nnx(bn), r"^\\.(bias|var)$").bias
    True

    ```
    """
    if not isinstance(tree, Tree):
        raise TypeError(
            f"`tree` must be a bridge.Tree, got {type(tree).__name__}: "
            "convert the model first with bridge.to_neutral(model)."
        )
    flat, treedef = jtu.tree_flatten_with_path(tree)
    paths = [jtu.keystr(p) for p, _ in flat]
    roles = leaf_roles(tree)
    if callable(where) and not isinstance(where, Tree):
        selected = _selected_by_callable(where, treedef, len(flat))
        what = "the selected parts"
    else:
        pattern = check_pattern(where, "where")
        selected = {i for i, p in enumerate(paths) if pattern.search(p)}
        what = f"the paths matching r'{pattern.pattern}'"
    kept = quantized_positions(tree)  # weights kept quantized: never trained
    flags = [
        i in selected and roles[i] == "params" and i not in kept
        for i in range(len(flat))
    ]
    if not any(flags):
        if selected:
            found = sorted({str(roles[i]) for i in selected if i not in kept})
            detail = f"{what} hold only leaves of role {', '.join(found)}"
            if all(i in kept for i in selected):
                detail = f"{what} hold only weights kept quantized (frozen)"
            elif any(i in kept for i in selected):
                detail += " and weights kept quantized (frozen)"
        else:
            detail = f"{what} hold no leaf"
        example = _example(paths, roles)
        raise ValueError(_SELECTS_NOTHING.format(detail=detail, example=example))
    return jtu.tree_unflatten(treedef, flags)


def _selected_by_callable(where: Callable, treedef: Any, n: int) -> set[int]:
    marked = jtu.tree_unflatten(treedef, [_Mark(i) for i in range(n)])
    parts = jtu.tree_leaves(where(marked))
    foreign = [x for x in parts if not isinstance(x, _Mark)]
    if foreign:
        names = ", ".join(sorted({type(x).__name__ for x in foreign}))
        raise ValueError(_FOREIGN.format(count=len(foreign), names=names))
    return {x.index for x in parts}


def _example(paths: list[str], roles: list[str | None]) -> str:
    """A regular expression for the module of the last `params` leaf."""
    params = [p for p, r in zip(paths, roles) if r == "params"]
    if not params:
        return r"^\.head[.\[]"
    last = params[-1]
    module = last[: max(last.rfind("."), last.rfind("["))]
    return "^" + re.escape(module) + r"[.\[]" if module else "^" + re.escape(last)
