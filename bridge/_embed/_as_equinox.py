"""`as_equinox`: an NNX module or a Linen module as an `eqx.Module`."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from .._adapters._keys import same_key
from .._paths import Path
from .._shown import some
from .._tree import Tree
from ._inner import Inner, inner_of, run


_NO_STATE = """\
The wrapped model has state ({roles}), so the wrapper follows the Equinox State
convention: call it as `y, state = wrapper(*args, state)`, the state made with
`model, state = eqx.nn.make_with_state(...)` or `state = eqx.nn.State(model)` for the
model that holds the wrapper; the last positional argument was a {got}."""


_OTHER_STATE = """\
The `eqx.nn.State` given to this wrapper holds no entry for {missing} of the wrapped
model's {total} state arrays (its {roles}): it was made for another model. Make the
state from the model that holds this wrapper: `model, state =
eqx.nn.make_with_state(...)` or `state = eqx.nn.State(model)`."""


def _is_none(x: Any) -> bool:
    return x is None


def as_equinox(model: Any):
    """A Flax NNX module or a Flax Linen module as an `eqx.Module`.

    The wrapper is a pytree whose array leaves are the wrapped model's arrays:
    `wrapper.model` is the model's `bridge.Tree` (`wrapper.model.layers[0].kernel`),
    so `eqx.partition`, `eqx.filter_grad`, `eqx.tree_at`, `eqx.filter_jit` and
    `jax.vmap` work on it as on any Equinox model.

    State (NNX `BatchStat` and RNG state, Linen `batch_stats` and other collections)
    follows the Equinox `State` convention: each such leaf of `wrapper.model` is an
    `eqx.nn.StateIndex` whose initial value is the model's current value, so
    `eqx.nn.make_with_state` or `eqx.nn.State(model)` of the model that holds the
    wrapper collects it, `bridge.from_equinox(model, state)` places it at its path
    (`.model.bn.mean`), and the wrapper is called `y, state = wrapper(*args,
    state)`. A model without state is called `y = wrapper(*args)`.

    - Mode: `eqx.nn.inference_mode(model)` sets the wrapper's `inference` field, and
      an NNX model is then called in `.eval()` mode (`inference=False`: `.train()`;
      None, the default, leaves the module as it is). A Linen module takes its mode
      as a call argument (`wrapper(x, state, train=False)`): keyword arguments are
      passed to the wrapped model.
    - Randomness: `wrapper(..., key=key)`. For a Linen module, `key` is the
      `rngs` of `module.apply` (one key, which every `make_rng` stream falls back
      to, or a dict `{stream: key}`). For an NNX module, every RNG stream of the
      module is reseeded from `key` for the call (`nnx.reseed`), and its stream state
      in `State` is left unchanged; without `key`, the module's own streams advance
      and their new counts come back in the state.

    **Arguments:**

    - `model`: a Flax NNX module, a Linen `(module, variables)` or bound module
      (`module.bind(variables)`), or a `bridge.Tree` of one. It is not modified; the
      wrapper holds its current arrays (shared, not copied).

    **Returns:**

    An `eqx.Module` (an `EquinoxWrapper`).

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, equinox as eqx, bridge
    >>> from flax import nnx
    >>> linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> layer = bridge.as_equinox(linear)
    >>> layer.model.kernel.shape
    (2, 3)
    >>> bool((layer(jnp.ones(2)) == linear(jnp.ones(2))).all())
    True
    >>> grads = eqx.filter_grad(lambda m, x: m(x).sum())(layer, jnp.ones(2))
    >>> grads.model.kernel.shape
    (2, 3)

    ```
    """
    inner, leaves = inner_of(model, "as_equinox", "equinox")
    held = [
        x if r == "params" else eqx.nn.StateIndex(x)
        for x, r in zip(leaves, inner.roles)
    ]
    return EquinoxWrapper(inner.tree(held), None, inner)


def _is_index(x: Any) -> bool:
    return isinstance(x, eqx.nn.StateIndex)


def _holds(state: Any, index: Any) -> bool:
    try:
        state.get(index)
    except KeyError:
        return False
    return True


class EquinoxWrapper(eqx.Module):
    """A model of another framework inside Equinox: made by `bridge.as_equinox`."""

    model: Tree
    inference: bool | None
    inner: Inner = eqx.field(static=True)

    def _bridge_wrapped(self) -> tuple[Inner, Path]:
        """The wrapped model and where its arrays are under the wrapper: `model`."""
        return self.inner, ("model",)

    def _other_state(self, state: Any) -> str:
        flat = jtu.tree_flatten_with_path(self.model, is_leaf=_is_index)[0]
        indices = [(k, x) for k, x in flat if _is_index(x)]
        lacking = [jtu.keystr(k) for k, x in indices if not _holds(state, x)]
        return _OTHER_STATE.format(
            missing=some(lacking, show=lambda p: f".model{p}"),
            total=len(indices),
            roles=", ".join(sorted({r for r in self.inner.roles if r != "params"})),
        )

    def __call__(self, *args: Any, key: Any = None, **kwargs: Any) -> Any:
        """`y = wrapper(*args)`, or `y, state = wrapper(*args, state)` when the
        wrapped model has state; `key` as described in `bridge.as_equinox`."""
        inner = self.inner
        held = jtu.tree_leaves(self.model, is_leaf=_is_index)
        state = None
        if inner.stateful:
            got = args[-1] if args else None
            if not isinstance(got, eqx.nn.State):
                roles = sorted({r for r in inner.roles if r != "params"})
                raise TypeError(
                    _NO_STATE.format(roles=", ".join(roles), got=type(got).__name__)
                )
            args, state = args[:-1], got
            try:
                leaves = [state.get(x) if _is_index(x) else x for x in held]
            except KeyError:  # a state made for another model
                raise ValueError(self._other_state(state)) from None
        else:
            leaves = held
        out, changed = run(
            inner, leaves, args, kwargs, keys=same_key(key), inference=self.inference
        )
        if state is None:
            return out
        for i, value in changed.items():
            state = state.set(held[i], value)
        return out, state
