"""`port`: fill a model of any framework with the weights of another."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._adapters._native import like, placeholders
from .._lazy import materialise
from .._paths import Path, path_str
from .._placement import place, sharding_of
from .._tree import Tree, map_with_path
from . import _errors
from ._codec import filled
from ._compare import largest_difference, outputs, tolerance
from ._plan import Plan, PlanRow, make_plan


def port(
    source: Any,
    target: Any,
    *,
    rules: Mapping[str, str] | None = None,
    strict: bool = True,
    dtype: Any = None,
    check: Any = None,
    check_kwargs: Mapping[str, Any]
    | tuple[Mapping[str, Any], Mapping[str, Any]]
    | None = None,
) -> Any:
    """Fill `target`'s structure with `source`'s weights, whatever their frameworks.

    Layers are recognised by kind through the registered codecs (`bridge.Codec`);
    arrays a module holds next to its sublayers are one-array layers (kind
    `"Array"`, same layout everywhere). Layers are paired by `rules`, then by
    identical paths, then by names equal after normalisation (`layers_3` =
    `layers[3]`), then by kind and shapes, in creation order only where the order
    is known to be it (see the porting guide); a choice left open is an error, never
    a guess. They are converted between
    layouts: Dense kernel `(in, out)` <-> Equinox weight `(out, in)`, conv HWIO <->
    OIHW, attention heads split <-> fused, BatchNorm statistics <-> `eqx.nn.State`.
    Every problem is collected first and raised once, as a `PortError`: nothing is
    half-written, and `target` is never modified. Each ported array takes the sharding
    of the target's array it replaces.

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
    - `strict`: with `False`, missing and unexpected layers are listed in the plan
      instead of raising, and arrays whose dtype differs from the target's are cast
      to it with a `PortWarning` listing them (with `True`, the default, a dtype
      change without `dtype=` is an error). Shape mismatches, ambiguities and
      unsupported layers always raise.
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
    abstract = placeholders(target)
    plan, problems = make_plan(source, abstract, rules, strict, dtype)
    if problems:
        raise _errors.PortError(problems)
    tree = run(plan)
    if plan.warnings:
        warnings.warn(
            "Port warnings:\n  " + "\n  ".join(plan.warnings),
            _errors.PortWarning,
            stacklevel=2,
        )
    ported = like(target, tree)
    if check is not None:
        _check(source, ported, check, check_kwargs)
    return ported


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
    slices: dict[Path, dict[int, Any]] = {}  # the layers of a target stack
    for step in sorted(plan.steps, key=_reading_order):
        for path, index, value in _move(step, problems):
            if index is None:
                new[path] = value
            else:
                slices.setdefault(path, {})[index] = value
    if problems:
        raise _errors.PortError(problems)
    assert plan._target is not None

    def replace(path: Path, leaf: Any) -> Any:
        if path in slices:
            parts = slices[path]
            stack = jnp.stack([_slice(parts, i, leaf) for i in range(leaf.shape[0])])
            return place(stack, sharding_of(leaf, path_str(path)))
        return new.get(path, leaf)

    return map_with_path(replace, plan._target)


def _reading_order(step: PlanRow) -> int:
    """Steps reading a lazily read file go shard by shard (see `bridge._lazy`)."""
    assert step._source is not None
    leaves = step._source.arrays or step._source.leaves
    return min((getattr(v, "order", 0) for v in leaves.values()), default=0)


def _slice(parts: dict[int, Any], i: int, leaf: Any) -> Any:
    """The `i`-th layer of a target stack: ported, or the target's own."""
    if i in parts:
        return parts[i]
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jnp.zeros(leaf.shape[1:], leaf.dtype)
    return leaf[i]


def _move(step: PlanRow, problems: list[str]) -> list[tuple[Path, int | None, Any]]:
    """The target arrays of one row: `(path, index in a stack or None, array)`."""
    s, t = step._source, step._target
    assert s is not None and t is not None
    leaves = {k: materialise(v) for k, v in s.own_leaves().items()}
    canonical = step.source_codec.decode(leaves, s.hyper)
    for entry, dtype in step.cast.items():
        canonical[entry] = jnp.asarray(canonical[entry]).astype(dtype)
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
    spec = t.specs[step.kind]
    canonical = filled(
        {k: canonical[k] for k in spec if k in canonical}, spec, step.fill
    )
    leaves = step.target_codec.encode(canonical, t.leaves, t.hyper)
    if t.index is not None:
        return [(t.real + t.paths[k], t.index, v) for k, v in leaves.items()]
    return [
        (
            t.path + t.paths[k],
            None,
            _placed(v, t.leaves[k], path_str(t.path + t.paths[k])),
        )
        for k, v in leaves.items()
    ]


def _placed(new: Any, like: Any, where: str) -> Any:
    """`new` with the sharding of the target's leaf it replaces, concrete or abstract
    (a no-op when they already agree, or when the target's leaf has none). A numpy
    array (from a PyTorch-layout state dict or a file) becomes a JAX array: the model
    owns it."""
    sharding = sharding_of(like, where)
    if isinstance(new, np.ndarray) and sharding is None:
        return jnp.asarray(new)
    return place(new, sharding)  # a host array goes to each device shard by shard
