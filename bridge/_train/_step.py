"""`make_step`: one compiled training step that updates only the trainable leaves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from flax.errors import InvalidRngError

from .._adapters._equinox import from_equinox
from .._adapters._linen import from_linen, linen_module
from .._adapters._native import to_native
from .._adapters._nnx import from_nnx
from .._tree import Path, Tree, framework, key_of, leaf_roles, path_str


_SPEC_NOT_BOOL = """\
The spec must hold True or False at every leaf; these leaves are not bools:
{problems}
Make a spec with bridge.trainable(tree, where), or with
eqx.tree_at(where, jax.tree_util.tree_map(lambda _: False, tree), replace=...)."""

_SPEC_MISMATCH = """\
The spec does not fit this tree:
{problems}
A spec says, for each leaf of the model's Tree, whether the step trains it: make it
from this very model with bridge.trainable(tree, where), and make a new step with
bridge.make_step when the model's structure changes."""

_NOTHING_TRAINABLE = """\
The spec marks no leaf trainable, so the step would train nothing. Mark the parameters
to train, e.g. spec = bridge.trainable(tree, lambda t: t.layers[-1])."""

_OPT_STATE_MISMATCH = """\
`opt_state` does not belong to this step: {problems}.
The optimizer state holds one entry per trainable leaf of the spec the step was made
with. Make it with `opt_state = step.init(tree)` from the same step (a step made with
another spec or optimizer needs its own state)."""

_NOT_SCALAR = """\
The loss must be a scalar, but loss_fn returned an array of shape {shape}. Reduce it,
e.g. `return jnp.mean((model(x) - y) ** 2)`."""

_AUX_FORM = """\
With has_aux=True, loss_fn must return a pair `(loss, aux)`, but it returned a
{kind}."""

_NEEDS_RNGS = """\
{error}
This Linen model draws random numbers (`make_rng`, as `nn.Dropout` does when not
deterministic) from a stream the step was not given. Give the step its streams, as to
`module.apply`: `step(tree, opt_state, *batch, rngs={{"dropout": key}})`, with a new
key each step (e.g. `jax.random.fold_in(key, i)`); a new key does not retrace."""

_STATE_FORM = """\
This Equinox model has an eqx.nn.State, so loss_fn is called as
`loss_fn(model, state, *batch)` and must return `(loss, new_state)` (with has_aux=True:
`((loss, aux), new_state)`), the new state being what the model's layers return, but it
returned {got}."""


def make_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    spec: Any,
    *,
    has_aux: bool = False,
) -> Step:
    """A compiled training step that updates only the leaves `spec` marks trainable.

    `loss_fn` is written in the model's own framework: inside the compiled step the
    Tree becomes the native model again (`bridge.to_native`) and is passed to it.

    - Flax NNX: `loss_fn(module, *batch)`. Batch statistics and RNG counters that the
      forward pass updates (`nnx.BatchNorm`, `nnx.Dropout`) come back in the returned
      Tree, so each step draws a new dropout mask, as with `nnx.jit`.
    - Flax Linen, Tree made with the module (`bridge.from_linen(variables, module)`):
      `loss_fn(bound_module, *batch)`; collections other than `params` are mutable,
      and what the forward pass writes to them (`batch_stats`) comes back in the Tree.
      Random streams (`nn.Dropout`, any `make_rng`) are given to each call,
      `step(tree, opt_state, *batch, rngs={"dropout": key})`, and bound with the
      variables, as `module.apply(..., rngs=...)` would. Without the module,
      `loss_fn(variables, *batch)`.
    - Equinox: `loss_fn(model, *batch)`. When the Tree holds an `eqx.nn.State`
      (`bridge.from_equinox(model, state)`), `loss_fn(model, state, *batch)`, which
      returns `(loss, new_state)`, the Equinox convention; the new state comes back
      in the Tree.

    The gradient is taken with respect to the trainable leaves only: the compiled step
    does no work for the gradients of frozen leaves, which come back unchanged, bit for
    bit. The step is one `jax.jit` over the Tree's arrays: it is traced once per tree
    structure and then runs with no Python walk over modules.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *batch) -> loss`, the loss a scalar array; with
      `has_aux=True` it returns `(loss, aux)`.
    - `optimizer`: any `optax.GradientTransformation` (`adamw`, `chain`, schedules,
      ...). It sees the trainable leaves as a dict `{keystr path: array}`, e.g.
      `{".layers[2].kernel": ...}`.
    - `spec`: a filter spec with the structure of the model's Tree, True for the leaves
      to train (from `bridge.trainable`, or built with `eqx.tree_at`). Only `params`
      leaves can be trainable.
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`.

    **Returns:**

    A step with

    - `step.init(tree) -> opt_state`: the optimizer state, for the trainable leaves
      only;
    - `step(tree, opt_state, *batch, rngs=None) -> (tree, opt_state, loss)`, with
      `aux` appended when `has_aux=True`. `rngs`, for a Linen model with its module
      only: a dict `{stream: key}` or one key (the `"params"` stream, which
      `make_rng` falls back to), as for `module.apply`. The keys are traced: a new
      key each step does not retrace.
    - `step.lower(tree, opt_state, *batch, rngs=None)`: the `jax.jit` lowering, to
      inspect the compiled step (`.compile().cost_analysis()`).

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, optax, bridge
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(2, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> tree = bridge.from_nnx(model)
    >>> spec = bridge.trainable(tree, lambda t: t.layers[2])
    >>> def loss_fn(model, x, y):
    ...     return jnp.mean((model(x) - y) ** 2)
    >>> step = bridge.make_step(loss_fn, optax.adam(1e-2), spec)
    >>> opt_state = step.init(tree)
    >>> x, y = jnp.ones((8, 2)), jnp.zeros((8, 1))
    >>> new, opt_state, loss = step(tree, opt_state, x, y)
    >>> bool((new.layers[0].kernel == tree.layers[0].kernel).all())
    True
    >>> bool((new.layers[2].kernel == tree.layers[2].kernel).all())
    False

    ```
    """
    return Step(loss_fn, optimizer, spec, has_aux)


class Step:
    """A training step made by `bridge.make_step`."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        spec: Any,
        has_aux: bool,
    ):
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(
                "`optimizer` must be an optax.GradientTransformation (such as "
                f"optax.adam(1e-3)), got {type(optimizer).__name__}."
            )
        flat = jtu.tree_flatten_with_path(spec)[0]
        flags: dict[Path, bool] = {}
        problems = []
        for keypath, flag in flat:
            path = tuple(key_of(e) for e in keypath)
            if isinstance(flag, (bool, np.bool_)):
                flags[path] = bool(flag)
            else:
                problems.append(f"  {path_str(path)}: {type(flag).__name__}")
        if problems:
            raise TypeError(_SPEC_NOT_BOOL.format(problems="\n".join(problems)))
        if not any(flags.values()):
            raise ValueError(_NOTHING_TRAINABLE)
        self._flags = flags
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._has_aux = has_aux
        self._jit = jax.jit(self._run, static_argnums=0)

    def init(self, tree: Tree) -> optax.OptState:
        """The optimizer state for the trainable leaves of `tree`."""
        params, _ = self._split(tree)
        return self._optimizer.init(params)

    def __call__(
        self, tree: Tree, opt_state: optax.OptState, *batch: Any, rngs: Any = None
    ) -> tuple:
        """One step: `(tree, opt_state, loss)`, and `aux` when `has_aux=True`.

        `rngs` (Flax Linen only): the random streams of this step, as for
        `module.apply(..., rngs=...)`; a traced argument, so a new key each step
        does not retrace."""
        leaves, treedef = jtu.tree_flatten(tree)
        changed, *rest = self._jit(treedef, leaves, opt_state, rngs, *batch)
        for i, leaf in changed.items():
            leaves[i] = leaf
        # the input treedef: the new Tree shares its static data, so the next call
        # finds the compiled step by identity
        return (jtu.tree_unflatten(treedef, leaves), *rest)

    def lower(
        self, tree: Tree, opt_state: optax.OptState, *batch: Any, rngs: Any = None
    ) -> Any:
        """`jax.jit(...).lower` of the step, e.g. for `.compile().cost_analysis()`."""
        leaves, treedef = jtu.tree_flatten(tree)
        return self._jit.lower(treedef, leaves, opt_state, rngs, *batch)

    def _split(self, tree: Tree) -> tuple[dict[str, Any], list[int]]:
        """The trainable leaves by name, and their positions; checks the structure."""
        if not isinstance(tree, Tree):
            raise TypeError(
                f"A step takes the model's bridge.Tree, got {type(tree).__name__}: "
                "convert the model once, before the loop, with bridge.to_neutral."
            )
        flat = jtu.tree_flatten_with_path(tree)[0]
        paths = [tuple(key_of(e) for e in p) for p, _ in flat]
        have = set(paths)
        problems = [
            f"  {path_str(p)} is in the tree but not in the spec"
            for p in paths
            if p not in self._flags
        ]
        problems += [
            f"  {path_str(p)} is in the spec but not in the tree"
            for p in self._flags
            if p not in have
        ]
        roles = leaf_roles(tree)
        position = [i for i, p in enumerate(paths) if self._flags.get(p)]
        problems += [
            f"  {path_str(paths[i])} is marked trainable but has role {roles[i]!r}; "
            "only `params` leaves can be trained"
            for i in position
            if roles[i] != "params"
        ]
        if problems:
            raise ValueError(_SPEC_MISMATCH.format(problems="\n".join(problems)))
        return {path_str(paths[i]): flat[i][1] for i in position}, position

    def _check_opt_state(self, opt_state: Any, params: dict[str, Any]) -> None:
        like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}
        want = jax.eval_shape(self._optimizer.init, like)
        same = jtu.tree_structure(opt_state) == jtu.tree_structure(want) and all(
            jnp.shape(a) == b.shape and jnp.result_type(a) == b.dtype
            for a, b in zip(jtu.tree_leaves(opt_state), jtu.tree_leaves(want))
        )
        if same:
            return
        found = {
            e.key
            for p, _ in jtu.tree_flatten_with_path(opt_state)[0]
            for e in p
            if isinstance(e, jtu.DictKey) and str(e.key)[:1] in (".", "[")
        }
        problems = [f"it has no entry for {k}" for k in params if k not in found]
        problems += [
            f"it has an entry for {k}, which this step does not train"
            for k in sorted(found - set(params))
        ]
        if not problems:
            problems = ["its structure, shapes or dtypes differ from `step.init(tree)`"]
        raise ValueError(_OPT_STATE_MISMATCH.format(problems="; ".join(problems)))

    def _run(
        self, treedef: Any, leaves: list, opt_state: Any, rngs: Any, *batch: Any
    ) -> tuple:
        params, position = self._split(jtu.tree_unflatten(treedef, leaves))
        self._check_opt_state(opt_state, params)
        names = list(params)

        def loss_of(params):
            full = list(leaves)
            for name, i in zip(names, position):
                full[i] = params[name]
            model = jtu.tree_unflatten(treedef, full)
            out, updated = _forward(model, self._loss_fn, batch, rngs)
            loss, aux = _unpack(out, self._has_aux)
            return loss, (aux, updated)

        grad_fn = jax.value_and_grad(loss_of, has_aux=True)
        (loss, (aux, updated)), grads = grad_fn(params)
        updates, opt_state = self._optimizer.update(grads, opt_state, params)
        new: Any = optax.apply_updates(params, updates)
        # only the leaves that changed leave the compiled step (each output is a new
        # buffer): `__call__` puts them into the Tree, by position
        changed = dict(updated)
        for name, i in zip(names, position):
            changed[i] = new[name]
        return (
            (changed, opt_state, loss, aux)
            if self._has_aux
            else (changed, opt_state, loss)
        )


def _unpack(out: Any, has_aux: bool) -> tuple[Any, Any]:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(_AUX_FORM.format(kind=type(out).__name__))
        loss, aux = out
    else:
        loss, aux = out, None
    if jnp.shape(loss) != ():
        raise ValueError(_NOT_SCALAR.format(shape=jnp.shape(loss)))
    return loss, aux


def _forward(
    tree: Tree, loss_fn: Callable[..., Any], batch: tuple, rngs: Any
) -> tuple[Any, dict[int, Any]]:
    """Run `loss_fn` on the native model; return its output and, by leaf position,
    the new values of the non-`params` leaves that the forward pass wrote."""
    native = to_native(tree, rngs=rngs)
    kind = framework(tree)
    if kind == "equinox" and isinstance(native, tuple):
        model, state = native
        result = loss_fn(model, state, *batch)
        if not (
            isinstance(result, tuple)
            and len(result) == 2
            and isinstance(result[1], eqx.nn.State)
            and jtu.tree_structure(result[1]) == jtu.tree_structure(state)
        ):
            raise TypeError(_STATE_FORM.format(got=_describe(result)))
        out, after = result[0], from_equinox(model, result[1])
    elif kind == "linen" and isinstance(native, nn.Module):
        try:
            out = loss_fn(native, *batch)
        except InvalidRngError as error:
            raise ValueError(_NEEDS_RNGS.format(error=error)) from error
        after = from_linen(native.variables, linen_module(tree))
    else:
        out = loss_fn(native, *batch)
        if kind == "nnx":
            after = from_nnx(native)
        else:
            return out, {}
    new = {
        tuple(key_of(e) for e in p): leaf
        for p, leaf in jtu.tree_flatten_with_path(after)[0]
    }
    flat = jtu.tree_flatten_with_path(tree)[0]
    roles = leaf_roles(tree)
    updated = {}
    for i, ((keypath, leaf), role) in enumerate(zip(flat, roles)):
        path = tuple(key_of(e) for e in keypath)
        if role != "params" and path in new and new[path] is not leaf:
            updated[i] = new[path]
    return out, updated


def _describe(result: Any) -> str:
    if isinstance(result, tuple):
        inner = ", ".join(type(x).__name__ for x in result)
        return f"a tuple ({inner})"
    return f"a {type(result).__name__}"
