"""`bridge.from_nnx` in one walk over an NNX module graph.

`nnx.graph.flatten` costs about three tree flatten+unflatten of the same module
(a generic walk: an `isinstance` through metaclasses and an array-reference test per
attribute). `walk` reads the common module graph (`nnx.Pytree` nodes such as
modules, `nnx.List`, `nnx.Dict`, `nnx.Rngs`; Variables; arrays as attributes;
`None`, lists, tuples and dicts marked `nnx.data`) itself, with flax's own node
flattening, and makes the graph definition flax makes (the same `NodeDef`,
`VariableDef`, `Static` records in the same order) and the Tree's nodes as it
returns from them. Anything else gives None, and `from_nnx` takes
`nnx.graph.flatten`: shared references and cycles (a Variable or node reached
twice), array references, data outside Variables that is not an array (a tracer, a
Python number), other pytrees (namedtuples, custom nodes), dicts with other than
`str` keys, non-pytree `nnx.Object`s, other graph node types, flax's C++ graph
records, tree mode, and a flax whose graph internals differ (checked by name, and
once per process against `nnx.graph.flatten` on a small module).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import config as flax_config, nnx

from .._paths import MAX_DEPTH, Key, Path, canonical
from ._build import Maker


try:  # flax >= 0.12.8 (0.12.8 and 0.12.12 checked); older flax takes the old path
    from flax.nnx import graphlib, variablelib
    from flax.nnx.pytreelib import PytreeState
    from flax.typing import HashableMapping

    _NEEDS = (
        "GRAPH_REGISTRY", "PYTREE_REGISTRY", "PYTREE_NODE_IMPL", "GraphNodeImpl",
        "GraphDef", "NodeDef", "VariableDef", "Static", "DataElem", "StaticElem",
        "NODE_ATTR", "LEAF_ATTR", "get_node_impl", "set_graph_mode", "flatten",
    )  # fmt: skip
    _FLAX_KNOWN = all(hasattr(graphlib, name) for name in _NEEDS) and hasattr(
        variablelib, "is_array_ref"
    )
except ImportError:
    _FLAX_KNOWN = False


class Walked(NamedTuple):
    """What `walk` read: the root's Tree pieces, and flax's graph definition."""

    keys: tuple[Key, ...]
    roles: list
    children: list
    maker: Maker
    native: dict[Path, tuple[Key, ...]]
    graphdef: Any  # nnx.graph.flatten's
    mutable: tuple[int, ...]  # positions of mutable static attributes
    layout: tuple  # each Tree node's `(path, attribute keys)`, in flax's order


class _Unwalkable(Exception):
    """A node `walk` does not read."""


# what `walk` does with a child of each class
_GRAPH, _VARIABLE, _PYTREE, _ARRAY, _ABSTRACT, _STATE, _OTHER = range(7)

_MUTABLE = (list, dict, set, bytearray)


@functools.cache
def _array_type() -> type:
    return type(jax.numpy.zeros(()))  # jax's array class (not a tracer)


def _classify(value: Any) -> tuple[int, Any]:
    """`(what, node implementation)` for `value`'s class, as flax's `_graph_flatten`
    treats it, for classes where the class alone decides (else `_OTHER`)."""
    cls = type(value)
    if isinstance(cls, type) and issubclass(cls, nnx.Variable):
        return _VARIABLE, None
    if cls in graphlib.GRAPH_REGISTRY:
        impl = graphlib.GRAPH_REGISTRY[cls]
        if type(impl) is graphlib.GraphNodeImpl and issubclass(cls, nnx.Pytree):
            return _GRAPH, impl
        return _OTHER, None
    if cls is PytreeState:
        impl = graphlib.get_node_impl(value)
        return (_STATE, impl) if impl is graphlib.PYTREE_NODE_IMPL else (_OTHER, None)
    if cls in (list, tuple, dict, type(None)):
        return _PYTREE, graphlib.PYTREE_REGISTRY[cls]
    if cls is np.ndarray or cls is _array_type():
        return _ARRAY, None
    if cls is jax.ShapeDtypeStruct:
        return _ABSTRACT, None
    return _OTHER, None


def usable() -> bool:
    """Whether `walk` gives what `nnx.graph.flatten` would: a flax whose graph
    internals it knows (checked once against `nnx.graph.flatten`), graph mode,
    Python graph records."""
    return (
        _FLAX_KNOWN
        and not flax_config.flax_use_flaxlib
        and graphlib.set_graph_mode.current_value() is True
        and _agrees()
    )


@functools.cache
def _agrees() -> bool:
    """Whether `walk` and `nnx.graph.flatten` agree on a small module holding every
    kind of node `walk` reads (once per process: a flax whose flatten changed
    takes the old path). Numpy arrays only: no JAX operation, so it holds inside a
    trace too."""

    class Layer(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(np.ones((2, 2), np.float32))
            self.bias = nnx.Param(np.zeros(2, np.float32))
            self.features = 2

    class Probe(nnx.Module):
        def __init__(self):
            self.layers = nnx.List([Layer(), None, Layer()])
            self.blocks = nnx.Dict(b=Layer(), a=nnx.Dropout(0.5))
            self.plain = nnx.data([Layer(), (np.ones(1),), {"z": None}])
            self.bias = nnx.data(None)
            self.pos = np.ones(2)
            self.count = nnx.BatchStat(np.zeros((), np.int32))
            self.sizes = [1, 2]

    try:
        probe = Probe()
        walked = _walk(probe, lambda cls: cls.__name__)
        graphdef, flat = graphlib.flatten(probe)
    except Exception:
        return False
    return (
        walked is not None
        and walked.graphdef == graphdef
        and sorted(walked.maker.order) == list(range(len(flat.leaves)))
        and [flat.paths[i] for i in walked.maker.order] == walked.maker.paths
    )


def walk(module: Any, role_of: Callable[[type], str]) -> Walked | None:
    """Read `module` as `from_nnx` does through `nnx.graph.flatten`, in one walk
    (`role_of`: a Variable type's role). None when the graph holds anything
    `walk` does not read (see the module's docstring)."""
    try:
        return _walk(module, role_of)
    except Exception:  # _Unwalkable, or anything flax would say: its own path
        return None


def _walk(module: Any, role_of: Callable[[type], str]) -> Walked | None:
    NodeDef, VariableDef, Static = (
        graphlib.NodeDef,
        graphlib.VariableDef,
        graphlib.Static,
    )
    DataElem, StaticElem = graphlib.DataElem, graphlib.StaticElem
    NODE_ATTR, LEAF_ATTR = graphlib.NODE_ATTR, graphlib.LEAF_ATTR
    is_array_ref = variablelib.is_array_ref

    classes: dict[type, tuple[int, Any]] = {}
    roles_of: dict[type, str] = {}
    states: dict[Any, tuple[Any, Any]] = {}  # PytreeState flattens, by treedef
    orders: dict[tuple, tuple] = {}  # a node's keys in flax's order -> canonical
    natives: dict[tuple, tuple] = {}  # (definition order, canonical) -> native

    seen: set[int] = set()  # graph nodes and Variables (flax's `ref_index`)
    nodes: list[Any] = []  # the graph definition's
    attributes: list[Any] = []  # (key, NODE_ATTR | LEAF_ATTR | Static(value))
    leaves: list[Any] = []  # flax's leaves (Variables, arrays), in its order
    mutable: list[int] = []
    kinds: dict[Path, Any] = {(): type(module)}
    maker = Maker(kinds)
    paths: list[Path] = []  # Tree leaf paths, in Tree order
    order: list[int] = []  # their positions in `leaves`
    layout: list[tuple[Path, Any]] = []
    native: dict[Path, tuple[Key, ...]] = {}

    def classify(value: Any) -> tuple[int, Any]:
        known = classes.get(type(value))
        if known is None:
            known = classes[type(value)] = _classify(value)
            if known[0] in (_GRAPH, _ARRAY, _ABSTRACT, _STATE, _PYTREE) and (
                is_array_ref(value) or isinstance(value, nnx.Variable)
            ):
                known = classes[type(value)] = (_OTHER, None)
        return known

    def visit(
        node: Any, what: int, impl: Any, path: Path
    ) -> tuple[tuple[Key, ...], list, list]:
        """Flatten `node` into the graph definition as `_graph_flatten` does; the
        Tree's `(keys, roles, children)` of it."""
        if len(path) >= MAX_DEPTH:
            raise _Unwalkable
        if what == _GRAPH:
            if id(node) in seen:  # a shared node, a cycle
                raise _Unwalkable
            index = len(seen)
            seen.add(id(node))
        else:
            index = None
        values, metadata = impl.flatten(node)
        nodes.append(NodeDef(impl.type, index, None, len(values), metadata))
        layout_at = len(layout)
        if what == _GRAPH:
            keys_here = None if isinstance(node, nnx.List) else tuple(vars(node))
        else:
            keys_here = tuple(node) if type(node) is dict else None
            if keys_here and not all(type(k) is str for k in keys_here):
                raise _Unwalkable  # int keys sort apart from `str` ones in flax
        layout.append((path, keys_here))
        keys: list[Key] = []
        roles: list = []
        children: list = []
        starts: list[int] = []  # each child's first leaf

        def leaf(key: Key, value: Any, role: str, child: Any) -> None:
            """A leaf of flax's (`value`) and of the Tree (`child`)."""
            starts.append(len(paths))
            paths.append(path + (key,))
            order.append(len(leaves))
            leaves.append(value)
            keys.append(key)
            roles.append(role)
            children.append(child)

        for key, value in values:
            cls = type(value)
            if cls is StaticElem:
                value = value.value
                if key != "_pytree__nodes" and isinstance(value, _MUTABLE):
                    mutable.append(len(attributes))
                attributes.append((key, Static(value)))
                continue
            if cls is DataElem:
                value = value.value
                data = True
            elif isinstance(value, (DataElem, StaticElem)):
                raise _Unwalkable
            else:
                data = False
            kind, sub_impl = classify(value)
            if kind == _VARIABLE:
                if id(value) in seen:
                    raise _Unwalkable
                seen_index = len(seen)
                seen.add(id(value))
                raw = value.get_raw_value()
                raw_kind = classes.get(type(raw))
                if raw_kind is None:
                    raw_kind = classify(raw)
                if raw_kind[0] not in (_ARRAY, _ABSTRACT) and is_array_ref(raw):
                    raise _Unwalkable
                attributes.append((key, NODE_ATTR))
                nodes.append(
                    VariableDef(
                        value.var_type,
                        seen_index,
                        None,
                        HashableMapping(value.get_metadata()),
                        None,
                    )
                )
                var_cls = type(value)
                role = roles_of.get(var_cls)
                if role is None:
                    role = roles_of[var_cls] = role_of(var_cls)
                leaf(key, value, role, raw)
            elif kind == _GRAPH or kind == _PYTREE or kind == _STATE:
                attributes.append((key, NODE_ATTR))
                if kind == _STATE:  # no children: its flatten is its treedef's
                    treedef = jax.tree_util.tree_structure(value)
                    got = states.get(treedef)
                    if got is None:
                        got = states[treedef] = sub_impl.flatten(value)
                        if got[0]:
                            raise _Unwalkable
                    nodes.append(NodeDef(sub_impl.type, None, None, 0, got[1]))
                    continue
                here = path + (key,)
                start = len(paths)
                sub = visit(value, kind, sub_impl, here)
                if sub[0]:  # a node without leaves is no node of the Tree
                    kinds[here] = type(value)
                    starts.append(start)
                    keys.append(key)
                    roles.append(None)
                    children.append(maker.node(here, *sub))
            elif kind == _ARRAY or (kind == _ABSTRACT and data):
                attributes.append((key, LEAF_ATTR))
                leaf(key, value, "state", value)
            elif kind == _ABSTRACT:  # not data: flax keeps it static
                attributes.append((key, Static(value)))
            else:
                raise _Unwalkable
        if not keys:
            if path:  # the root is always in the layout
                del layout[layout_at:]
            return (), [], []
        flax_keys = tuple(keys)
        if flax_keys not in orders:
            if not all(type(k) is str or type(k) is int for k in flax_keys):
                raise _Unwalkable
            orders[flax_keys] = canonical(flax_keys)
        tree_keys = orders[flax_keys]
        if tree_keys != flax_keys:  # put the children in the Tree's order
            roles, children = _reorder(
                flax_keys, tree_keys, roles, children, starts, paths, order
            )
        if keys_here is not None:  # a module or a dict: its definition order
            both = (keys_here, tree_keys)
            if both not in natives:
                position = {k: i for i, k in enumerate(keys_here)}
                last = len(position)
                natives[both] = tuple(
                    sorted(tree_keys, key=lambda k: position.get(k, last))
                )
            if natives[both] != tree_keys:
                native[path] = natives[both]
        return tree_keys, roles, children

    what, impl = classify(module)
    if what != _GRAPH:
        return None
    top = visit(module, what, impl, ())
    maker.paths, maker.order = paths, order
    graphdef = graphlib.GraphDef(
        nodes=nodes, attributes=attributes, num_leaves=len(leaves)
    )
    return Walked(
        top[0], top[1], top[2], maker, native, graphdef, tuple(mutable), tuple(layout)
    )


def _reorder(
    flax_keys: tuple,
    tree_keys: tuple,
    roles: list,
    children: list,
    starts: list[int],
    paths: list,
    order: list,
) -> tuple[list, list]:
    """A node's children, and their leaves (the tails of `paths` and `order` from
    `starts[0]`), from flax's order to the Tree's."""
    at = {k: i for i, k in enumerate(flax_keys)}
    ends = starts[1:] + [len(paths)]
    new_paths, new_order = [], []
    for key in tree_keys:
        i = at[key]
        new_paths += paths[starts[i] : ends[i]]
        new_order += order[starts[i] : ends[i]]
    paths[starts[0] :] = new_paths
    order[starts[0] :] = new_order
    pick = [at[k] for k in tree_keys]
    return [roles[i] for i in pick], [children[i] for i in pick]
