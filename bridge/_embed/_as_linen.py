"""`as_linen`: an Equinox model or an NNX module as a `flax.linen.Module`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import flax.linen as nn

from .._adapters._keys import Keys
from .._adapters._registry import declared, records_no_module
from .._arguments import check_bool, check_name
from .._paths import Key, Path, path_str
from .._tree import Tree
from ._inner import Inner, inner_of, run


_NOT_MUTABLE = """\
The wrapped model at {where} wrote to collection(s) {collections} ({paths}), which
this call did not make mutable. Make them mutable, as for any Linen module:
    y, updates = model.apply(variables, x, mutable={collections})
or run the wrapped model in a mode that does not write them (the wrapper's
`inference=True`: NNX `.eval()`, Equinox `eqx.nn.inference_mode`). An NNX module's
RNG streams (collection 'rngs') are not written when `apply` gives streams of the
same names, `rngs={{"dropout": key}}`: they are reseeded from those for the call."""


class Initial:
    """The wrapped model's arrays at wrapping time: what `init` gives the variables.
    Compared by identity (two wrappers of equal structure keep their own values)."""

    __slots__ = ("leaves",)

    def __init__(self, leaves: list[Any]):
        self.leaves = leaves

    def __repr__(self) -> str:
        return f"Initial({len(self.leaves)} arrays)"


def as_linen(
    model: Any,
    *,
    stream: str = "dropout",
    inference: bool | None = None,
    name: str | None = None,
):
    """An Equinox model or a Flax NNX module as a `flax.linen.Module`.

    Inside a Linen model, the wrapper declares the wrapped model's arrays as Linen
    variables, one collection per role (`bridge.roles`: `params`, `batch_stats`, an
    NNX module's RNG state in `rngs`, an Equinox `State` entry in `state`), named by
    the model's top-level entries and nested like its `bridge.Tree`
    (`variables["params"]["wrapper"]["layers"][0]["kernel"]`). `init` gives them
    the wrapped model's current values (a pretrained component keeps its weights);
    the `init` key is not used for them.

    At each call the native model is rebuilt from the current variables (no copy)
    and run. The state it writes goes back with `put_variable`, so
    `apply(..., mutable=["batch_stats"])` returns it; writing to a collection that
    is not mutable raises an error that names it (during `init` the model's own
    values are kept, whatever the call writes).

    - Equinox: called as `wrapper(*args, **kwargs)`; a model with an
      `eqx.nn.State` gets its state from the `state` collection (or `batch_stats`
      for a `BatchNorm`) and is called `model(*args, state, **kwargs)`. A model that
      takes `key=` gets `self.make_rng(stream)` when `apply` has that stream.
      `inference` sets `eqx.nn.inference_mode`.
    - NNX: called as `module(*args, **kwargs)`. `inference=True`/`False` calls
      `.eval()`/`.train()` first. The module's RNG streams whose names `apply` was
      given (`rngs={"dropout": key}`) are reseeded from `make_rng` for the call, as
      `nnx.bridge.ToLinen` does; the others advance, and their state is written to the
      `rngs` collection (which must then be mutable).
    - `bridge.port`, `port_plan` and `compare` of the Linen model holding the wrapper
      read its layers in the wrapped model's framework when the model is given with
      its module, `(module, variables)`, and the wrapper is one of its fields or
      made in `setup` (Linen variables alone record no module classes).

    **Arguments:**

    - `model`: an Equinox model, `(model, state)` with its `eqx.nn.State`, an NNX
      module, or a `bridge.Tree` of one of them. It is not modified.
    - `stream`: the Linen random stream an Equinox model's `key=` is drawn from.
    - `inference`: None to leave the model's mode as it is; True/False as above. A
      Linen field: `wrapper.clone(inference=True)` for evaluation.
    - `name`: the Linen module name.

    **Returns:**

    A `flax.linen.Module` (a `LinenWrapper`).

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, bridge
    >>> from flax import nnx
    >>> linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> layer = bridge.as_linen(linear)
    >>> variables = layer.init(jax.random.key(1), jnp.ones(2))
    >>> bool((variables["params"]["kernel"] == linear.kernel[...]).all())
    True
    >>> bool((layer.apply(variables, jnp.ones(2)) == linear(jnp.ones(2))).all())
    True

    ```
    """
    check_name(stream, "stream")
    if inference is not None:
        check_bool(inference, "inference")
    if name is not None:
        check_name(name, "name")
    inner, leaves = inner_of(model, "as_linen", "linen")
    return LinenWrapper(inner, Initial(leaves), stream, inference, name=name)


class LinenWrapper(nn.Module):
    """A model of another framework inside Linen: made by `bridge.as_linen`."""

    inner: Inner
    initial: Initial
    stream: str = "dropout"
    inference: bool | None = None

    def _bridge_wrapped(self) -> tuple[Inner, Path]:
        """The wrapped model and where its arrays are under the wrapper: here."""
        return self.inner, ()

    @nn.compact
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.inner
        groups = _groups(inner)
        variables = {}
        for (role, top), members in groups.items():
            value = _nest([(rest, self.initial.leaves[i]) for i, rest in members])
            variables[role, top] = self.variable(role, str(top), lambda v=value: v)
        leaves: list[Any] = [None] * len(inner.paths)
        for (role, top), members in groups.items():
            value = variables[role, top].value
            for i, rest in members:
                leaves[i] = _get(value, rest)
        keys = Keys(self._one_key, self._stream_key, self._every_key)
        out, changed = run(
            inner, leaves, args, kwargs, keys=keys, inference=self.inference
        )
        if changed and not self.is_initializing():
            self._write(inner, groups, variables, leaves, changed)
        return out

    def _one_key(self) -> Any:
        # Linen's make_rng falls back to the "params" stream, as init has it
        if self.has_rng(self.stream) or self.has_rng("params"):
            return self.make_rng(self.stream)
        return None

    def _stream_key(self, tag: str) -> Any:
        return self.make_rng(tag) if self.has_rng(tag) else None

    def _every_key(self) -> dict[str, Any]:
        scope = self.scope
        assert scope is not None  # called inside apply, where the module is bound
        return {tag: self.make_rng(tag) for tag in scope.rngs}

    def _write(self, inner, groups, variables, leaves, changed) -> None:
        refused = sorted({inner.roles[i] for i in changed} - set(self._mutable()))
        if refused:
            assert self.scope is not None  # bound: called inside apply
            paths = ", ".join(
                path_str(inner.paths[i]) for i in changed if inner.roles[i] in refused
            )
            raise ValueError(
                _NOT_MUTABLE.format(
                    where="/".join(self.scope.path) or "(root)",
                    collections=refused,
                    paths=paths,
                )
            )
        for i, value in changed.items():
            leaves[i] = value
        touched = {(inner.roles[i], inner.paths[i][0]) for i in changed}
        for group in touched:
            members = groups[group]
            variables[group].value = _nest([(rest, leaves[i]) for i, rest in members])

    def _mutable(self) -> list[str]:
        roles = set(self.inner.roles)
        return [r for r in roles if self.is_mutable_collection(r)]


_GROUPS: dict[Inner, dict] = {}


def _groups(inner: Inner) -> dict[tuple[str, Key], list[tuple[int, Path]]]:
    """Leaves by Linen variable: `(collection, top-level name) -> [(leaf index,
    path below the name)]`."""
    groups = _GROUPS.get(inner)
    if groups is None:
        groups = {}
        for i, (path, role) in enumerate(zip(inner.paths, inner.roles)):
            groups.setdefault((role, path[0]), []).append((i, path[1:]))
        if len(_GROUPS) > 64:
            _GROUPS.clear()
        _GROUPS[inner] = groups
    return groups


def _nest(members: list[tuple[Path, Any]]) -> Any:
    """Nested dicts from `(path, leaf)` pairs; a single empty path: the leaf."""
    if len(members) == 1 and not members[0][0]:
        return members[0][1]
    out: dict[Key, Any] = {}
    for path, leaf in members:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def _get(value: Any, path: Path) -> Any:
    for key in path:
        value = value[key]
    return value


def linen_wrappers(tree: Tree) -> Iterator[tuple[Path, LinenWrapper]]:
    """The `as_linen` wrappers of a Linen model's Tree, with their paths: those its
    module declares as fields or in `setup` (the Linen adapter's `declared`; none
    without the module, or for another framework's Tree)."""
    yield from declared(tree, lambda module: isinstance(module, LinenWrapper))


_NO_MODULE = """\
pass the Linen model as `(module, variables)`: Linen variables record no module \
classes, and the wrapper in the module says which framework those arrays belong to."""

_COMPACT = """\
declare the wrapper as a field of its parent or in `setup`: a wrapper made inside a \
compact `__call__` exists only while the model runs, so it cannot be found."""


def hidden_wrappers(tree: Tree) -> str | None:
    """For a Linen model's Tree, how to let `linen_wrappers` find the wrappers it may
    hold (its arrays that are in no known layer may be theirs); None for another
    framework's Tree."""
    no_module = records_no_module(tree)
    if no_module is None:
        return None
    return _NO_MODULE if no_module else _COMPACT
