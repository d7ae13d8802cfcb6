"""The wrapped model of a wrapper: its structure (static data the wrapper keeps) and
one forward pass on the wrapper's current arrays, which returns the new values of the
state leaves that the pass wrote (batch statistics, Equinox `State`, RNG counters).

A wrapper of each framework (`_as_nnx.py`, `_as_linen.py`, `_as_equinox.py`) holds
the leaves of the wrapped model's `bridge.Tree` in its own containers; at call time
it gives them back here in Tree order. The Tree is rebuilt from them (no copy) and
turned into the native model with `bridge.to_native`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax.tree_util as jtu
from flax import nnx

from .._adapters._equinox import from_equinox
from .._adapters._linen import from_linen, linen_module
from .._adapters._native import to_native, to_neutral
from .._adapters._nnx import from_nnx
from .._paths import Path, path_of
from .._tree import Tree, framework, leaf_roles


_NAMES = {"linen": "Flax Linen", "nnx": "Flax NNX", "equinox": "Equinox"}

_NOT_A_MODEL = """\
bridge.{wrapper} wraps a model of another framework, but got a {kind}. Give it one of:
an Equinox model, or `(model, state)` with its eqx.nn.State; a Flax Linen module with
its variables, `(module, variables)` or `module.bind(variables)`; a Flax NNX module;
or a bridge.Tree made from one of them."""

_LINEN_UNBOUND = """\
bridge.{wrapper} got a Flax Linen module without variables: a Linen module holds no
weights of its own. Initialise it first and pass both:
    variables = module.init(jax.random.key(0), example_input)
    bridge.{wrapper}((module, variables))"""

_LINEN_NO_MODULE = """\
bridge.{wrapper} got Linen variables without their module, so it has nothing to run.
Pass the module too: bridge.{wrapper}((module, variables))."""

_SAME_FRAMEWORK = """\
bridge.{wrapper} got a {name} model, which is already a model of that framework: use
it directly as a submodule."""

_STATE_FORM = """\
The wrapped Equinox model has an eqx.nn.State, so it is called as
`model(*args, state, **kwargs)` and must return `(output, new_state)`, but it returned
{got}."""


@dataclass(frozen=True, eq=False)
class Inner:
    """The static description of a wrapped model, equal for equal structures.

    `treedef` rebuilds its `bridge.Tree` from the leaves; `paths` and `roles` are
    each leaf's path in that Tree and its role, in Tree order."""

    treedef: Any
    paths: tuple[Path, ...]
    roles: tuple[str, ...]
    framework: str
    takes_key: bool
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
    if kind == outer:
        raise TypeError(_SAME_FRAMEWORK.format(wrapper=wrapper, name=_NAMES[kind]))
    if kind == "linen" and linen_module(tree) is None:
        raise TypeError(_LINEN_NO_MODULE.format(wrapper=wrapper))
    flat, treedef = jtu.tree_flatten_with_path(tree)
    takes_key = False
    if kind == "equinox":
        native = to_native(tree)
        takes_key = _takes_key(native[0] if isinstance(native, tuple) else native)
    inner = Inner(
        treedef,
        tuple(path_of(p) for p, _ in flat),
        tuple(str(r) for r in leaf_roles(tree)),
        kind,
        takes_key,
    )
    return inner, [leaf for _, leaf in flat]


def _tree_of(model: Any, wrapper: str) -> Tree:
    if isinstance(model, nn.Module) and model.scope is None:
        raise TypeError(_LINEN_UNBOUND.format(wrapper=wrapper))
    if isinstance(model, Mapping) and not isinstance(model, Tree):
        raise TypeError(_LINEN_NO_MODULE.format(wrapper=wrapper))
    known = (Tree, nnx.Module, eqx.Module, nn.Module)
    pair = isinstance(model, tuple) and len(model) == 2
    if not (isinstance(model, known) or pair):
        raise TypeError(_NOT_A_MODEL.format(wrapper=wrapper, kind=_kind(model)))
    try:
        return to_neutral(model)
    except TypeError as error:
        raise TypeError(
            _NOT_A_MODEL.format(wrapper=wrapper, kind=_kind(model))
        ) from error


def _kind(obj: Any) -> str:
    if isinstance(obj, tuple):
        return "tuple of " + ", ".join(type(x).__name__ for x in obj)
    return type(obj).__name__


_TAKES_KEY: dict[type, bool] = {}


def _takes_key(model: Any) -> bool:
    """Whether an Equinox model's `__call__` has a `key` argument."""
    cls = type(model)
    known = _TAKES_KEY.get(cls)
    if known is None:
        try:
            parameters = inspect.signature(cls.__call__).parameters.values()
        except (TypeError, ValueError):
            parameters = ()
        known = _TAKES_KEY[cls] = any(
            p.name == "key" or p.kind is inspect.Parameter.VAR_KEYWORD
            for p in parameters
        )
    return known


Streams = Callable[[str], Any]
"""`tag -> key or None`: the key that reseeds an NNX model's RNG stream `tag` for one
call (None: the model's own stream state is used and advances)."""


def run(
    inner: Inner,
    leaves: list[Any],
    args: tuple,
    kwargs: dict[str, Any],
    *,
    linen_rngs: Any = None,
    key: Any = None,
    streams: Streams | None = None,
    inference: bool | None = None,
) -> tuple[Any, dict[int, Any]]:
    """Run the wrapped model once on `leaves`: `(output, {leaf index: new value})`
    for the state leaves the pass wrote.

    - Linen: bound to the leaves with `linen_rngs` (as `module.apply(rngs=...)`),
      every collection other than `params` mutable.
    - NNX: `inference` True/False calls `.eval()`/`.train()` first; RNG streams for
      which `streams(tag)` gives a key are reseeded for this call (`nnx.reseed`), and
      their state is then not written back.
    - Equinox: `key` is passed as `key=` when the model takes one (and the caller
      did not); `inference` sets `eqx.nn.inference_mode`; with a `State`, the model is
      called as `model(*args, state, **kwargs) -> (output, state)`.
    """
    tree = inner.tree(leaves)
    skip = ()
    if inner.framework == "linen":
        bound = to_native(tree, rngs=linen_rngs)
        out = bound(*args, **kwargs)
        after = from_linen(bound.variables, linen_module(tree))
    elif inner.framework == "nnx":
        model = to_native(tree)
        if inference is not None:
            model.eval() if inference else model.train()
        if streams is not None and _reseed(model, streams):
            skip = ("rngs",)
        out = model(*args, **kwargs)
        after = from_nnx(model)
    else:
        native = to_native(tree)
        model, state = native if isinstance(native, tuple) else (native, None)
        if inference is not None:
            model = eqx.nn.inference_mode(model, inference)
        if key is not None and inner.takes_key and "key" not in kwargs:
            kwargs = {**kwargs, "key": key}
        if state is None:
            return model(*args, **kwargs), {}
        result = model(*args, state, **kwargs)
        if not (
            isinstance(result, tuple)
            and len(result) == 2
            and isinstance(result[1], eqx.nn.State)
        ):
            raise TypeError(_STATE_FORM.format(got=_kind(result)))
        out, after = result[0], from_equinox(model, result[1])
    new = {path_of(p): leaf for p, leaf in jtu.tree_flatten_with_path(after)[0]}
    changed = {}
    for i, (path, role) in enumerate(zip(inner.paths, inner.roles)):
        if role == "params" or role in skip:
            continue
        value = new.get(path)
        if value is not None and value is not leaves[i]:
            changed[i] = value
    return out, changed


def _reseed(model: nnx.Module, streams: Streams) -> bool:
    """Reseed the model's RNG streams that `streams` has a key for."""
    tags = {
        node.key.tag
        for _, node in nnx.iter_graph(model)
        if isinstance(node, nnx.RngStream)
    }
    keys = {tag: k for tag in sorted(tags) if (k := streams(tag)) is not None}
    if keys:
        nnx.reseed(model, **keys)
    return bool(keys)
