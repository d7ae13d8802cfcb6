"""The wrapped model of a wrapper: its structure (static data the wrapper keeps) and
one forward pass on the wrapper's current arrays, which returns the new values of the
state leaves that the pass wrote (batch statistics, Equinox `State`, RNG counters).

A wrapper of each framework (`_as_nnx.py`, `_as_linen.py`, `_as_equinox.py`) holds
the leaves of the wrapped model's `bridge.Tree` in its own containers; at call time
it gives them back here in Tree order. The Tree is rebuilt from them (no copy) and
run by the wrapped framework's adapter (`Adapter.embed`): nothing here depends on
which framework it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax.tree_util as jtu

from .._adapters._keys import Keys
from .._adapters._native import to_neutral
from .._adapters._registry import adapter_for, adapter_named
from .._paths import Path, path_of
from .._tree import Tree, framework, leaf_roles


_NOT_A_MODEL = """\
bridge.{wrapper} wraps `model`, a model of another framework, but got a {kind}. Give
it one of: an Equinox model, or `(model, state)` with its eqx.nn.State; a Flax Linen
module with its variables, `(module, variables)` or `module.bind(variables)`; a Flax
NNX module; or a bridge.Tree made from one of them."""

_CANNOT_TAKE = """\
bridge.{wrapper} cannot take this {name} model: {error}"""

_NOTHING_TO_RUN = """\
bridge.{wrapper} got {name} arrays without a model to run them (for Flax Linen:
variables without their module). Pass the model too: for Linen,
bridge.{wrapper}((module, variables)) or bridge.{wrapper}(module.bind(variables))."""

_SAME_FRAMEWORK = """\
bridge.{wrapper} got a {name} model, which is already a model of that framework: use
it directly as a submodule."""

_NOT_EMBEDDABLE = """\
bridge.{wrapper} cannot run a {name} model inside another framework (its adapter has
no `embed`). Port it into a model of a framework that can be wrapped,
`model = bridge.port(source, model)`, and wrap that model."""

_FAILED_ON_SHAPES = """\
The wrapped {name} model failed on arguments of shapes {shapes}. {hint}"""


@dataclass(frozen=True, eq=False)
class Inner:
    """The static description of a wrapped model, equal for equal structures.

    `treedef` rebuilds its `bridge.Tree` from the leaves; `paths` and `roles` are
    each leaf's path in that Tree and its role, in Tree order; `framework` names its
    adapter."""

    treedef: Any
    paths: tuple[Path, ...]
    roles: tuple[str, ...]
    framework: str
    _hash: int = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(self.treedef))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (
            type(other) is Inner
            and self._hash == other._hash
            and self.treedef == other.treedef
        )

    @property
    def stateful(self) -> bool:
        """Whether the model has leaves other than `params` (state a call may
        write)."""
        return any(r != "params" for r in self.roles)

    def tree(self, leaves: list[Any]) -> Tree:
        return jtu.tree_unflatten(self.treedef, leaves)


def inner_of(model: Any, wrapper: str, outer: str) -> tuple[Inner, list[Any]]:
    """The static description and the leaves (Tree order) of a model to wrap.

    `wrapper` names the public function (for messages), `outer` the wrapper's own
    framework (wrapping a model of that framework is refused)."""
    tree = _tree_of(model, wrapper)
    kind = framework(tree)
    if kind is None:
        raise TypeError(_NOT_A_MODEL.format(wrapper=wrapper, kind="part of a Tree"))
    adapter = adapter_named(kind)
    if kind == outer:
        raise TypeError(_SAME_FRAMEWORK.format(wrapper=wrapper, name=adapter.display))
    if adapter.embed is None:
        raise TypeError(_NOT_EMBEDDABLE.format(wrapper=wrapper, name=adapter.display))
    native = adapter.to_native(tree)
    if not _runnable(native[0] if isinstance(native, tuple) else native):
        raise TypeError(_NOTHING_TO_RUN.format(wrapper=wrapper, name=adapter.display))
    flat, treedef = jtu.tree_flatten_with_path(tree)
    inner = Inner(
        treedef,
        tuple(path_of(p) for p, _ in flat),
        tuple(str(r) for r in leaf_roles(tree)),
        kind,
    )
    return inner, [leaf for _, leaf in flat]


def _runnable(model: Any) -> bool:
    """A model to call, or one run through its `apply` (Haiku's `hk.Transformed`,
    a tuple of `init` and `apply`)."""
    return callable(model) or callable(getattr(model, "apply", None))


def _tree_of(model: Any, wrapper: str) -> Tree:
    if isinstance(model, Tree):
        return model
    adapter = adapter_for(model)
    if adapter is None:
        raise TypeError(_NOT_A_MODEL.format(wrapper=wrapper, kind=_kind(model)))
    try:
        return to_neutral(model)
    except TypeError as error:
        raise TypeError(
            _CANNOT_TAKE.format(wrapper=wrapper, name=adapter.display, error=error)
        ) from error


def _kind(obj: Any) -> str:
    if isinstance(obj, tuple):
        return "tuple of " + ", ".join(type(x).__name__ for x in obj)
    return type(obj).__name__


def run(
    inner: Inner,
    leaves: list[Any],
    args: tuple,
    kwargs: dict[str, Any],
    *,
    keys: Keys = Keys(),
    inference: bool | None = None,
) -> tuple[Any, dict[int, Any]]:
    """Run the wrapped model once on `leaves` (`Adapter.embed`): `(output, {leaf
    index: new value})` for the state leaves the pass wrote. `keys` are the caller's
    random keys, `inference` the mode (None: the model's own)."""
    adapter = adapter_named(inner.framework)
    assert adapter.embed is not None  # checked by inner_of
    try:
        out, after, kept = adapter.embed(
            inner.tree(leaves), args, kwargs, keys, inference
        )
    except (TypeError, ValueError) as error:
        if not adapter.shape_hint or "shape" not in str(error).lower():
            raise
        shapes = [getattr(x, "shape", type(x).__name__) for x in args]
        error.add_note(
            _FAILED_ON_SHAPES.format(
                name=adapter.display, shapes=shapes, hint=adapter.shape_hint
            )
        )
        raise
    if after is None:
        return out, {}
    new = {path_of(p): leaf for p, leaf in jtu.tree_flatten_with_path(after)[0]}
    changed = {}
    for i, (path, role) in enumerate(zip(inner.paths, inner.roles)):
        if role == "params" or role in kept:
            continue
        value = new.get(path)
        if value is not None and value is not leaves[i]:
            changed[i] = value
    return out, changed
