"""`port`: fill a model of any framework with the weights of another."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._adapters._native import check_model, like, placeholders
from .._arguments import (
    check_bool,
    check_dtype,
    check_inputs,
    check_pair_or_mapping,
    check_rules,
)
from .._buffers import Placing
from .._lazy import LazyArray, ReadAhead, materialise
from .._paths import Path, path_str
from .._placement import place, sharding_of
from .._tree import Tree, map_with_path
from . import _carry, _errors
from ._codec import filled
from ._compare import largest_difference, outputs, tolerance
from ._plan import Plan, PlanRow, make_plan
from ._ranges import converted_by_ranges
from ._report import name, report as made_report, warn
from ._trace import Example


def port(
    source: Any,
    target: Any,
    *,
    rules: Mapping[str, str | None] | None = None,
    strict: bool = True,
    dtype: Any = None,
    check: Any = None,
    check_kwargs: Mapping[str, Any]
    | tuple[Mapping[str, Any], Mapping[str, Any]]
    | None = None,
    example: Any = None,
    example_kwargs: Mapping[str, Any]
    | tuple[Mapping[str, Any], Mapping[str, Any]]
    | None = None,
    report: bool = False,
) -> Any:
    """Fill `target`'s structure with `source`'s weights, whatever their frameworks.

    Layers are recognised by kind through the registered codecs (`bridge.Codec`);
    arrays a module holds next to its sublayers are one-array layers (kind
    `"Array"`, same layout everywhere). Layers are paired by `rules`, then by
    identical paths, then by names equal after normalisation (`layers_3` =
    `layers[3]`), then by kind and shapes, in the order the forward passes use them
    (given `example=` inputs: pass them when the two models name their layers
    differently), else in creation order only where the order is known to be it (see the
    guide "How layers are paired"); a choice left open is an error, never a guess. They
    are converted between layouts: Dense kernel `(in, out)` <-> Equinox weight `(out,
    in)`, conv HWIO <-> OIHW, attention heads split <-> fused, BatchNorm statistics <->
    `eqx.nn.State`. Every problem is collected first and raised once, as a `PortError`:
    nothing is half-written, and `target` is never modified. Each ported array takes the
    sharding of the target's array it replaces.

    **Arguments:**

    - `source`: the model holding the weights: a `bridge.Tree`, an `nnx.Module`, an
      Equinox model or `(model, state)`, Linen variables or `(module, variables)`.
    - `target`: a model of the structure wanted, in any of the same forms. Its values
      are replaced, except in layers left unpaired with `strict=False`. It may be
      abstract, costing no memory: `eqx.filter_eval_shape(Model, ...)` (unpaired
      layers then hold zeros), `nnx.eval_shape(lambda: Model(...))`, or
      `jax.eval_shape(module.init, ...)` for Linen.
    - `rules`: `{source regex: target path}`, applied before automatic pairing: a
      source layer whose path (`keystr` form, like `.Dense_0` or `.layers[2]`) fully
      matches the regex goes to the target layer at the path the replacement gives
      (`re.Match.expand`, so `\\1` works): `{r"\\.Dense_(\\d+)": r".layers[\\1]"}`.
      A rule to `None` leaves the source layers it matches out (`{r"\\.head": None}`:
      an old head the target does not have).
    - `strict`: with `False`, as Hugging Face's `from_pretrained` with
      `ignore_mismatched_sizes=True`: missing and unexpected layers are listed in the
      plan instead of raising; paired layers whose shapes differ (a new head of
      another size) keep the target's values, listed in `Plan.mismatched`. What
      was left as it was is logged (logger `"bridge"`, WARNING) in the words of
      Hugging Face's `from_pretrained` ("Some weights of ... were not used ...
      You should probably TRAIN this model"), and returned with `report=True`;
      arrays whose dtype differs from the target's are cast to it with
      a `PortWarning` listing them (with `True`, the default, each is an error).
      Ambiguities and unsupported layers always raise.
    - `dtype`: the dtype every ported floating-point array is cast to (bfloat16,
      float16, float32, ...), whatever the source's and the target's: the filled
      model holds it. Default: the target's dtypes, unchanged.
    - `check`: optional inputs (a tuple of call arguments, batched, as
      `bridge.compare` takes them): after porting, run the source and the result on
      them and raise `PortError` when their outputs differ by more than the
      tolerance of their dtype (`1e-4` for float32, `5e-2` for bfloat16, relative to
      the largest output magnitude when above 1).
    - `check_kwargs`: keyword arguments for both calls of `check` (`{"train":
      False}`), or a pair `(source's, target's)` for models whose calls differ.
    - `example`: optional example inputs (batched, as `bridge.compare` takes them;
      arrays or `jax.ShapeDtypeStruct`s). Both forward passes are traced abstractly
      (no FLOPs, no weights materialised), and layers that names do not pair are
      paired in the order the computation first uses them: an order that optax,
      `nnx.jit`, `eval_shape` and files cannot change. Default: the `check` inputs.
    - `example_kwargs`: keyword arguments for both traced calls, or a pair
      `(source's, target's)`. Default: `check_kwargs`.
    - `report`: with `True`, return `(filled target, bridge.Report)`: the target's
      layers left unfilled, the source's unused, the mismatched, as Hugging Face's
      `output_loading_info=True` returns them.

    **Returns:**

    The filled target, of the target's kind: a `bridge.Tree` for a Tree, a new
    `nnx.Module`, a new Equinox model (or `(model, state)`), new Linen variables (or
    `(module, variables)`, or a bound module); for a PyTorch-layout target, a state
    dict (`bridge.to_torch`): `torch.Tensor`s for a `torch.nn.Module` or a state
    dict of tensors, ready for `module.load_state_dict(sd, strict=True)`, else
    numpy arrays.

    **Raises:**

    `PortError` (a `ValueError`) listing every problem. A `PortWarning` lists the
    hyperparameters that differ between paired layers.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, equinox as eqx, bridge
    >>> from flax import nnx
    >>> source = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> target = eqx.nn.Linear(2, 3, key=jax.random.key(1))
    >>> ported = bridge.port(source, target)
    >>> bool(jnp.all(ported.weight == source.kernel[...].T))
    True

    ```
    """
    check_model(source, "source")
    check_model(target, "target")
    check_rules(rules)
    check_bool(strict, "strict")
    check_dtype(dtype)
    check_inputs(check, "check")
    check_pair_or_mapping(check_kwargs, "check_kwargs")
    check_inputs(example, "example")
    check_pair_or_mapping(example_kwargs, "example_kwargs")
    check_bool(report, "report")
    ported, plan = port_and_plan(
        source,
        target,
        rules,
        strict,
        dtype,
        check,
        check_kwargs,
        example,
        example_kwargs,
    )
    told = made_report(plan, f"the source ({name(source)})", target)
    return (ported, told) if report else ported


def port_and_plan(
    source: Any,
    target: Any,
    rules: Mapping[str, str | None] | None,
    strict: bool,
    dtype: Any = None,
    check: Any = None,
    check_kwargs: Any = None,
    example: Any = None,
    example_kwargs: Any = None,
    target_tree: Tree | None = None,
    source_uses: Mapping[Path, tuple[int, ...]] | None = None,
) -> tuple[Any, Plan]:
    """`bridge.port`, returning the plan it ran as well (`bridge.load` reports its
    missing, unexpected and mismatched layers). `target_tree`: `target` already
    converted (`to_neutral(placeholders(target))`, which `bridge.load` makes to
    check the file against), planned with instead of converting `target` again.
    `source_uses`: the order of use a file records (`{array path: (rank,)}`),
    standing for the source's forward pass where example inputs are given."""
    plain, adapters = _carry.split(source)  # LoRA adapters follow their layers
    # and replace the target's own (port_opt_state ports into a LoRA model)
    if adapters or target_tree is None:
        abstract = placeholders(_carry.split(target)[0] if adapters else target)
    else:
        abstract = target_tree
    given = examples(example, example_kwargs, check, check_kwargs)
    plan, problems = make_plan(
        plain, abstract, rules, strict, dtype, given, source_uses
    )
    if problems:
        raise _errors.PortError(problems)
    tree = run(plan)
    if plan.warnings:  # the mismatched layers: in the report (`bridge.Report`)
        warn("Port warnings:\n  " + "\n  ".join(plan.warnings), _errors.PortWarning)
    ported = like(target, tree)
    if adapters:
        ported = _carry.join(adapters, plan.steps, ported)
    if check is not None:
        _check(source, ported, check, check_kwargs)
    return ported, plan


def examples(
    example: Any, example_kwargs: Any, check: Any = None, check_kwargs: Any = None
) -> Example | None:
    """The example inputs of a port (`example=`, else the `check=` inputs)."""
    if example is None:
        example, example_kwargs = check, example_kwargs or check_kwargs
    return None if example is None else Example(example, example_kwargs)


def _check(source: Any, ported: Any, inputs: Any, kwargs: Any) -> None:
    """Raise when the ported model computes something else than the source."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    per_side = kwargs if isinstance(kwargs, tuple) else None
    both = {} if per_side is not None else dict(kwargs or {})
    a, b = outputs(source, ported, inputs, None, per_side, both)
    diff = largest_difference(a, b)
    allowed, dtype = tolerance(a)
    if not diff <= allowed:
        raise _errors.PortError(
            [_errors.CHECK.format(diff=diff, tolerance=allowed, dtype=dtype)]
        )


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
    with ahead, Placing(ahead.budget) as placing:
        for i, step in enumerate(steps):
            ahead.reached(i)
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
    return [
        (t.leaf(k), None, _placed(v, t.leaves[k], path_str(t.leaf(k)), placing))
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


def _placed(new: Any, like: Any, where: str, placing: Placing) -> Any:
    """`new` with the sharding of the target's leaf it replaces, concrete or abstract
    (a no-op when they already agree, or when the target's leaf has none). A numpy
    array (from a PyTorch-layout state dict or a file) becomes a JAX array: the model
    owns it (one copy at most, none for memory a read filled; a copy changing the
    layout may be a `Future`, `placing`'s)."""
    sharding = sharding_of(like, where)
    if isinstance(new, np.ndarray) and sharding is None:
        return placing.put(new)
    return place(new, sharding)  # a host array goes to each device shard by shard
