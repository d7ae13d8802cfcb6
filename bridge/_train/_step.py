"""`make_step`: one compiled training step that updates only the trainable leaves."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jax.core import Tracer

from .._adapters._native import forward
from .._arguments import check_bool, check_callable, check_hashable
from .._kept._array import quantized_positions
from .._kept._matmul import stored_form
from .._paths import Path, path_of, path_str
from .._tree import Tree, leaf_roles


_SPEC_NOT_BOOL = """\
`spec` must hold True or False at every leaf; these leaves are not bools:
{problems}
Make a spec with bridge.trainable(tree, where), or with
eqx.tree_at(where, jax.tree_util.tree_map(lambda _: False, tree), replace=...)."""

_SPEC_MISMATCH = """\
The spec does not fit this tree:
{problems}
A spec says, for each leaf of the model's Tree, whether the step trains it: make it
from this very model with bridge.trainable(tree, where), and make a new step with
bridge.make_step when the model's structure changes."""

_QUANTIZED_TRAINABLE = """\
The spec marks parts of weights kept quantized trainable:
{problems}
A weight loaded with bridge.load(..., keep_quantized=True) is frozen: the step
dequantizes it inside its compiled function and never differentiates it. Train LoRA
adapters on it (bridge.lora), or load the checkpoint dequantized (without
keep_quantized) to train the weight itself; bridge.trainable leaves quantized weights
out of a spec."""

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

_CONSUMED = """\
{what} was consumed by a step: the step donates the trainable leaves and the
optimizer state to XLA, which reuses their buffers for the new ones. Use the Tree and
`opt_state` the step returned, `tree, opt_state, loss = step(tree, opt_state, ...)`, or
make the step with `bridge.make_step(..., donate=False)` to keep its inputs valid."""


def make_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    spec: Any,
    *,
    has_aux: bool = False,
    donate: bool = True,
    axis_name: Hashable | None = None,
) -> TrainStep:
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
    - Haiku: `loss_fn(params, *batch)`, or with state `loss_fn(params, state,
      *batch) -> (loss, new_state)` (Equinox's convention), calling `fn.apply`
      inside; the new state (`hk.BatchNorm`'s moving averages) comes back in the
      Tree.
    - Keras: `loss_fn(model, *batch)`, the model run with its variables read from
      the Tree (`keras.StatelessScope`, as `model.stateless_call` does: the model
      is never written to); what the call assigns (`model(x, training=True)`:
      batch statistics, dropout seed states) comes back in the Tree.

    The gradient is taken with respect to the trainable leaves only: the compiled step
    does no work for the gradients of frozen leaves, which come back unchanged, bit for
    bit. The step is one `jax.jit` over the Tree's arrays: it is traced once per tree
    structure and then runs with no Python walk over modules.

    **Donation.** By default the step donates the trainable leaves and the optimizer
    state to XLA (`jax.jit(..., donate_argnums=...)`), which writes the new values in
    their buffers: the step holds one copy of them, not two. This is the convention of
    optax loops and of `eqx.filter_jit(donate="all")`: the Tree and `opt_state` given to
    a step are consumed, use the ones it returns (`tree, opt_state, loss =
    step(tree, opt_state, ...)`). The frozen leaves are never donated: the returned
    Tree holds them as they are. A Tree from an adapter shares its arrays with the
    model it was made from, so after the first step that model's trainable arrays are
    consumed too. Passing a consumed Tree or state again raises an error that says
    so; `donate=False` keeps the inputs valid (to compare before and after, say).

    **Data parallelism.** With `axis_name`, the gradients and the loss are averaged
    over that named axis (`jax.lax.pmean`) before the update, so the step can run
    under `jax.pmap(step, axis_name=...)` or `jax.shard_map`, each device on its part
    of the batch, as in Flax's ImageNet example (with `BatchNorm(axis_name=...)`).
    Under `jax.jit` with a batch sharded over devices, no axis name is needed: XLA
    averages across devices by itself.

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
    - `donate`: whether each call consumes the trainable leaves of its Tree and its
      `opt_state` (default True).
    - `axis_name`: the name of a mapped axis (`jax.pmap`, `jax.shard_map`) to average
      the gradients and the loss over; None (the default) averages nothing.

    **Returns:**

    A `bridge.TrainStep`, with

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
    >>> frozen = tree.layers[0].kernel
    >>> tree, opt_state, loss = step(tree, opt_state, x, y)
    >>> tree.layers[0].kernel is frozen
    True
    >>> model.layers[2].kernel[...]
    Traceback (most recent call last):
    ...
    RuntimeError: Array has been deleted with shape=float32[4,1].

    ```
    """
    check_callable(loss_fn, "loss_fn")
    check_bool(has_aux, "has_aux")
    check_bool(donate, "donate")
    check_hashable(axis_name, "axis_name")
    return TrainStep(loss_fn, optimizer, spec, has_aux, donate, axis_name)


class _Layout(NamedTuple):
    """Where the trainable leaves of a Tree of one structure are, and its step."""

    treedef: Any
    names: tuple[
        str, ...
    ]  # the keystr paths of the trainable leaves, the opt_state keys
    trained: tuple[int, ...]  # their positions among the Tree's leaves
    frozen: tuple[int, ...]  # the positions of the other leaves
    jit: Any  # the compiled step, `jit(trained, frozen, opt_state, rngs, *batch)`


class _Flat:
    """A Tree's leaves as a step holds them: the trainable ones and the others.

    A step's output Tree carries it (`Tree._lazy`), so the next call neither flattens
    the Tree nor builds its nodes: the Python work per call does not grow with the
    number of leaves (only with the number of state leaves the forward pass writes)."""

    __slots__ = ("layout", "trained", "frozen")

    def __init__(self, layout: _Layout, trained: list, frozen: list):
        self.layout, self.trained, self.frozen = layout, trained, frozen

    @property
    def treedef(self) -> Any:
        return self.layout.treedef

    def leaves(self) -> list:
        leaves: list[Any] = [None] * (len(self.trained) + len(self.frozen))
        for i, leaf in zip(self.layout.trained, self.trained):
            leaves[i] = leaf
        for i, leaf in zip(self.layout.frozen, self.frozen):
            leaves[i] = leaf
        return leaves


class TrainStep:
    """A compiled training step, made by `bridge.make_step` (see there for its
    arguments).

    Call it as `step(tree, opt_state, *batch, rngs=None) -> (tree, opt_state, loss)`
    (`aux` appended with `has_aux=True`); `step.init(tree)` makes the optimizer state
    and `step.lower(...)` gives the `jax.jit` lowering.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        spec: Any,
        has_aux: bool,
        donate: bool = True,
        axis_name: Hashable | None = None,
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
            path = path_of(keypath)
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
        self._donate = donate
        self._axis_name = axis_name
        self._layouts: dict[Any, _Layout] = {}
        self._owned: set[int] = set()  # the ids of the layouts above

    def init(self, tree: Tree) -> optax.OptState:
        """The optimizer state for the trainable leaves of `tree`."""
        flat = self._flat(tree)
        return self._optimizer.init(dict(zip(flat.layout.names, flat.trained)))

    def __call__(
        self, tree: Tree, opt_state: optax.OptState, *batch: Any, rngs: Any = None
    ) -> tuple:
        """One step: `(tree, opt_state, loss)`, and `aux` when `has_aux=True`.

        `rngs` (Flax Linen only): the random streams of this step, as for
        `module.apply(..., rngs=...)`; a traced argument, so a new key each step
        does not retrace."""
        flat = self._flat(tree)
        layout, trained = flat.layout, flat.trained
        if self._donate and _deleted(trained[0]):
            raise RuntimeError(_CONSUMED.format(what="This Tree"))
        try:
            new, updated, *rest = layout.jit(
                trained, flat.frozen, opt_state, rngs, *batch
            )
        except (RuntimeError, ValueError) as error:
            # XLA words a donated buffer passed again per backend ("Array has been
            # deleted" on CPU, "Donation requested for invalid buffer" on TPU and
            # GPU): ask the arrays themselves instead of reading the text
            if self._donate:
                _raise_if_consumed(trained, opt_state, error)
            raise
        frozen = flat.frozen
        if updated:  # state the forward pass wrote (batch statistics, RNG counters)
            frozen = list(frozen)
            for k, leaf in updated.items():
                frozen[k] = leaf
        # the same treedef: the new Tree shares the static data of the input
        return (Tree._lazy(tree._info, _Flat(layout, new, frozen)), *rest)

    def lower(
        self, tree: Tree, opt_state: optax.OptState, *batch: Any, rngs: Any = None
    ) -> Any:
        """`jax.jit(...).lower` of the step, e.g. for `.compile().cost_analysis()`."""
        flat = self._flat(tree)
        return flat.layout.jit.lower(flat.trained, flat.frozen, opt_state, rngs, *batch)

    def _flat(self, tree: Tree) -> _Flat:
        """`tree`'s leaves, split by the layout of its structure."""
        if not isinstance(tree, Tree):
            raise TypeError(
                f"A step takes the model's bridge.Tree, got {type(tree).__name__}: "
                "convert the model once, before the loop, with bridge.to_neutral."
            )
        try:
            flat = object.__getattribute__(tree, "_flat")
        except AttributeError:
            flat = None
        else:  # returned by a step: by this one, or by another
            if id(flat.layout) in self._owned:  # (hashing a treedef is O(nodes))
                return flat
        if flat is None:
            leaves, treedef = jtu.tree_flatten(tree)
        else:
            treedef, leaves = flat.treedef, flat.leaves()
        layout = self._layouts.get(treedef)
        if layout is None:
            layout = self._layouts[treedef] = self._layout(treedef, tree)
            self._owned.add(id(layout))
        return _Flat(
            layout,
            [leaves[i] for i in layout.trained],
            [leaves[i] for i in layout.frozen],
        )

    def _layout(self, treedef: Any, tree: Tree) -> _Layout:
        """The layout of `tree`'s trainable leaves; checks the structure."""
        flat = jtu.tree_flatten_with_path(tree)[0]
        paths = [path_of(p) for p, _ in flat]
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
        trained = [i for i, p in enumerate(paths) if self._flags.get(p)]
        problems += [
            f"  {path_str(paths[i])} is marked trainable but has role {roles[i]!r}; "
            "only `params` leaves can be trained"
            for i in trained
            if roles[i] != "params"
        ]
        if problems:
            raise ValueError(_SPEC_MISMATCH.format(problems="\n".join(problems)))
        kept = quantized_positions(tree)
        marked = sorted({kept[i] for i in trained if i in kept})
        if marked:
            lines = "\n".join(f"  {p}" for p in marked)
            raise ValueError(_QUANTIZED_TRAINABLE.format(problems=lines))
        chosen = set(trained)
        names = tuple(path_str(paths[i]) for i in trained)
        frozen = tuple(i for i in range(len(paths)) if i not in chosen)
        run = functools.partial(self._run, treedef, names, tuple(trained), frozen)
        # donated: the trainable leaves and the optimizer state
        jit = jax.jit(run, donate_argnums=(0, 2) if self._donate else ())
        return _Layout(treedef, names, tuple(trained), frozen, jit)

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
        self,
        treedef: Any,
        names: tuple[str, ...],
        trained_at: tuple[int, ...],
        frozen_at: tuple[int, ...],
        trained: list,
        frozen: list,
        opt_state: Any,
        rngs: Any,
        *batch: Any,
    ) -> tuple:
        leaves: list[Any] = [None] * (len(trained) + len(frozen))
        for i, leaf in zip(frozen_at, frozen):
            leaves[i] = leaf
        params = dict(zip(names, trained))
        self._check_opt_state(opt_state, params)

        def loss_of(params):
            full = list(leaves)
            for name, i in zip(names, trained_at):
                full[i] = params[name]
            model = jtu.tree_unflatten(treedef, full)
            out, updated = _forward(model, self._loss_fn, batch, rngs)
            loss, aux = _unpack(out, self._has_aux)
            return loss, (aux, updated)

        grad_fn = jax.value_and_grad(loss_of, has_aux=True)
        (loss, (aux, updated)), grads = grad_fn(params)
        if self._axis_name is not None:
            grads, loss = jax.lax.pmean((grads, loss), self._axis_name)
        updates, opt_state = self._optimizer.update(grads, opt_state, params)
        new: Any = optax.apply_updates(params, updates)
        # only the leaves that changed leave the compiled step (each output is a new
        # buffer): the trainable ones in order, and the state the forward pass wrote,
        # by index into `frozen`
        new = [new[name] for name in names]
        index = {i: k for k, i in enumerate(frozen_at)}
        updated = {index[i]: leaf for i, leaf in updated.items()}
        out = (new, updated, opt_state, loss)
        return (*out, aux) if self._has_aux else out


def _deleted(leaf: Any) -> bool:
    """Whether `leaf` is an array whose buffer was donated (never for a tracer)."""
    return isinstance(leaf, jax.Array) and (
        not isinstance(leaf, Tracer) and leaf.is_deleted()
    )


def _raise_if_consumed(trained: list, opt_state: Any, error: Exception) -> None:
    """Raise a `bridge` error when `error` comes from passing consumed buffers."""

    if any(map(_deleted, trained)):
        raise RuntimeError(_CONSUMED.format(what="This Tree")) from error
    if any(map(_deleted, jtu.tree_leaves(opt_state))):
        raise RuntimeError(_CONSUMED.format(what="This `opt_state`")) from error


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
    the new values of the non-`params` leaves that the forward pass wrote. Weights
    kept quantized (`bridge._kept._array.QuantizedArray`) are dequantized here, inside
    the compiled step: `loss_fn` sees the dense model, and its matrix products with
    them read them as stored (`bridge._kept._matmul`: the backward pass recomputes each
    dense weight instead of keeping it)."""
    run = stored_form(lambda t, b, r: forward(t, loss_fn, b, r))
    out, after = run(tree, batch, rngs)
    if after is None:
        return out, {}
    new = {path_of(p): leaf for p, leaf in jtu.tree_flatten_with_path(after)[0]}
    flat = jtu.tree_flatten_with_path(tree)[0]
    roles = leaf_roles(tree)
    updated = {}
    for i, ((keypath, leaf), role) in enumerate(zip(flat, roles)):
        path = path_of(keypath)
        if role != "params" and path in new and new[path] is not leaf:
            updated[i] = new[path]
    return out, updated
