"""Adapter: Equinox modules (and `eqx.nn.State`) <-> `bridge.Tree`."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from ._tree import Path, Tree, build, key_of, native_leaves, path_str


_UNDELETED_INIT = """\
{paths}: this StateIndex still holds its initial value, and a State was given too.
Make stateful models with `model, state = eqx.nn.make_with_state(Model)(...)`, or call
`model = eqx.nn.delete_init_state(model)` after `state = eqx.nn.State(model)`."""


def _is_index(x: Any) -> bool:
    return isinstance(x, eqx.nn.StateIndex)


class _Static:
    """A non-array leaf of an Equinox model, hashable whatever it is."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other):
        if type(other) is not _Static:
            return False
        try:
            return bool(self.value is other.value or self.value == other.value)
        except Exception:
            return False

    def __hash__(self):
        try:
            return hash(self.value)
        except TypeError:
            return hash(type(self.value))


def _get(obj: Any, path: Path) -> Any:
    for key in path:
        obj = (
            obj[key]
            if isinstance(key, int) or isinstance(obj, dict)
            else getattr(obj, key)
        )
    return obj


def from_equinox(model: Any, state: eqx.nn.State | None = None) -> Tree:
    """Convert an Equinox model (and its `eqx.nn.State`) to a `bridge.Tree`.

    The Tree reads like the model (`t.layers[-1].weight`); its leaves are the model's
    arrays (not copied), role `"params"`. The model's other leaves (functions such as
    an MLP's activation, python floats and bools) and its static fields are kept as
    static metadata. With `state`, each entry of the `State` is placed where its
    `StateIndex` sits in the model (a `BatchNorm` in `mode="batch"` gives
    `t.bn.batch_state_index[0]` for the running mean and `[1]` for the variance),
    role `"batch_stats"` for a `BatchNorm`'s entries and `"state"` otherwise.

    **Arguments:**

    - `model`: an `eqx.Module` (or any pytree of them). It is not modified.
    - `state`: optional, the model's `eqx.nn.State` (from `eqx.nn.make_with_state`).

    **Returns:**

    A `bridge.Tree`; `bridge.to_equinox` gives back the model, or `(model, state)`
    when a state was given.

    **Example:**

    ```python
    >>> import jax, equinox as eqx, bridge
    >>> t = bridge.from_equinox(eqx.nn.Linear(2, 3, key=jax.random.key(0)))
    >>> t.weight.shape
    (3, 2)

    ```
    """
    if not isinstance(model, eqx.Module):
        raise TypeError(
            f"bridge.from_equinox expects an eqx.Module, got {type(model).__name__}. "
            "For NNX modules use bridge.from_nnx, for Linen variables "
            "bridge.from_linen."
        )
    if state is not None and not isinstance(state, eqx.nn.State):
        raise TypeError(f"`state` must be an eqx.nn.State, got {type(state).__name__}.")
    flat, model_def = jtu.tree_flatten_with_path(model)
    entries: list[tuple[Path, str, Any]] = []
    order: list[int] = []
    statics: list[tuple[int, _Static]] = []
    array_slots: list[int] = []  # model leaf positions that hold arrays
    for i, (keypath, leaf) in enumerate(flat):
        if eqx.is_array(leaf):
            path = tuple(key_of(e) for e in keypath)
            role = (
                "state"
                if any(k == "init" for k in path) and _under_index(model, path)
                else "params"
            )
            entries.append((path, role, leaf))
            order.append(len(array_slots))
            array_slots.append(i)
        else:
            statics.append((i, _Static(leaf)))
    kinds = _kinds(model, [e[0] for e in entries])

    state_def = None
    if state is not None:
        index_paths = _index_paths(model)
        bad = [p for p, index in index_paths.items() if jtu.tree_leaves(index)]
        if bad:
            raise ValueError(
                _UNDELETED_INIT.format(paths=", ".join(path_str(p) for p in bad))
            )
        by_marker = {index.marker: p for p, index in index_paths.items()}
        state_flat, state_def = jtu.tree_flatten_with_path(state)
        markers = tuple(state_def.node_data()[1])  # pyright: ignore
        for j, (keypath, leaf) in enumerate(state_flat):
            marker = markers[key_of(keypath[0])]  # pyright: ignore[reportIndexIssue]
            if marker not in by_marker:
                raise ValueError(
                    "The State holds an entry for a StateIndex that is not in the "
                    "model: pass the State made together with this model."
                )
            at = by_marker[marker]
            owner = _get(model, at[:-1])
            role = "batch_stats" if isinstance(owner, eqx.nn.BatchNorm) else "state"
            path = at + tuple(key_of(e) for e in keypath[1:])
            entries.append((path, role, leaf))
            order.append(len(array_slots) + j)
        kinds.update(_kinds(model, list(index_paths)))
        kinds.update({p: type(index) for p, index in index_paths.items()})
    record = (model_def, tuple(statics), tuple(array_slots), state_def)
    entries = [(p, r, leaf, pos) for (p, r, leaf), pos in zip(entries, order)]
    entries.sort(key=_model_rank(model))
    return build(entries, kinds, "equinox", record)


def _under_index(model: Any, path: Path) -> bool:
    return any(_is_index(_get(model, path[:d])) for d in range(len(path)))


def _model_rank(model: Any):
    """Sort key: a State entry goes where its StateIndex is in the model."""
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=_is_index)
    rank = {tuple(key_of(e) for e in p): i for i, (p, _) in enumerate(flat)}

    def key(entry: tuple[Path, str, Any, int]) -> int:
        path = entry[0]
        return next(
            rank[path[:d]] for d in range(len(path), -1, -1) if path[:d] in rank
        )

    return key


def _index_paths(model: Any) -> dict[Path, Any]:
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=_is_index)
    return {tuple(key_of(e) for e in p): x for p, x in flat if _is_index(x)}


def _kinds(model: Any, paths: list[Path]) -> dict[Path, Any]:
    kinds: dict[Path, Any] = {}
    for path in paths:
        for depth in range(len(path)):
            prefix = path[:depth]
            if prefix not in kinds:
                kinds[prefix] = type(_get(model, prefix))
    return kinds


def to_equinox(tree: Tree) -> Any:
    """Rebuild the Equinox model of a `bridge.Tree` made by `bridge.from_equinox`.

    **Arguments:**

    - `tree`: a `bridge.Tree` from `bridge.from_equinox`, with the same leaf paths.

    **Returns:**

    The model, or `(model, state)` when the Tree was made with an `eqx.nn.State`.
    The model's arrays are the Tree's leaves (not copied); its other leaves and
    static fields are those of the source model.
    """
    src, leaves = native_leaves(tree, "equinox")
    model_def, statics, array_slots, state_def = src.record  # pyright: ignore
    model_leaves: list[Any] = [None] * model_def.num_leaves
    for i, static in statics:
        model_leaves[i] = static.value
    for i, leaf in zip(array_slots, leaves):
        model_leaves[i] = leaf
    model = jtu.tree_unflatten(model_def, model_leaves)
    if state_def is None:
        return model
    return model, jtu.tree_unflatten(state_def, leaves[len(array_slots) :])
