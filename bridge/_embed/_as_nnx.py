"""`as_nnx`: an Equinox model or a Linen module as an `nnx.Module`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import variablelib

from .._adapters._keys import Keys, same_key
from .._adapters._registry import require
from .._arguments import check_name
from .._paths import Path, path_str
from .._tree import Tree, items
from ._inner import Inner, inner_of, run


_OWN = ("deterministic", "rngs", "stream")

_COLLISION = """\
The wrapped model has a top-level entry named {names}, which NNXWrapper uses for itself
(`deterministic` for .eval()/.train(), `rngs`, `stream`). Wrap a model whose top level
uses other names (put it inside a container module)."""

_RNGS = """\
`rngs` must be an nnx.Rngs or a JAX key (`jax.random.key(0)`, or a raw
`jax.random.PRNGKey(0)`: uint32 of shape (2,)), got {kind}."""


def _key(rngs: Any) -> bool:
    """Whether `rngs` is one JAX key: a typed key of shape `()`, or a raw uint32
    key of shape `(2,)` (`jax.random.PRNGKey`)."""
    if not isinstance(rngs, jax.Array):
        return False
    if jax.dtypes.issubdtype(rngs.dtype, jax.dtypes.prng_key):
        return rngs.shape == ()
    return rngs.dtype == jnp.uint32 and rngs.shape == (2,)


def _kind(rngs: Any) -> str:
    if isinstance(rngs, jax.Array):
        return f"an array of {rngs.dtype} and shape {rngs.shape}"
    return f"a {type(rngs).__name__}"


def as_nnx(
    model: Any, *, rngs: nnx.Rngs | jax.Array | None = None, stream: str = "dropout"
):
    """An Equinox model or a Flax Linen module as an `nnx.Module`.

    The wrapper holds the wrapped model's arrays as NNX Variables, in nested
    `nnx.Dict`/`nnx.List` attributes that mirror the model's `bridge.Tree`
    (`wrapper.layers[0].weight`, `wrapper.Dense_0.kernel`). The Variable type follows
    the leaf's role (`bridge.roles`) by flax's own mapping: `params` -> `nnx.Param`,
    `batch_stats` -> `nnx.BatchStat`, `cache` -> `nnx.Cache`, other Linen collections
    and Equinox `State` entries (role `state`) the type flax registers for that
    collection name. So `nnx.split`, `nnx.state`, `nnx.Optimizer(wrt=nnx.Param)`,
    `nnx.jit` and `nnx.grad` see them like any NNX model's.

    Calling the wrapper rebuilds the native model from the current arrays (no
    copy) and runs it; the state it writes (Linen `batch_stats`, Equinox `State`) is
    assigned to the Variables after the call.

    - Equinox with an `eqx.nn.State`: called as `wrapper(*args, **kwargs)`; the
      wrapper passes the state (`model(*args, state, **kwargs)`) and keeps the new
      one. `wrapper.eval()` / `.train()` set `eqx.nn.inference_mode` for the call
      (they set `wrapper.deterministic`; None, the default, leaves the model as
      it is). An Equinox model that takes `key=` gets one drawn from the wrapper's
      `rngs` stream `stream`, when the wrapper has `rngs` (or the call gives
      `rngs=`); a `key=` given to the call is passed as it is.
    - Linen: `wrapper(*args, **kwargs)` is `module.apply(variables, *args,
      **kwargs, rngs=...)` with every collection but `params` mutable; the random
      streams are drawn from `rngs` (the wrapper's, or the call's `rngs=`), one key
      per stream of the `nnx.Rngs` (`default` feeds Linen's `params` stream), as
      `nnx.bridge.ToNNX` does.

    **Arguments:**

    - `model`: an Equinox model, `(model, state)` with its `eqx.nn.State`, a Linen
      `(module, variables)` or a bound module (`module.bind(variables)`), or a
      `bridge.Tree` of one of them. It is not modified; the wrapper starts from its
      current arrays (shared, not copied).
    - `rngs`: optional `nnx.Rngs` the wrapper draws keys from at each call (kept as
      the wrapper's `rngs` attribute, its counters are NNX state), or a JAX key
      (`jax.random.key(0)`, or a raw `jax.random.PRNGKey(0)`), which becomes
      `nnx.Rngs(key)`: its `default` stream, which every stream falls back to.
    - `stream`: the stream of `rngs` an Equinox model's `key=` is drawn from.

    **Returns:**

    An `nnx.Module` (an `NNXWrapper`).

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, equinox as eqx, bridge
    >>> from flax import nnx
    >>> mlp = eqx.nn.MLP(2, 3, width_size=4, depth=1, key=jax.random.key(0))
    >>> layer = bridge.as_nnx(mlp)
    >>> layer.layers[0].weight.shape
    (4, 2)
    >>> bool((layer(jnp.ones(2)) == mlp(jnp.ones(2))).all())
    True
    >>> len(jax.tree.leaves(nnx.state(layer, nnx.Param)))
    4

    ```
    """
    check_name(stream, "stream")
    inner, leaves = inner_of(model, "as_nnx", "nnx")
    require("nnx")  # the wrapper is an NNX module: flax new enough for it
    return NNXWrapper(inner, leaves, rngs=rngs, stream=stream)


class NNXWrapper(nnx.Module):
    """A model of another framework inside NNX: made by `bridge.as_nnx`."""

    def __init__(
        self,
        inner: Inner,
        leaves: list[Any],
        *,
        rngs: nnx.Rngs | jax.Array | None = None,
        stream: str = "dropout",
    ):
        if isinstance(rngs, jax.Array) and _key(rngs):
            rngs = nnx.Rngs(rngs)
        if rngs is not None and not isinstance(rngs, nnx.Rngs):
            raise TypeError(_RNGS.format(kind=_kind(rngs)))
        tree = inner.tree(leaves)
        top = [str(k) for k, _ in items(tree)]
        taken = [k for k in top if k in _OWN or k.startswith("_")]
        if taken:
            raise ValueError(_COLLISION.format(names=", ".join(map(repr, taken))))
        self._bridge_inner = inner
        self.deterministic: bool | None = None
        self.stream = stream
        self.rngs = rngs
        roles = dict(zip(inner.paths, inner.roles))
        for key, child in items(tree):
            setattr(self, str(key), _node(child, (key,), roles))

    def _bridge_wrapped(self) -> tuple[Inner, Path]:
        """The wrapped model and where its arrays are under the wrapper: here."""
        return self._bridge_inner, ()

    def __call__(self, *args: Any, rngs: Any = None, **kwargs: Any) -> Any:
        """Run the wrapped model: `wrapper(*args, **kwargs)`, its output.

        `rngs` (an `nnx.Rngs` or a key), when given, is used for this call instead
        of the wrapper's own."""
        inner = self._bridge_inner
        variables = [_at(self, path) for path in inner.paths]
        leaves = [v.get_value() for v in variables]
        keys = _keys(self.rngs if rngs is None else rngs, self.stream)
        out, changed = run(
            inner, leaves, args, kwargs, keys=keys, inference=self.deterministic
        )
        for i, value in changed.items():
            variables[i].set_value(value)
        return out


def _keys(rngs: Any, stream: str) -> Keys:
    """The keys of an `nnx.Rngs` (or of one key), drawn when used: `one` from the
    stream `stream`; `every` one key per stream, as `nnx.bridge.ToNNX` draws them
    (`default` feeds Linen's `params` stream)."""
    if rngs is None:
        return Keys()
    if _key(rngs):
        return same_key(rngs)
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(_RNGS.format(kind=_kind(rngs)))

    def named(tag: str) -> Any:
        return rngs[tag]() if tag in rngs or "default" in rngs else None

    def every() -> dict[str, Any]:
        keys = {name: s() for name, s in rngs.items()}
        if "params" not in keys and "default" in keys:
            keys["params"] = keys.pop("default")
        return keys

    return Keys(lambda: getattr(rngs, stream)(), named, every)


def _variable_type(role: str) -> type:
    """flax's own mapping of a collection name to a Variable type."""
    return variablelib.variable_type_from_name(role, allow_register=True)


def _node(child: Any, path: Path, roles: dict[Path, str]) -> Any:
    if not isinstance(child, Tree):
        return _variable_type(roles[path])(child)
    pairs = items(child)
    if child._info.keys is None:  # a sequence
        return nnx.List([_node(c, path + (k,), roles) for k, c in pairs])
    return nnx.Dict({str(k): _node(c, path + (k,), roles) for k, c in pairs})


def _at(module: nnx.Module, path: Path) -> nnx.Variable:
    node: Any = module
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, str(key))
    if not isinstance(node, nnx.Variable):
        raise TypeError(f"{path_str(path)} is not a Variable of the wrapper.")
    return node
