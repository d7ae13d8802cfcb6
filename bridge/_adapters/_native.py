"""`to_neutral` and `to_native`: the adapters, chosen by what they are given."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import flax.linen as nn
from flax import nnx

from .._tree import Tree, source_of
from ._equinox import from_equinox, to_equinox
from ._linen import bind, from_linen
from ._nnx import from_nnx, to_nnx


def to_neutral(obj: Any) -> Tree:
    """Convert a model of any framework to a `bridge.Tree`.

    **Arguments:**

    - `obj`: one of
        - a `bridge.Tree` (returned as it is);
        - an `nnx.Module` (as `bridge.from_nnx`);
        - an Equinox model, or a tuple `(model, state)` with an `eqx.nn.State`
          (as `bridge.from_equinox`);
        - a Linen variables dict (as `bridge.from_linen`), a tuple
          `(module, variables)`, or a bound Linen module (`module.bind(variables)`).

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
    if isinstance(obj, nnx.Module):
        return from_nnx(obj)
    if isinstance(obj, eqx.Module):
        return from_equinox(obj)
    if isinstance(obj, nn.Module):
        if obj.scope is None:
            raise TypeError(
                "An unbound Linen module holds no weights: pass its variables too, "
                "as bridge.to_neutral((module, variables)) or "
                "bridge.from_linen(variables, module)."
            )
        return from_linen(obj.variables, obj)
    if isinstance(obj, tuple) and len(obj) == 2:
        first, second = obj
        if isinstance(first, eqx.Module) and isinstance(second, eqx.nn.State):
            return from_equinox(first, second)
        if isinstance(first, nn.Module) and isinstance(second, Mapping):
            return from_linen(second, first)
    if isinstance(obj, Mapping):
        return from_linen(obj)
    raise TypeError(
        f"bridge.to_neutral does not know how to convert a {type(obj).__name__}: "
        "expected an nnx.Module, an Equinox model or (model, state), Linen variables "
        "or (module, variables), or a bridge.Tree."
    )


_RNGS_NOT_LINEN = """\
`rngs` is for Flax Linen models, which take their random streams when they are bound
(`module.apply(..., rngs=...)`), but this Tree came from a {framework} model. {fix}"""

_FRAMEWORK_NAMES = {
    "nnx": "Flax NNX",
    "equinox": "Equinox",
}
_RNGS_HOW = {
    "nnx": "An NNX model carries its RNG state (nnx.Rngs) in the model, and "
    "bridge.make_step carries it from step to step: drop `rngs`.",
    "equinox": "Equinox layers take a `key=` argument: pass the key as a batch "
    "argument, `step(tree, opt_state, x, y, key)`, and give it to the model in "
    "loss_fn.",
}


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
    framework = source_of(tree).framework
    if rngs is not None and framework != "linen":
        raise ValueError(
            _RNGS_NOT_LINEN.format(
                framework=_FRAMEWORK_NAMES[framework], fix=_RNGS_HOW[framework]
            )
        )
    if framework == "nnx":
        return to_nnx(tree)
    if framework == "equinox":
        return to_equinox(tree)
    return bind(tree, rngs)
