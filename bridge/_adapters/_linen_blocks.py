"""A Linen forward pass traced once per repeated block: the blocks of a stack are the
same computation.

`jax.make_jaxpr` of a Linen model runs Flax's module machinery and every `jnp`
function once per call: a 64-layer transformers Llama takes ~30 ms a layer to trace,
where the work that matters (what each operation does with the weights) is the same
in every layer. `repeated(record)` is a `nn.intercept_methods` interceptor that
calls a module's `__call__` the second time its computation repeats through one
`jax.jit` of it, and every later time through the same `jax.jit`: JAX traces the
block once and the program holds one `pjit` equation per block, each running the
same inner program on that block's own variables (which the port's trace reads
as it reads any `pjit`).

A computation repeats when the module's class, its settings (its dataclass fields,
by value, or by identity where a value cannot be hashed: one config object shared
by every layer), the shapes and dtypes of its variables and of its arguments, and
its arguments that are not arrays are all equal. A layer whose settings differ (a
`layer_idx` that changes its attention) is traced on its own, as before. Inside a
jitted call nothing is cached again (a block's own submodules are traced with it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax


_MISS = object()


class Repeated:
    """The interceptor's state for one forward pass (`repeated`): the calls seen
    (`{key: path of the first}`), the jitted ones (`{key: (jit, its path)}`), and
    the submodules each first traced block called, by path, for `Adapter.called`."""

    def __init__(self, seen: dict[tuple, Any]):
        self.seen = seen
        self.first: dict[Any, tuple] = {}
        self.jitted: dict[Any, tuple[Callable, tuple]] = {}
        self.inside: tuple | None = None  # the path of the block being traced

    def call(self, method: Callable, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        path = tuple(module.scope.path) if module.scope is not None else None
        if self.inside is not None:  # a submodule of a block jitted now
            if path is not None:  # its path is relative to the jitted clone
                self.seen.setdefault(self.inside + path, module)
            return method(*args, **kwargs)
        if path is not None:
            self.seen.setdefault(path, module)
        if context.method_name != "__call__" or path is None or not path:
            return method(*args, **kwargs)
        key = _key(module, args, kwargs)
        if key is None:
            return method(*args, **kwargs)
        if key not in self.first:
            self.first[key] = path
            return method(*args, **kwargs)
        found = self.jitted.get(key)
        if found is None:
            found = self.jitted[key] = (_jitted(module, args, kwargs), path)
            self.inside = path
            try:
                return _run(found[0], module, args, kwargs)
            finally:
                self.inside = None
        jitted, traced = found
        for sub, m in list(self.seen.items()):  # the same submodules, at this path
            if sub[: len(traced)] == traced and len(sub) > len(traced):
                self.seen.setdefault(path + sub[len(traced) :], m)
        return _run(jitted, module, args, kwargs)


def repeated(seen: dict[tuple, Any]) -> Callable[..., Any]:
    """An `nn.intercept_methods` interceptor recording every submodule called by
    path in `seen`, and tracing each repeated block once (see the module)."""
    return Repeated(seen).call


def same(module: nn.Module) -> Any:
    """What a bound module's `setup` declares depends on, hashable: its class, its
    settings and its variables' shapes (a call's key without the call); None where
    that cannot be told. Two blocks of a stack are the same."""
    return _key(module, (), {})


def _key(module: nn.Module, args: Any, kwargs: Any) -> Any:
    """What decides a call's computation, hashable; None where something cannot be
    told (an argument that is neither an array nor hashable)."""
    try:
        fields = tuple(
            (f.name, _value(getattr(module, f.name)))
            for f in dataclasses.fields(module)
            if f.name not in ("parent", "name")
        )
        variables = jax.tree.map(_aval, dict(module.variables))
        leaves, tree = jax.tree.flatten(variables)
        given, shape = jax.tree.flatten((args, kwargs))
        key = (
            type(module),
            fields,
            tree,
            tuple(leaves),
            shape,
            tuple(_aval(x) if _is_array(x) else x for x in given),
        )
        hash(key)
    except (TypeError, AttributeError, ValueError):  # unhashable, or unbound
        return None
    return key


def _value(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.core.Tracer) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)
    )


def _aval(x: Any) -> Any:
    return (tuple(x.shape), str(x.dtype)) if _is_array(x) else x


def _jitted(module: nn.Module, args: Any, kwargs: Any) -> Callable:
    """`jax.jit` of the module's `__call__` as a function of its variables and
    its array arguments (the others fixed: equal for every call of the key)."""
    unbound = module.clone(parent=None, _deep_clone=True)
    given, shape = jax.tree.flatten((args, kwargs))
    where = [i for i, x in enumerate(given) if _is_array(x)]

    def call(variables: Any, arrays: list[Any]) -> Any:
        xs = list(given)
        for i, x in zip(where, arrays):
            xs[i] = x
        a, kw = jax.tree.unflatten(shape, xs)
        return unbound.apply(variables, *a, **kw)

    return jax.jit(call)


def _run(jitted: Callable, module: nn.Module, args: Any, kwargs: Any) -> Any:
    given, _ = jax.tree.flatten((args, kwargs))
    return jitted(dict(module.variables), [x for x in given if _is_array(x)])
