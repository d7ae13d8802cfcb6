"""Adapter: Flax Linen variable collections <-> `bridge.Tree` (the walk that reads
the variables into a Tree: `_linen_walk.py`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from flax.errors import InvalidRngError
from flax.training import train_state

from .._arguments import is_array, type_error
from .._kept._array import is_quantized
from .._paths import (
    Key,
    Path,
)
from .._tree import (
    Tree,
    _keys,
    items,
    leaf_roles,
)
from ._build import (
    build,
    checked_leaves,
    native_leaves,
    source_of,
)
from ._linen_blocks import repeated, same
from ._linen_walk import (
    _ALIKE,
    _KNOWN,
    _MAPPING,
    LinenRecord,
    _general,
    _known_key,
    _node_kind,
    _walk,
)
from ._registry import Adapter, Optimizer, register_adapter


if TYPE_CHECKING:
    from ._keys import Keys


def from_linen(variables: Mapping[str, Any], module: nn.Module | None = None) -> Tree:
    """Convert Flax Linen variables to a `bridge.Tree`, without copying any array.

    The collections (`params`, `batch_stats`, `cache`, ...) are merged by module, so
    a CNN's Tree reads `t.Conv_0.kernel`, `t.BatchNorm_0.scale`, `t.BatchNorm_0.mean`;
    each leaf's role is its collection. Modules come in natural key order (`Dense_2`
    before `Dense_10`), so the variables have the same Tree structure before and after
    an optax step (which sorts the dicts); the dicts' own order is recorded for
    `bridge.to_linen`. Boxed parameters (`nn.Partitioned`,
    `nn.LogicallyPartitioned`) become their array, the box metadata is kept; `dict`
    and `FrozenDict` containers are remembered, so `bridge.to_linen` gives back the
    very same structure.

    **Arguments:**

    - `variables`: what `module.init` returns: a mapping of collection name to nested
      mappings of arrays. It is not modified.
    - `module`: optional, the `nn.Module` the variables belong to. With it,
      `bridge.to_native` gives the module bound to the variables (callable as
      `native(x)`), and `bridge.make_step` can run it.

    **Returns:**

    A `bridge.Tree`.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, flax.linen as nn, bridge
    >>> model = nn.Dense(3)
    >>> t = bridge.from_linen(model.init(jax.random.key(0), jnp.ones((1, 2))), model)
    >>> t.kernel.shape, bridge.roles(t).kernel
    ((2, 3), 'params')

    ```
    """
    if not isinstance(variables, Mapping):
        raise TypeError(
            "bridge.from_linen expects `variables`, the dict `module.init` returns "
            f"(collection -> nested mapping of arrays), got {type(variables).__name__}."
            " For an NNX module use bridge.from_nnx, for Equinox bridge.from_equinox."
        )
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(
            f"`module` must be a flax.linen Module, got {type(module).__name__}."
        )
    if module is not None and module.scope is not None:
        module = module.clone(parent=None)  # a bound module: keep its definition
    # JAX's leaves (a weight kept quantized, a pytree, is one leaf of the Tree: then
    # the variables are flattened again below, with an `is_leaf` call per node)
    leaves, treedef = jtu.tree_flatten(variables)
    # the same structure as a recent call (JAX's treedef ignores dict order, so the key
    # orders and leaf types are part of the key): rebuild the Tree from its treedef
    types = tuple(map(type, leaves))
    known = _known_key(variables, treedef, types, module)
    hit = _KNOWN.get(known)
    if hit is not None:
        tree_def, order = hit
        return jtu.tree_unflatten(tree_def, [leaves[i] for i in order])
    tree = _walk(variables, module, leaves, treedef, types)
    if tree is None:  # content the one walk leaves to the general path
        whole, whole_def = jtu.tree_flatten(variables, is_leaf=is_quantized)
        if whole_def != treedef:  # the Tree's leaves are not JAX's: not cached
            known = None
        tree = _general(variables, module, whole, whole_def)
    src = tree._info.source
    assert src is not None
    _KNOWN.put(known, (src._treedef, src.order))
    return tree


def to_linen(tree: Tree) -> dict[str, Any]:
    """Rebuild the Linen variables of a `bridge.Tree` made by `bridge.from_linen`.

    **Arguments:**

    - `tree`: a `bridge.Tree` from `bridge.from_linen`, with the same leaf paths.

    **Returns:**

    The variables, in the container types given to `from_linen` (`dict` stays
    `dict`, `FrozenDict` stays `FrozenDict`), boxes and their metadata restored.
    """
    record = source_of(tree, "linen", LinenRecord).record
    orders = record.orders.value
    if record.plain is not None:  # the Tree's dicts, in their recorded order
        checked_leaves(tree, "linen")
        return {record.plain: _dicts(tree, (record.plain,), orders)}
    _, leaves = native_leaves(tree, "linen", LinenRecord)
    variables = jtu.tree_unflatten(record.treedef, leaves)
    if orders:  # JAX rebuilds dicts in sorted key order: restore the order
        variables = _reorder(variables, (), orders)
    return variables


def _dicts(node: Tree, path: Path, orders: dict[Path, tuple]) -> dict[Key, Any]:
    """The nested dicts of a Tree, each in its order in `orders` (keyed by
    `(collection, *path)`) if there, else in the Tree's."""
    layers = _alike_dicts(node, path, orders)
    out: dict[Key, Any]
    if layers is not None:
        out = dict(zip(_keys(node), layers))
    else:
        out = {
            k: _dicts(c, path + (k,), orders) if type(c) is Tree else c
            for k, c in items(node)
        }
    keys = orders.get(path)
    return out if keys is None else {k: out[k] for k in keys}


def _alike_dicts(node: Tree, path: Path, orders: dict[Path, tuple]) -> list | None:
    """The dicts of a node's children when they are alike layers (`Dense_0` ...
    `Dense_49999`: Trees of one static record, of leaves only, all in the Tree's
    order or all in one recorded order), made in C-level passes; else None."""
    children = node._children
    keys = node._info.keys
    if len(children) < _ALIKE or keys is None:
        return None
    if set(map(type, children)) != {Tree}:
        return None
    infos = set(map(_INFO, children))
    if len(infos) != 1:
        return None
    (info,) = infos
    names = info.keys
    if names is None or len(names) < 2 or None in info.roles:
        return None
    wanted = set(map(orders.get, map(path.__add__, zip(keys))))
    if len(wanted) != 1:
        return None
    (listed,) = wanted
    rows = map(_CHILDREN, children)
    if listed is None:
        listed = names
    elif len(listed) != len(names) or set(listed) != set(names):
        return None
    else:  # each layer's children in the recorded order
        rows = map(itemgetter(*map(names.index, listed)), rows)
    return list(map(dict, map(zip, repeat(listed), rows)))


_INFO = attrgetter("_info")
_CHILDREN = attrgetter("_children")


def _reorder(node: Any, path: Path, orders: dict[Path, tuple]) -> Any:
    """`node` (a mapping at `path`) with every mapping in `orders` in that order."""
    children = {
        key: _reorder(child, path + (key,), orders)
        if _node_kind(type(child)) == _MAPPING
        else child
        for key, child in node.items()
    }
    keys = orders.get(path)
    if keys is not None:
        children = {key: children[key] for key in keys}
    if type(node) is dict:
        return children
    return type(node)(children)  # FrozenDict


def linen_module(tree: Tree) -> nn.Module | None:
    """The Linen module given to `bridge.from_linen`, if any."""
    src = tree._info.source
    return None if src is None else src.record.module.value


_RNGS_WITHOUT_MODULE = """\
`rngs` was given, but this Linen Tree was made without its module, so there is no
module to bind them to. Make the Tree with bridge.from_linen(variables, module), or
call module.apply(variables, ..., rngs=...) yourself on bridge.to_linen(tree)."""


def bind(tree: Tree, rngs: Any = None) -> Any:
    """The Linen module bound to the Tree's variables; non-`params` collections are
    mutable, so a forward pass that updates batch statistics works, and
    `bound.variables` reads the updated values. `rngs` as for `module.apply`: a
    dict `{stream: key}`, or one key for the `"params"` stream (which Linen's
    `make_rng` falls back to). Without a module: the variables."""
    variables = to_linen(tree)
    module = linen_module(tree)
    if module is None:
        if rngs is not None:
            raise ValueError(_RNGS_WITHOUT_MODULE)
        return variables
    if rngs is not None:
        rngs = dict(rngs) if isinstance(rngs, Mapping) else {"params": rngs}
        for key in rngs.values():
            if not is_array(key):
                raise type_error("rngs", "a dict {stream: JAX key} or one JAX key", key)
    mutable = [c for c in variables if c != "params"]
    return module.bind(variables, rngs=rngs, mutable=mutable)


# --- the adapter record -------------------------------------------------------------


_UNBOUND = """\
An unbound Linen module holds no weights (a Linen module without variables).
Initialise it first and pass both:
    variables = module.init(jax.random.key(0), example_input)
    (module, variables)    # or module.bind(variables)"""

_NEEDS_RNGS = """\
{error}
This Linen model draws random numbers (`make_rng`, as `nn.Dropout` does when not
deterministic) from a stream the step was not given. Give the step its streams, as to
`module.apply`: `step(tree, opt_state, *batch, rngs={{"dropout": key}})`, with a new
key each step (e.g. `jax.random.fold_in(key, i)`); a new key does not retrace."""

_NO_MODULE = """\
Linen variables alone cannot be called: pass `(module, variables)`, a bound module, or a
Tree made with `bridge.from_linen(variables, module)`."""


def _is_pair(obj: Any) -> bool:
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and isinstance(obj[0], nn.Module)
        and isinstance(obj[1], Mapping)
    )


def _recognise(obj: Any) -> bool:
    return isinstance(obj, (nn.Module, Mapping)) or _is_pair(obj)


def _to_tree(obj: Any) -> Tree:
    if isinstance(obj, nn.Module):
        if obj.scope is None:
            raise TypeError(_UNBOUND)
        return from_linen(obj.variables, obj)
    if isinstance(obj, tuple):
        return from_linen(obj[1], obj[0])
    return from_linen(obj)


def _like(target: Any, tree: Tree) -> Any:
    if isinstance(target, nn.Module):
        return bind(tree)
    if isinstance(target, tuple):
        return target[0], to_linen(tree)
    return to_linen(tree)


def _empty(tree: Tree) -> list[tuple[str, Path]]:
    """The variables' empty mappings (`{"params": {"a": {}}}` -> `("params",
    ("a",))`), read from the structure `to_linen` rebuilds."""
    record = source_of(tree, "linen", LinenRecord).record
    treedef = record.treedef
    variables = jtu.tree_unflatten(treedef, [None] * treedef.num_leaves)
    out: list[tuple[str, Path]] = []
    stack = [(str(role), (), node) for role, node in reversed(variables.items())]
    while stack:  # depth first, in the variables' order
        role, path, node = stack.pop()
        if _node_kind(type(node)) == _MAPPING:
            if not node:
                out.append((role, path))
            stack += [(role, path + (k,), v) for k, v in reversed(node.items())]
    return out


def _forward(
    tree: Tree, loss_fn: Callable[..., Any], batch: tuple, rngs: Any
) -> tuple[Any, Tree | None]:
    native = bind(tree, rngs)
    if not isinstance(native, nn.Module):  # variables without a module
        return loss_fn(native, *batch), None
    try:
        out = loss_fn(native, *batch)
    except InvalidRngError as error:
        raise ValueError(_NEEDS_RNGS.format(error=error)) from error
    return out, from_linen(native.variables, linen_module(tree))


def _embed(
    tree: Tree, args: tuple, kwargs: dict[str, Any], keys: Keys, inference: Any
) -> tuple[Any, Tree, tuple[str, ...]]:
    """A call inside a wrapper: bound with every stream of `keys` (as
    `module.apply(rngs=...)`), every collection but `params` mutable. A Linen module
    takes its mode as a call argument: `inference` is not used."""
    native = bind(tree, keys.every())
    out = native(*args, **kwargs)
    return out, from_linen(native.variables, linen_module(tree)), ()


def _infer(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if isinstance(model, nn.Module):
        return model(*inputs, **kwargs)
    if isinstance(model, tuple):
        return model[0].apply(model[1], *inputs, **kwargs)
    raise TypeError(_NO_MODULE)


def _called(run: Callable[[], Any]) -> tuple[Any, dict[tuple, Any]]:
    """`run()` (a forward pass), with every submodule it calls by its path
    (`("conv",)`): Linen records the classes and settings of compact submodules
    nowhere else. Repeated blocks are traced once (`_linen_blocks`)."""
    seen: dict[tuple, Any] = {}
    with nn.intercept_methods(repeated(seen)):
        out = run()
    return out, seen


def _from_file(
    tensors: list[tuple[str, Path, str, Any]],
    modules: dict[Path, tuple[str, dict[str, Any]]],
    kinds: dict[Path, Any],
    empty: list[tuple[str, Path]],
) -> Tree:
    """The Tree of a Flax file (Linen, NNX, or of no known framework) as Linen-style
    variables, `{role: {module: {name: array}}}`, with the recorded classes."""
    variables: dict[str, Any] = {}
    for _, path, role, array in tensors:
        node = variables.setdefault(role, {})
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array
    for role, path in empty:  # checked: none holds or is inside an array
        node = variables.setdefault(role, {})
        for key in path:
            node = node.setdefault(key, {})
    plain = from_linen(variables)
    # the same Tree, with the recorded classes (NNX's): they tell bridge.port each
    # layer's kind
    src = source_of(plain)
    entries = [
        (path, str(role), leaf, position)
        for path, position, role, leaf in zip(
            src.paths, src.order, leaf_roles(plain), jtu.tree_leaves(plain)
        )
    ]
    return build(entries, kinds, "linen", src.record, src.native)


def _unwrap_train_state(obj: Any) -> tuple[Any, Any] | None:
    if isinstance(obj, train_state.TrainState):
        return obj.opt_state, obj.step
    return None


def _wrap_train_state(like: Any, state: Any, step: Any) -> Any:
    dtype = jnp.result_type(like.step)
    return like.replace(opt_state=state, step=jnp.array(step, dtype))


def _train_state_model(obj: Any) -> Tree | None:
    """The Tree of a TrainState's parameters (with its module when `apply_fn` is a
    Linen module's bound method)."""
    if not isinstance(obj, train_state.TrainState):
        return None
    module = getattr(obj.apply_fn, "__self__", None)
    variables = {"params": obj.params}
    return from_linen(variables, module if isinstance(module, nn.Module) else None)


def _optimizer_params(tree: Tree) -> Any:
    return to_linen(tree).get("params", {})


def _declared(
    tree: Tree, wanted: Callable[[Any], bool]
) -> list[tuple[Path, Any]] | None:
    """The submodules of a Linen model's Tree that `wanted` accepts (not looking
    inside them), with their paths: those its module (given to `bridge.from_linen`,
    or as `(module, variables)`) declares as fields or in `setup`, at any depth. A
    submodule made inside a compact `__call__` exists only while the model runs: it
    is not found. None without the module (Linen variables record no module
    classes); empty when the module itself is wanted."""
    module = source_of(tree, "linen", LinenRecord).record.module.value
    if module is None:
        return None
    if wanted(module):
        return []
    try:  # best effort: a module whose setup fails outside apply has none found
        bound = module.clone(parent=None).bind(to_linen(tree))
        return _abstractly(lambda: _declared_in(bound, wanted))
    except Exception:
        return []


def _abstractly(walk: Callable[[], Any]) -> Any:
    """`walk()`, a walk of a bound module's `setup`s, run under `jax.eval_shape`:
    the arrays a `setup` computes (transformers' rotary tables) are traced, not
    compiled and computed (10 XLA compilations, 0.1-0.3 s, for a Flax Llama); run
    again as it is where a setup cannot be traced (one reading array values)."""
    found: list[Any] = []

    def traced() -> tuple:
        found.append(walk())
        return ()

    try:
        jax.eval_shape(traced)
    except Exception:
        return walk()
    return found[0]


def _declared_in(
    module: nn.Module,
    wanted: Callable[[Any], bool],
    walked: dict[Any, list[tuple[Path, Any]]] | None = None,
) -> list[tuple[Path, Any]]:
    """The submodules of a bound `module` that `wanted` accepts, at any depth below
    its `setup`, by path. A submodule like one walked before (`_linen_blocks.same`:
    its class, settings and variables' shapes: the blocks of a stack) declares the
    same ones: they are found at its own path without running its `setup` again
    (a 64-layer transformers Llama: 9 ms a layer)."""
    walked = {} if walked is None else walked
    module._try_setup()
    found = []
    for child in module._state.children.values():
        if not isinstance(child, nn.Module) or child.scope is None:
            continue
        path = tuple(child.scope.path)
        if wanted(child):
            found.append((path, child))
            continue
        key = same(child)
        inside = walked.get(key) if key is not None else None
        if inside is None:
            inside = _declared_in(child, wanted, walked)
            inside = [(p[len(path) :], m) for p, m in inside]
            if key is not None:
                walked[key] = inside
        found += [(path + p, m) for p, m in inside]
    return found


def _listed(tree: Tree) -> dict[Path, Path]:
    """`{path: indexed path}` of the submodules a Linen model's `setup` assigns
    in a list or tuple (`self.layer = [A(), B()]`, which Linen names `layer_0`,
    `layer_1`): `("layer_0",)` -> `("layer", 0)`, at any depth. Empty without the
    module, or where its setup fails outside `apply`."""
    module = source_of(tree, "linen", LinenRecord).record.module.value
    if module is None:
        return {}
    try:  # best effort, as `_declared`
        return _abstractly(lambda: _listed_from(module, tree))
    except Exception:
        return {}


def _listed_from(module: nn.Module, tree: Tree) -> dict[Path, Path]:
    out: dict[Path, Path] = {}
    _listed_in(module.clone(parent=None).bind(to_linen(tree)), (), (), out)
    return out


def _listed_in(module: nn.Module, at: Path, new: Path, out: dict[Path, Path]) -> None:
    """`module` at `at` (`new` once indexed): its list elements into `out`."""
    module._try_setup()
    for attr, value in vars(module).items():
        if not isinstance(value, (list, tuple)):
            continue
        for i, child in enumerate(value):
            named = f"{attr}_{i}"  # Linen's name for it
            if isinstance(child, nn.Module) and child.name == named:
                out[at + (named,)] = new + (attr, i)
    for name, child in module._state.children.items():
        if isinstance(child, nn.Module) and child.scope is not None:
            inner = at + (name,)
            _listed_in(child, inner, out.get(inner, new + (name,)), out)


ADAPTER = register_adapter(
    Adapter(
        name="linen",
        display="Flax Linen",
        recognise=_recognise,
        to_tree=_to_tree,
        to_native=bind,
        module_types=(nn.Module,),
        layout="flax",
        like=_like,
        forward=_forward,
        infer=_infer,
        bind=bind,
        records_classes=False,
        called=_called,
        empty=_empty,
        embed=_embed,
        from_file=_from_file,
        optimizer=Optimizer(
            _unwrap_train_state,
            _wrap_train_state,
            _train_state_model,
            params=_optimizer_params,
        ),
        declared=_declared,
        listed=_listed,
    )
)
