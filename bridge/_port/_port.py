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
from .._paths import Path
from .._tree import Tree, map_with_path
from . import _errors
from ._codec import filled
from ._plan import Plan, PlanRow, make_plan


def port(
    source: Any,
    target: Any,
    *,
    rules: Mapping[str, str] | None = None,
    strict: bool = True,
    dtype: Any = None,
) -> Any:
    """Fill `target`'s structure with `source`'s weights, whatever their frameworks.

    Layers are recognised by kind through the registered codecs (`bridge.Codec`),
    paired by kind, shape and definition order (or by `rules`), and converted between
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
    return like(target, tree)


def run(plan: Plan) -> Tree:
    """Execute a plan: the target Tree with every paired layer's arrays replaced."""
    problems: list[str] = []
    new: dict[Path, Any] = {}
    for step in sorted(plan.steps, key=_reading_order):
        new.update(_move(step, problems))
    if problems:
        raise _errors.PortError(problems)
    assert plan._target is not None
    return map_with_path(lambda path, leaf: new.get(path, leaf), plan._target)


def _reading_order(step: PlanRow) -> int:
    """Steps reading a lazily read file go shard by shard (see `bridge._lazy`)."""
    assert step._source is not None
    return min(
        (getattr(v, "order", 0) for v in step._source.leaves.values()), default=0
    )


def _move(step: PlanRow, problems: list[str]) -> dict[Path, Any]:
    s, t = step._source, step._target
    assert s is not None and t is not None
    leaves = {k: materialise(v) for k, v in s.leaves.items()}
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
    return {t.path + t.paths[k]: _placed(v, t.leaves[k]) for k, v in leaves.items()}


def _placed(new: Any, like: Any) -> Any:
    """`new` with the sharding of the target's array it replaces (a no-op when they
    already agree, or when the target's array is abstract). A numpy array (from a
    PyTorch-layout state dict or a file) becomes a JAX array: the model owns it."""
    if isinstance(new, np.ndarray):
        new = jnp.asarray(new)
    sharding = getattr(like, "sharding", None)
    if isinstance(like, jax.Array) and isinstance(new, jax.Array):
        if not new.sharding.is_equivalent_to(sharding, new.ndim):  # pyright: ignore
            return jax.device_put(new, sharding)
    return new
