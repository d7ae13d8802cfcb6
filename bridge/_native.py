"""`to_neutral` and `to_native`: the adapters, chosen by what they are given."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import flax.linen as nn
from flax import nnx

from ._equinox import from_equinox, to_equinox
from ._linen import bind, from_linen
from ._nnx import from_nnx, to_nnx
from ._tree import Tree, source_of


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


def to_native(tree: Tree) -> Any:
    """Turn a `bridge.Tree` back into the native model it came from.

    **Arguments:**

    - `tree`: a whole-model `bridge.Tree` made by an adapter.

    **Returns:**

    - from NNX: a new `nnx.Module` (as `bridge.to_nnx`);
    - from Equinox: the model, or `(model, state)` (as `bridge.to_equinox`);
    - from Linen with a module: the module bound to the variables, callable as
      `native(x)`; collections other than `params` are mutable, and
      `native.variables` reads them after a forward pass. Without a module: the
      variables dict (as `bridge.to_linen`).
    """
    framework = source_of(tree).framework
    if framework == "nnx":
        return to_nnx(tree)
    if framework == "equinox":
        return to_equinox(tree)
    return bind(tree)
