"""Adapter: Flax NNX modules <-> `bridge.Tree`."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax.numpy as jnp
from flax import __version__ as flax_version, nnx
from flax.nnx import variablelib
from flax.nnx.graph import Static

from .._paths import Key, Path, canonical, natural
from .._tree import Held, NativeOrder, Tree
from ._build import build, native_leaves
from ._nnx_walk import usable, walk
from ._registry import Adapter, Optimizer, register_adapter


if TYPE_CHECKING:
    from ._keys import Keys


FLAX_FOR_NNX = "0.12.1"
"""The oldest flax whose NNX bridge supports; Linen models work with older flax."""

_OLD_FLAX = """\
bridge's NNX adapter needs flax >= {needed} (Variable.get_raw_value, nnx.List,
nnx.Pytree); the installed flax is {installed}. Upgrade flax (pip install
"flax>={needed}"); Linen and Equinox models work with this flax."""


def check_flax() -> None:
    """Raise `ImportError` if the installed flax is older than NNX support needs."""
    if not hasattr(nnx.Variable, "get_raw_value"):
        raise ImportError(_OLD_FLAX.format(needed=FLAX_FOR_NNX, installed=flax_version))


def role_of(variable_type: type) -> str:
    """The collection flax's own bridge maps an NNX Variable type to."""
    for name, registered in variablelib.VariableTypeCache.items():
        if variable_type is registered:
            return name
    if issubclass(variable_type, nnx.RngState):
        return "rngs"
    return variable_type.__name__


def _child_order(node: Any) -> dict[Key, int]:
    """Definition order of a graph node's children (NNX state keys are sorted)."""
    if isinstance(node, nnx.List) or isinstance(node, (list, tuple)):
        keys: list[Key] = list(range(len(node)))
    elif isinstance(node, nnx.Pytree):  # Module, nnx.Dict, Rngs, RngStream, ...
        keys = list(vars(node))
    elif isinstance(node, Mapping):
        keys = list(node)
    else:
        keys = []  # an unknown node: keep NNX's (sorted) order
    return {k: i for i, k in enumerate(keys)}


def _child(node: Any, key: Any) -> Any:
    if isinstance(node, nnx.Pytree) and not isinstance(node, nnx.List):
        assert isinstance(key, str)  # a Pytree's children are its attributes
        return getattr(node, key)
    items: Any = node  # an nnx.List, or a plain list or dict
    return items[key]


def from_nnx(module: nnx.Module) -> Tree:
    """Convert a Flax NNX module to a `bridge.Tree`, without copying any array.

    The Tree reads like the module (`t.layers[-1].kernel`), its children in natural
    key order, so the module has the same Tree structure before and after `nnx.jit`,
    `nnx.eval_shape` or `nnx.clone` (which sort its attributes); its definition order
    is recorded for `bridge.to_nnx` (`bridge._tree.native_order`). Every Variable
    becomes a leaf (its raw array) with the role of its type:
    `Param` -> `"params"`, `BatchStat` -> `"batch_stats"`, `RngKey`/`RngCount` ->
    `"rngs"`, ... The graph definition (static attributes, Variable metadata such as
    sharding annotations, which submodules are shared) is kept as static metadata. A
    Variable shared by several submodules (tied weights) appears once, at the path
    `nnx.state` gives it, and stays shared through `bridge.to_nnx`.

    **Arguments:**

    - `module`: an `nnx.Module`. It is not modified.

    **Returns:**

    A `bridge.Tree`.

    **Example:**

    ```python
    >>> import bridge
    >>> from flax import nnx
    >>> t = bridge.from_nnx(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> t.kernel.shape
    (2, 3)

    ```
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"bridge.from_nnx expects `module`, an nnx.Module, got "
            f"{type(module).__name__}. "
            "For Linen variables use bridge.from_linen, for Equinox models "
            "bridge.from_equinox, or bridge.to_neutral for any of them."
        )
    check_flax()
    walked = walk(module, _role) if usable() else None
    if walked is not None:  # the common graph, read in one walk
        held = _held(module, walked.graphdef)
        record = NNXRecord(held, walked.mutable, NativeOrder(walked.layout))
        return walked.maker.root(
            walked.keys, walked.roles, walked.children, "nnx", record, walked.native
        )
    return _from_graph(module)


def _from_graph(module: nnx.Module) -> Tree:
    """`from_nnx` through `nnx.graph.flatten` (any graph: shared references,
    cycles, unknown node kinds)."""
    graphdef, flat = nnx.graph.flatten(module)  # as nnx.split, in sorted order
    leaves = flat.leaves
    held = _held(module, graphdef)
    # flax types a path's keys as any hashable: other keys than `str` and `int`
    # (nnx.WeightNorm's `scales` is keyed by tuples) are shown by their repr
    native_paths = [tuple(p) for p in flat.paths]
    paths = [tuple(map(_tree_key, p)) for p in native_paths]
    if len(set(paths)) != len(paths):
        raise TypeError(_KEYS_CLASH.format(type=type(module).__name__))

    kinds: dict[Path, Any] = {(): type(module)}
    nodes: dict[tuple, Any] = {(): module}  # by native path (any hashable keys)
    shown: dict[Path, Any] = {(): module}  # by the Tree's path
    children: dict[Path, dict[Key, None]] = {}

    def sort_key(i: int) -> tuple:
        native, path = native_paths[i], paths[i]
        for depth, key in enumerate(path):
            prefix = path[:depth]
            children.setdefault(prefix, {})[key] = None
            if depth < len(path) - 1 and native[: depth + 1] not in nodes:
                node = _child(nodes[native[:depth]], native[depth])
                nodes[native[: depth + 1]] = shown[path[: depth + 1]] = node
                kinds[path[: depth + 1]] = type(node)
        return tuple(map(natural, path))

    # the Tree's order is canonical (natural key order), so a module whose
    # attributes nnx.jit, nnx.eval_shape or nnx.clone sorted has the same structure
    order = sorted(range(len(paths)), key=sort_key)
    entries = []
    for i in order:
        role, value = _role_and_value(leaves[i])
        entries.append((paths[i], role, value, i))
    # parents before children: each node's class and attribute order (nnx.merge
    # sets attributes in sorted order: to_nnx restores the definition order)
    layout = tuple((path, _keys(node)) for path, node in nodes.items())
    record = NNXRecord(held, _mutable_statics(graphdef), NativeOrder(layout))
    return build(entries, kinds, "nnx", record, _native(shown, children))


_KEYS_CLASH = (
    "A {type} holds a dict whose keys are not strings or integers, and two of them "
    "read alike once shown as strings (a key 'a' and a key of another type whose "
    "repr is 'a'): a bridge.Tree cannot name both. Give the dict distinct keys."
)


def _tree_key(key: Any) -> Key:
    """A graph key as a Tree key: strings and integers as they are, others (a
    tuple) by their repr."""
    return key if isinstance(key, (str, int)) else repr(key)


def _held(module: nnx.Module, graphdef: Any) -> Held:
    # a graph definition is slow to hash: hash a summary of it instead
    return Held(graphdef, (type(module), graphdef.num_leaves, len(graphdef.nodes)))


def _native(
    nodes: dict[Path, Any], children: dict[Path, dict[Key, None]]
) -> dict[Path, tuple[Key, ...]]:
    """Each node's children in definition order, where it is not the canonical
    order (`Source.native`)."""
    native = {}
    for path, keys in children.items():
        position = _child_order(nodes[path])
        tree_order = canonical(tuple(keys))
        last = len(position)
        ordered = tuple(sorted(tree_order, key=lambda k: position.get(k, last)))
        if ordered != tree_order:
            native[path] = ordered
    return native


class NNXRecord(NamedTuple):
    """What `to_nnx` rebuilds the module from (a Tree's `Source.record`)."""

    graphdef: Held  # nnx.graph.flatten's graph definition
    mutable: tuple[int, ...]  # positions of mutable static attributes, to copy
    # each node's attribute order, `(path, keys)`: no part of equality
    layout: NativeOrder


def _keys(node: Any) -> tuple | None:
    attributes = _attributes(node)
    return None if attributes is None else tuple(attributes)


_ROLES: dict[type, str] = {}


def _role(cls: type) -> str:
    role = _ROLES.get(cls)
    if role is None:
        role = _ROLES[cls] = role_of(cls)
    return role


def _role_and_value(leaf: Any) -> tuple[str, Any]:
    if not isinstance(leaf, nnx.Variable):
        return "state", leaf  # an array attribute that is not a Variable
    return _role(type(leaf)), leaf.get_raw_value()


def _mutable_statics(graphdef: Any) -> tuple[int, ...]:
    """Positions of static attributes holding mutable containers (a list of layer
    sizes, ...): `nnx.merge` would share them with the source module."""
    return tuple(
        i
        for i, (key, attr) in enumerate(graphdef.attributes)
        if type(attr) is Static
        and key != "_pytree__nodes"  # flax copies this one on write
        and isinstance(attr.value, (list, dict, set, bytearray))
    )


def to_nnx(tree: Tree) -> nnx.Module:
    """Rebuild the NNX module of a `bridge.Tree` made by `bridge.from_nnx`.

    The result is a new module of the same class that shares no Variable with the
    source module; its Variables hold the Tree's arrays (not copied). Shared (tied)
    submodules and Variables stay shared; attributes come in the source's definition
    order, and mutable static attributes (a list of layer sizes) are copies. Leaves
    changed with `eqx.tree_at` (values, shapes, dtypes) are taken as they are.

    **Arguments:**

    - `tree`: a `bridge.Tree` from `bridge.from_nnx`, with the same leaf paths.

    **Returns:**

    An `nnx.Module`.
    """
    src, leaves = native_leaves(tree, "nnx", NNXRecord)
    check_flax()
    record = src.record
    graphdef = record.graphdef.value
    if record.mutable:  # give the new module its own copies
        attributes = list(graphdef.attributes)
        for i in record.mutable:
            key, attr = attributes[i]
            attributes[i] = (key, Static(copy.deepcopy(attr.value)))
        graphdef = dataclasses.replace(graphdef, attributes=attributes)
    module = nnx.merge(graphdef, leaves)
    _reorder(module, record.layout.value)
    return module


def _attributes(node: Any) -> dict | None:
    """The dict whose order is a node's child order: `vars` of a module (or other
    `nnx.Pytree`), a plain dict itself; None for sequences."""
    if isinstance(node, nnx.List):
        return None
    if isinstance(node, nnx.Pytree):
        return vars(node)
    return node if type(node) is dict else None


def _reorder(module: nnx.Module, layout: tuple) -> None:
    """Put each new node's attributes in the source's definition order (`vars`
    order: what `repr` shows, and what `bridge.from_nnx` reads the order from).
    `layout` is every node's `(path, attribute keys)`, parents before children."""
    nodes: dict[Path, Any] = {}
    for path, keys in layout:
        node = nodes[path] = _child(nodes[path[:-1]], path[-1]) if path else module
        if keys is None:
            continue
        attributes = _attributes(node)
        if attributes is not None and tuple(attributes) != keys:
            ordered = {k: attributes[k] for k in keys if k in attributes}
            ordered.update(attributes)
            attributes.clear()
            attributes.update(ordered)


# --- the adapter record -------------------------------------------------------------


def _forward(
    tree: Tree, loss_fn: Callable[..., Any], batch: tuple, rngs: Any
) -> tuple[Any, Tree]:
    module = to_nnx(tree)
    out = loss_fn(module, *batch)
    return out, from_nnx(
        module
    )  # batch statistics, RNG counters: as the pass left them


def _embed(
    tree: Tree, args: tuple, kwargs: dict[str, Any], keys: Keys, inference: Any
) -> tuple[Any, Tree, tuple[str, ...]]:
    """A call inside a wrapper: `inference` True/False calls `.eval()`/`.train()`
    first; the RNG streams `keys.stream` has a key for are reseeded for this call
    (`nnx.reseed`, as `nnx.bridge.ToLinen` does), and their state is not kept."""
    module = to_nnx(tree)
    if inference is not None:
        module.eval() if inference else module.train()
    tags = {
        n.key.tag for _, n in nnx.iter_graph(module) if isinstance(n, nnx.RngStream)
    }
    reseeds = {tag: k for tag in sorted(tags) if (k := keys.stream(tag)) is not None}
    if reseeds:
        nnx.reseed(module, **reseeds)
    out = module(*args, **kwargs)
    return out, from_nnx(module), ("rngs",) if reseeds else ()


def _infer(model: nnx.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    model = nnx.clone(model)
    model.eval()
    return model(*inputs, **kwargs)


# an NNX state with its Variables replaced by their arrays: `nnx.as_pure` in newer
# flax, `nnx.pure` in flax 0.12.1
as_pure: Callable[[Any], Any] = getattr(nnx, "as_pure", None) or nnx.pure


def _unwrap_optimizer(obj: Any) -> tuple[Any, Any] | None:
    if isinstance(obj, nnx.Optimizer):
        return as_pure(obj.opt_state), obj.step[...]
    return None


def _wrap_optimizer(like: Any, state: Any, step: Any) -> Any:
    new = nnx.clone(like)
    nnx.update(new.opt_state, nnx.state(state))
    new.step[...] = jnp.asarray(step, new.step[...].dtype)
    return new


def _optimizer_params(tree: Tree) -> Any:
    return as_pure(nnx.state(to_nnx(tree), nnx.Param))


def _start_optimizer(tree: Tree, tx: Any) -> Any:
    return nnx.Optimizer(to_nnx(tree), tx, wrt=nnx.Param)


def _creation_order(cls: Any, keys: Sequence[Key]) -> bool | None:
    """An NNX module (an `nnx.Pytree`) keeps its attributes in creation order
    unless NNX sorted them (`nnx.jit`, `nnx.eval_shape`, `nnx.clone`): unsorted
    attributes are in creation order, sorted ones say nothing."""
    # nnx.Pytree: flax >= 0.12 (older flax has no NNX adapter, and no NNX trees)
    pytree = getattr(nnx, "Pytree", None)
    if pytree is None or not (isinstance(cls, type) and issubclass(cls, pytree)):
        return None
    names = [str(k) for k in keys]
    return names != sorted(names) and tuple(keys) != canonical(keys)


ADAPTER = register_adapter(
    Adapter(
        name="nnx",
        display="Flax NNX",
        recognise=lambda obj: isinstance(obj, nnx.Module),
        to_tree=from_nnx,
        to_native=to_nnx,
        module_types=(nnx.Module,),
        layout="flax",
        forward=_forward,
        infer=_infer,
        rngs_hint="An NNX model carries its RNG state (nnx.Rngs) in the model, and "
        "bridge.make_step carries it from step to step: drop `rngs`.",
        modules=to_nnx,
        embed=_embed,
        optimizer=Optimizer(
            _unwrap_optimizer,
            _wrap_optimizer,
            params=_optimizer_params,
            start=_start_optimizer,
        ),
        creation_order=_creation_order,
        check=check_flax,
    )
)
