"""Dispatch to the adapters: `to_neutral` and `to_native`, and the few steps that
`make_step`, `port`, `compare` and `load` need, each a lookup in the registry."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._tree import Tree, leaf_roles
from . import (  # noqa: F401  (they register the built-in adapters)
    _equinox,
    _haiku,
    _keras,
    _linen,
    _nnx,
    _torch,
)
from ._build import source_of
from ._registry import Adapter, adapter_for, adapter_named, adapters


def to_neutral(obj: Any) -> Tree:
    """Convert a model of any framework to a `bridge.Tree`.

    **Arguments:**

    - `obj`: one of
        - a `bridge.Tree` (returned as it is);
        - an `nnx.Module` (as `bridge.from_nnx`);
        - an Equinox model, or a tuple `(model, state)` with an `eqx.nn.State`
          (as `bridge.from_equinox`);
        - a Linen variables dict (as `bridge.from_linen`), a tuple
          `(module, variables)`, or a bound Linen module (`module.bind(variables)`);
        - a PyTorch-layout state dict (a flat mapping of dotted names to arrays) or
          a `torch.nn.Module` (as `bridge.from_torch`);
        - Haiku's `(fn, params)` or `(fn, params, state)`, `fn` what
          `hk.transform` returned (as `bridge.from_haiku`; dicts alone look like
          Linen variables: pass them to `bridge.from_haiku`);
        - a Keras 3 model or layer, on the JAX backend (as `bridge.from_keras`).

    **Returns:**

    A `bridge.Tree`.

    **Example:**

    ```python
    >>> import bridge
    >>> from flax import nnx
    >>> t = bridge.to_neutral(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> bridge.to_native(t).kernel.shape
    (2, 3)

    ```
    """
    if isinstance(obj, Tree):
        return obj
    return adapter_of(obj).to_tree(obj)


def adapter_of(obj: Any) -> Adapter:
    """The adapter whose `recognise` accepts a native model (`TypeError` if none)."""
    adapter = adapter_for(obj)
    if adapter is None:
        frameworks = ", ".join(a.display for a in reversed(adapters()))
        raise TypeError(
            f"bridge.to_neutral does not know how to convert `obj`, a "
            f"{type(obj).__name__}: "
            "expected an nnx.Module, an Equinox model or (model, state), Linen "
            "variables or (module, variables), or a bridge.Tree (the registered "
            f"frameworks are {frameworks})."
        )
    return adapter


def check_model(obj: Any, argument: str) -> None:
    """A model some adapter recognises, or a Tree: else a `TypeError` naming the
    argument (at the public entry points, before any work)."""
    if not isinstance(obj, Tree):
        try:
            adapter_of(obj)
        except TypeError as error:
            raise TypeError(str(error).replace("`obj`", f"`{argument}`")) from None


_RNGS_NOT_LINEN = """\
`rngs` is for Flax Linen models, which take their random streams when they are bound
(`module.apply(..., rngs=...)`), but this Tree came from a {framework} model. {fix}"""


def to_native(tree: Tree, *, rngs: Any = None) -> Any:
    """Turn a `bridge.Tree` back into the native model it came from.

    **Arguments:**

    - `tree`: a whole-model `bridge.Tree` made by an adapter.
    - `rngs`: Flax Linen only, with the module: the random streams to bind, with the
      meaning of `module.apply(..., rngs=...)`: a dict `{"dropout": key, ...}`, or
      one key, which feeds the `"params"` stream (Linen's `make_rng` falls back to
      it for a stream that is not given). Needed by layers that call `make_rng`,
      such as `nn.Dropout(deterministic=False)`.

    **Returns:**

    - from NNX: a new `nnx.Module` (as `bridge.to_nnx`);
    - from Equinox: the model, or `(model, state)` (as `bridge.to_equinox`);
    - from a PyTorch-layout state dict or module: the state dict, numpy arrays (as
      `bridge.to_torch`);
    - from Haiku: `params` or `(params, state)`, preceded by the transformed
      function when the Tree has it (as `bridge.to_haiku`);
    - from Keras: a new model of the same config holding the Tree's arrays (as
      `bridge.to_keras`);
    - from Linen with a module: the module bound to the variables (and `rngs`),
      callable as `native(x)`; collections other than `params` are mutable, and
      `native.variables` reads them after a forward pass. Without a module: the
      variables dict (as `bridge.to_linen`).

    **Raises:**

    `ValueError` when `rngs` is given for a model other than a Linen module.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, flax.linen as nn, bridge
    >>> module = nn.Dropout(0.5, deterministic=False)
    >>> tree = bridge.from_linen({"params": {}}, module)
    >>> model = bridge.to_native(tree, rngs={"dropout": jax.random.key(0)})
    >>> model(jnp.ones(4)).shape
    (4,)

    ```
    """
    adapter = adapter_of_tree(tree)
    if rngs is None:
        return adapter.to_native(tree)
    if adapter.bind is None:
        fix = adapter.rngs_hint
        raise ValueError(_RNGS_NOT_LINEN.format(framework=adapter.display, fix=fix))
    return adapter.bind(tree, rngs)


def adapter_of_tree(tree: Any) -> Adapter:
    """The adapter of the model a whole-model Tree came from (`TypeError` for
    anything else)."""
    return adapter_named(source_of(tree).framework)


def like(target: Any, tree: Tree) -> Any:
    """A filled `tree` in the form `target` was given in: a Tree stays a Tree, a
    native model becomes one of the same form (`port`, `load(like=...)`)."""
    if isinstance(target, Tree):
        return tree
    adapter = adapter_of_tree(tree)
    return (
        adapter.to_native(tree) if adapter.like is None else adapter.like(target, tree)
    )


def runnable(target: Any, ported: Any) -> Any:
    """What a ported model (`like(target, tree)`) runs as for inference, or None
    where it cannot run (`Adapter.runnable`)."""
    if isinstance(target, Tree):
        return ported
    adapter = adapter_for(target)
    if adapter is None or adapter.runnable is None:
        return ported
    return adapter.runnable(target, ported)


def placeholders(target: Any) -> Any:
    """An abstract target model (from `eval_shape`) made acceptable to its adapter at
    no memory cost; anything else as it is."""
    adapter = None if isinstance(target, Tree) else adapter_for(target)
    if adapter is None or adapter.placeholders is None:
        return target
    return adapter.placeholders(target)


def forward(
    tree: Tree, loss_fn: Callable[..., Any], batch: tuple, rngs: Any
) -> tuple[Any, Tree | None]:
    """`loss_fn` called on the native model of `tree`, and the Tree after the forward
    pass (None: the pass writes no state), for `bridge.make_step`."""
    adapter = adapter_of_tree(tree)
    if adapter.forward is None or (rngs is not None and adapter.bind is None):
        return loss_fn(to_native(tree, rngs=rngs), *batch), None
    return adapter.forward(tree, loss_fn, batch, rngs)


def runnable_model(model: Any) -> Any:
    """What `infer` runs: a Tree as its adapter runs it (`Adapter.run_tree`: a
    PyTorch folder's Tree as the folder's model holding its arrays), else as its
    native model; any other model as it is. Made once, it runs many times."""
    if not isinstance(model, Tree):
        return model
    adapter = adapter_of_tree(model)
    return (adapter.run_tree or adapter.to_native)(model)


def infer(
    model: Any,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    channel_first: bool | None = None,
) -> Any:
    """A model of any framework (or a Tree) run for inference on batched inputs (and
    keyword arguments), as its framework runs it (`bridge.compare`). With
    `channel_first`, each input of rank >= 3 gets its last axis moved to axis 1
    (`(N, H, W, C)` -> `(N, C, H, W)`) and each output of rank >= 3 back; by
    default, where the model says so (`channel_first = True` on its class)."""
    adapter = adapter_of_tree(model) if isinstance(model, Tree) else adapter_of(model)
    model = runnable_model(model)
    kwargs = dict(kwargs or {})
    if channel_first is None:
        channel_first = says_channel_first(model)
    if channel_first:
        inputs = tuple(jnp.moveaxis(x, -1, 1) if x.ndim >= 3 else x for x in inputs)
    if adapter.infer is None:
        out = model(*inputs, **kwargs)
    else:
        out = adapter.infer(model, inputs, kwargs)
    if channel_first:
        out = jax.tree_util.tree_map(
            lambda y: jnp.moveaxis(y, 1, -1) if y.ndim >= 3 else y, out
        )
    return out


def says_channel_first(model: Any) -> bool:
    """Whether a native model (or `(model, state)`) says it takes channels first
    (`channel_first = True`, a class attribute or field)."""
    first = model[0] if isinstance(model, tuple) and model else model
    return bool(getattr(first, "channel_first", False))


def optimizer_params(tree: Tree) -> Any:
    """The parameters of a whole-model Tree in the form its framework's optimizers are
    initialised with (`tx.init(...)` of them is that framework's usual state); a
    dict keyed by `keystr` path for a framework without that hook."""
    hooks = adapter_of_tree(tree).optimizer
    if hooks is not None and hooks.params is not None:
        return hooks.params(tree)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(k): x
        for (k, x), role in zip(flat, leaf_roles(tree))
        if role == "params"
    }


def optimizer_start(tree: Tree, tx: Any) -> Any:
    """The framework's usual optimizer container for a Tree trained by `tx`
    (`nnx.Optimizer`), or None where that is a bare optax state."""
    hooks = adapter_of_tree(tree).optimizer
    if hooks is None or hooks.start is None:
        return None
    return hooks.start(tree, tx)
