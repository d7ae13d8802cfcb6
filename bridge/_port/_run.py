"""Step 5 of a port: run the plan. Each row's source arrays decoded to the
canonical layout and encoded into the target's, in the order the file is read
(shard by shard); a layer of a stack written into the stack in place; a tied
target array written once, its other rows checked bit-equal; each array given the
target's sharding. Nothing is assembled before every row has run."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._buffers import Placing
from .._lazy import LazyArray, ReadAhead, materialise
from .._paths import Path, path_str
from .._placement import place, sharding_of
from .._tree import Tree, map_with_path
from . import _errors
from ._codec import filled
from ._plan import Plan, PlanRow
from ._ranges import converted_by_ranges


def run(plan: Plan) -> Tree:
    """Execute a plan: the target Tree with every paired layer's arrays replaced."""
    problems: list[str] = []
    new: dict[Path, Any] = {}
    assert plan._target is not None
    targets: dict[Path, Any] = {}
    map_with_path(targets.__setitem__, plan._target)
    # a target stack (`nn.scan`) is filled layer by layer, in place: its layers are
    # never all held apart as well; a layer in memory is converted inside the write
    # (`_written`: peak the stack alone), others are converted first (plus a layer)
    stacks: dict[Path, Any] = {}
    fused: dict[Any, Any] = {}
    writes: dict[Any, Any] = {}
    wrote: dict[Path, PlanRow] = {}  # a target array and the row that wrote it
    again: dict[Path, list[tuple[PlanRow, Any]]] = {}  # written again (a tie)
    steps = sorted(plan.steps, key=_reading_order)
    ahead = _read_ahead(steps, plan._source)
    whole: dict[int, dict[int, PlanRow]] = {}  # a fused target: its parts' rows
    with ahead, Placing(ahead.budget) as placing:
        for i, step in enumerate(steps):
            ahead.reached(i)
            part = step._target.part if step._target is not None else None
            if part is not None:  # written with the fused layer's other parts
                whole.setdefault(id(part[2]), {})[part[0]] = step
                continue
            if _written(step, stacks, targets, writes):
                continue
            for path, index, value in _move(step, problems, fused, placing):
                if index is None and path in new:  # one tied array, several names
                    again.setdefault(path, []).append((step, value))
                    continue
                if index is None:
                    new[path] = value
                    wrote[path] = step
                    continue
                stack = stacks.get(path)
                if stack is None:
                    stack = _fresh(targets[path])
                at, axis = index
                stacks[path] = _write(stack, jnp.asarray(value, stack.dtype), at, axis)
        for rows in whole.values():
            for path, value in _joined(rows, problems).items():
                new[path] = _placed(value, targets[path], path_str(path), placing)
        new = {path: placing.result(value) for path, value in new.items()}
        for path, more in again.items():
            steps_ = [wrote[path]] + [m for m, _ in more]
            values = [new[path]] + [placing.result(v) for _, v in more]
            _equal_ties(path, steps_, values, problems)
    if problems:
        raise _errors.PortError(problems)

    def replace(path: Path, leaf: Any) -> Any:
        if path in stacks:
            return place(stacks[path], sharding_of(leaf, path_str(path)))
        return new.get(path, leaf)

    return map_with_path(replace, plan._target)


def _equal_ties(
    path: Path, steps: list[PlanRow], values: list[Any], problems: list[str]
) -> None:
    """A target array held once under several names, filled by several rows (one
    per name): their arrays must be equal to the bit, else a problem."""
    first = np.asarray(values[0])
    for step, value in zip(steps[1:], values[1:]):
        other = np.asarray(value)
        if (first.shape, first.dtype) == (other.shape, other.dtype) and (
            np.ascontiguousarray(first).tobytes()
            == np.ascontiguousarray(other).tobytes()
        ):
            continue
        try:
            diff = float(np.max(np.abs(first.astype(np.float64) - other)))
        except (TypeError, ValueError):  # shapes or dtypes apart
            diff = f"{first.shape} {first.dtype} against {other.shape} {other.dtype}"
        problems.append(
            _errors.TIED_UNEQUAL.format(
                target=path_str(path),
                names=", ".join(s.target for s in steps),
                a=steps[0].source,
                b=step.source,
                diff=diff,
            )
        )
        return


AHEAD = 32  # a port reads ahead at most 1/AHEAD of the bytes it reads lazily


def _read_ahead(steps: list[PlanRow], source: Tree | None) -> ReadAhead:
    """The reads of the arrays of a file each row reads whole, in a thread ahead of
    the row (`bridge._lazy.ReadAhead`), at most 1/`AHEAD` of them at once (their
    memory is the peak's excess: 3%). A read started before the plan was made
    (`bridge._lazy.read_early`) of an array no row reads whole is dropped now."""
    rows = []
    for step in steps:
        s = step._source
        assert s is not None
        lazy = [] if s.index is not None else s.leaves.values()
        rows.append([v for v in lazy if isinstance(v, LazyArray)])
    read = {id(v) for row in rows for v in row}
    if source is not None:
        for leaf in jax.tree.leaves(source):
            if isinstance(leaf, LazyArray) and id(leaf) not in read:
                leaf._ahead = None
    total = sum(v.nbytes for row in rows for v in row)
    return ReadAhead(rows, total // AHEAD)


def _fresh(leaf: Any) -> jax.Array:
    """A new array for a target stack: a copy of the target's own (its layers that
    nothing ports stay), zeros for an abstract target."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jnp.zeros(leaf.shape, leaf.dtype)
    return jnp.array(leaf, copy=True)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _write(stack: jax.Array, layer: jax.Array, index: Any, axis: int) -> jax.Array:
    """`stack` with layer `index` (along `axis`) replaced, in place (the old
    `stack` is donated)."""
    return jax.lax.dynamic_update_index_in_dim(stack, layer, index, axis)


def _written(
    step: PlanRow, stacks: dict[Path, Any], targets: dict[Path, Any], cache: dict
) -> bool:
    """Write a row whose target is one layer of a stack and whose source is one
    layer in memory (JAX or numpy arrays) into the stack: converted inside the
    donated write, one XLA computation compiled once per layer shape, so the
    converted layer is never an array of its own next to the stack. False where that
    does not apply (a stack's slice as the source, a file read lazily, entries to
    check, a codec that needs concrete values): the row is then moved as before."""
    s, t = step._source, step._target
    assert s is not None and t is not None
    if t.index is None or s.index is not None or step.drop:
        return False
    leaves = s.leaves
    if not all(isinstance(v, (jax.Array, np.ndarray)) for v in leaves.values()):
        return False
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in t.leaves.items()}
    key = (
        id(step.source_codec),
        id(step.target_codec),
        t.axis,
        tuple((k, v.shape, str(v.dtype)) for k, v in leaves.items()),
        tuple((k, v.shape, str(v.dtype)) for k, v in like.items()),
        repr((s.hyper, t.hyper, step.cast, step.fill, step.kind)),
    )
    write = cache.get(key, False)
    if write is False:
        axis = t.axis

        def convert(leaves: dict[str, Any]) -> dict[str, Any]:
            return _encoded(step, _decoded(step, leaves), like)

        def into(stacks: dict[str, Any], leaves: dict[str, Any], index: Any) -> Any:
            new = convert(leaves)
            return {
                k: jax.lax.dynamic_update_index_in_dim(
                    v, jnp.asarray(new[k], v.dtype), index, axis
                )
                for k, v in stacks.items()
            }

        try:  # the target entries the codec writes
            keys = tuple(jax.eval_shape(convert, leaves))
            write = cache[key] = (keys, jax.jit(into, donate_argnums=0))
        except jax.errors.JAXTypeError:  # a codec that needs concrete values
            write = cache[key] = None
    if write is None:
        return False
    keys, filled_in = write
    paths = {k: t.real + t.paths[k] for k in keys}
    old = {k: stacks.pop(p, None) for k, p in paths.items()}
    old = {k: _fresh(targets[paths[k]]) if v is None else v for k, v in old.items()}
    for k, v in filled_in(old, leaves, t.index).items():
        stacks[paths[k]] = v
    return True


def _reading_order(step: PlanRow) -> int:
    """Steps reading a lazily read file go shard by shard (see `bridge._lazy`)."""
    assert step._source is not None
    leaves = step._source.arrays or step._source.leaves
    return min((getattr(v, "order", 0) for v in leaves.values()), default=0)


def _move(
    step: PlanRow, problems: list[str], fused: dict[Any, Any], placing: Placing
) -> list[tuple[Path, tuple[int, int] | None, Any]]:
    """The target arrays of one row: `(path, (index, axis) in a stack or None,
    array)`; an array copied in a thread is a `Future` (`placing`)."""
    s, t = step._source, step._target
    assert s is not None and t is not None
    leaves = _fused(step, fused)
    if leaves is None:
        leaves = _converted(step, problems)
    if t.index is not None:
        return [(t.leaf(k), (t.index, t.axis), v) for k, v in leaves.items()]
    # the source's own arrays, unsliced and unread (a stack's, a file's lazily read)
    held = [v for v in (s.arrays or s.leaves).values() if isinstance(v, np.ndarray)]
    return [
        (
            t.leaf(k),
            None,
            _placed(v, t.leaves[k], path_str(t.leaf(k)), placing, held),
        )
        for k, v in leaves.items()
    ]


def _fused(step: PlanRow, cache: dict[Any, Any]) -> dict[str, Any] | None:
    """The target arrays of a row whose source is one layer of a stack in memory,
    sliced and converted in one XLA computation (so the slice is never a copy of
    its own), compiled once for all the layers of the stack; None where that does
    not apply (another source, entries to check, a codec that is not traceable)."""
    s, t = step._source, step._target
    assert s is not None and t is not None
    if s.index is None or s.arrays is None or step.drop:
        return None
    if not all(isinstance(v, jax.Array) for v in s.arrays.values()):
        return None  # a file read lazily, numpy arrays: layer by layer as they are
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in t.leaves.items()}
    key = (
        id(s.arrays),
        s.axis,
        id(step.source_codec),
        id(step.target_codec),
        tuple((k, v.shape, str(v.dtype)) for k, v in like.items()),
        repr((s.hyper, t.hyper, step.cast, step.fill, step.kind)),
    )
    convert = cache.get(key, False)
    if convert is False:

        def one(arrays: dict[str, Any], index: Any) -> dict[str, Any]:
            leaves = {
                k: jax.lax.dynamic_index_in_dim(v, index, s.axis, keepdims=False)
                for k, v in arrays.items()
            }
            return _encoded(step, _decoded(step, leaves), like)

        convert = cache[key] = jax.jit(one)
    if convert is None:
        return None
    try:
        return convert(s.arrays, s.index)
    except jax.errors.JAXTypeError:  # a codec that needs concrete values
        cache[key] = None
        return None


def _joined(rows: dict[int, PlanRow], problems: list[str]) -> dict[Path, Any]:
    """A fused target's arrays from the rows of its parts (`_split`): each part's
    canonical arrays, in part order, concatenated and encoded once by the fused
    layer's codec; `{target leaf path: array}`."""
    first = next(iter(rows.values()))
    assert first._target is not None and first._target.part is not None
    _, count, fused = first._target.part
    if sorted(rows) != list(range(count)):
        problems.append(
            _errors.PART_MISSING.format(
                target=fused.where,
                parts=count,
                missing=[i + 1 for i in range(count) if i not in rows],
            )
        )
        return {}
    pieces = []
    for i in range(count):
        step = rows[i]
        s = step._source
        assert s is not None
        leaves = {k: materialise(v) for k, v in s.own_leaves().items()}
        pieces.append(_decoded(step, leaves))
    spec = fused.specs["Dense"]
    canonical = {
        k: jnp.concatenate([jnp.asarray(p[k]) for p in pieces], axis=-1)
        for k in spec
        if all(k in p for p in pieces)
    }
    canonical = filled(canonical, spec, first.fill)
    codec = fused.codec("Dense")
    encoded = codec.encode(canonical, fused.leaves, fused.hyper)
    return {fused.leaf(k): v for k, v in encoded.items()}


def _decoded(step: PlanRow, leaves: dict[str, Any]) -> dict[str, Any]:
    s = step._source
    assert s is not None
    canonical = step.source_codec.decode(leaves, s.hyper)
    for entry, dtype in step.cast.items():
        canonical[entry] = jnp.asarray(canonical[entry]).astype(dtype)
    return canonical


def _encoded(step: PlanRow, canonical: dict[str, Any], like: Any) -> dict[str, Any]:
    t = step._target
    assert t is not None
    spec = t.specs[step.kind]
    canonical = filled(
        {k: canonical[k] for k in spec if k in canonical}, spec, step.fill
    )
    return step.target_codec.encode(canonical, like, t.hyper)


def _converted(step: PlanRow, problems: list[str]) -> dict[str, Any]:
    """The target arrays of a row, converted eagerly; entries dropped checked."""
    s, t = step._source, step._target
    assert s is not None and t is not None
    own = s.own_leaves()
    if t.index is None and not step.drop:  # each process reads its devices' part
        ranged = converted_by_ranges(
            own,
            lambda leaves: _encoded(step, _decoded(step, leaves), t.leaves),
            t.leaves,
            lambda k: path_str(t.leaf(k)),
        )
        if ranged is not None:
            return ranged
    leaves = {k: materialise(v) for k, v in own.items()}
    canonical = _decoded(step, leaves)
    for entry, value in step.drop.items():
        if not bool(jnp.all(canonical[entry] == value)):
            problems.append(
                _errors.ENTRY_DROPPED.format(
                    source=step.source,
                    target=step.target,
                    kind=step.kind,
                    entry=entry,
                    default=value,
                )
            )
    return _encoded(step, canonical, t.leaves)


def _placed(
    new: Any, like: Any, where: str, placing: Placing, held: Sequence[np.ndarray] = ()
) -> Any:
    """`new` with the sharding of the target's leaf it replaces, concrete or abstract
    (a no-op when they already agree, or when the target's leaf has none). A numpy
    array (from a PyTorch-layout state dict or a file) becomes a JAX array: the model
    owns it (one copy at most, none for memory a read filled; a copy changing the
    layout may be a `Future`, `placing`'s, free of its budget where `new` is a view
    of the source's arrays `held` in memory anyway)."""
    sharding = sharding_of(like, where)
    if isinstance(new, np.ndarray) and sharding is None:
        return placing.put(new, any(np.may_share_memory(new, h) for h in held))
    return place(new, sharding)  # a host array goes to each device shard by shard
