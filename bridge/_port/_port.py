"""`port`: fill a model of any framework with the weights of another."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from .._adapters._native import (
    check_model,
    like,
    placeholders,
    runnable,
    runnable_model,
    says_channel_first,
    to_neutral,
)
from .._arguments import (
    check_bool,
    check_dtype,
    check_inputs,
    check_pair_or_mapping,
    check_rules,
)
from .._paths import Path
from .._tree import Tree
from . import _carry, _errors
from ._compare import largest_difference, outputs, tolerance
from ._plan import Plan, PlanRow
from ._planning import make_plan
from ._report import name, report as made_report, warn
from ._run import run
from ._split import SPLIT, verified
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
    # the source as a Tree once (its adapter asked once); LoRA adapters follow
    # their layers
    plain, adapters = _carry.split(to_neutral(source))
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
    ported = like(target, tree)
    if any(s.by == SPLIT for s in plan.steps):  # which part is which: the outputs
        plan, ported = _split_checked(plan, source, target, ported, given)
    if plan.warnings:  # the mismatched layers: in the report (`bridge.Report`)
        warn("Port warnings:\n  " + "\n  ".join(plan.warnings), _errors.PortWarning)
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


def _split_checked(
    plan: Plan, source: Any, target: Any, ported: Any, example: Example | None
) -> tuple[Plan, Any]:
    """The plan and ported model whose assignment of fused parts to layers
    computes the source's outputs on the example inputs (`_split.verified`)."""
    layers = ", ".join(sorted({s.source for s in plan.steps if s.by == SPLIT})[:3])
    if example is None or not all(_valued(x) for x in example.inputs):
        why = "the example inputs hold no values" if example else "none were given"
        raise _errors.PortError(
            [_errors.SPLIT_UNCHECKED.format(layers=layers, pairs="parts", why=why)]
        )
    kwargs = example.kwargs if example.paired else None
    both = {} if example.paired else example.kwargs[0]
    expected: list[Any] = []
    source = runnable_model(source)  # once: it runs for every assignment tried

    def difference(ported: Any) -> float:
        model = runnable(target, ported)
        if model is None:
            raise ValueError(
                _errors.SPLIT_UNCHECKED.format(
                    layers=layers,
                    pairs="parts",
                    why="the ported target cannot run (a state dict, or a module "
                    "on the meta device: give the module with its tensors)",
                )
            )
        try:
            first = tuple(
                traced or says_channel_first(m)
                for traced, m in zip(plan._channel_first, (source, model))
            )
            a, b = outputs(
                source, model, example.inputs, first, kwargs, both, matched=True
            )
        except Exception as error:  # a side that cannot run: no check
            raise ValueError(
                _errors.SPLIT_UNCHECKED.format(
                    layers=layers,
                    pairs="parts",
                    why=f"the models do not both run ({type(error).__name__}: "
                    f"{str(error)[:200]})",
                )
            ) from None
        if not expected:
            expected.append(tolerance(a)[0])
        return largest_difference(a, b) / expected[0]

    def rerun(rows: tuple[PlanRow, ...]) -> Any:
        return like(target, run(dataclasses.replace(plan, steps=rows)))

    try:
        rows, ported = verified(plan.steps, ported, rerun, difference)
    except ValueError as error:
        raise _errors.PortError([str(error)]) from None
    return dataclasses.replace(plan, steps=rows), ported


def _valued(x: Any) -> bool:
    """Whether an example input holds values (not a `jax.ShapeDtypeStruct`)."""
    leaves = jax.tree_util.tree_leaves(x)
    return not any(isinstance(v, jax.ShapeDtypeStruct) for v in leaves)


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
