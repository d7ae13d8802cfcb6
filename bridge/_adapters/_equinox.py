"""Adapter: Equinox modules (and `eqx.nn.State`) <-> `bridge.Tree`."""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._kept._array import is_quantized
from .._paths import MAX_DEPTH, Key, Path, child, is_array, key_of, path_of
from .._placement import placeholder
from .._tree import Held, Tree
from ._build import Maker, build, native_leaves, source_of
from ._registry import Adapter, Optimizer, register_adapter
from ._skeleton import settings, skeleton


if TYPE_CHECKING:
    from ._keys import Keys


_FOREIGN_STATE = """\
The State holds an entry for a StateIndex that is not in the model: pass the State made
together with this model (`model, state = eqx.nn.make_with_state(Model)(...)`)."""


def _is_index(x: Any) -> bool:
    return isinstance(x, eqx.nn.StateIndex)


def _index_or_quantized(x: Any) -> bool:
    return isinstance(x, eqx.nn.StateIndex) or is_quantized(x)


_MISSING = object()


class _Nodes:
    """The model's nodes by path, each fetched once (for kinds and owners)."""

    def __init__(self, model: Any):
        self.nodes: dict[Path, Any] = {(): model}

    def get(self, path: Path) -> Any:
        node = self.nodes.get(path, _MISSING)
        if node is _MISSING:
            node = self.nodes[path] = child(self.get(path[:-1]), path[-1])
        return node

    def kinds(self, paths: Iterable[Path]) -> dict[Path, Any]:
        """The class of every node above `paths` (None: not reachable by key)."""
        kinds: dict[Path, Any] = {}
        for path in paths:
            for depth in range(len(path) - 1, -1, -1):
                prefix = path[:depth]
                if prefix in kinds:
                    break
                try:
                    kinds[prefix] = type(self.get(prefix))
                except (AttributeError, KeyError, IndexError, TypeError):
                    kinds[prefix] = None  # a custom pytree node without keys
        return kinds

    def index_above(self, path: Path) -> Path | None:
        """The path of the StateIndex whose `init` holds the leaf at `path`."""
        for depth in range(len(path) - 1, -1, -1):
            if path[depth] == "init" and _is_index(self.get(path[:depth])):
                return path[:depth]
        return None

    def state_role(self, index_path: Path) -> str:
        return _owner_role(self.get(index_path[:-1]) if index_path else None)


def _owner_role(owner: Any) -> str:
    """The role of the state held by a StateIndex of `owner` (None: the model)."""
    return "batch_stats" if isinstance(owner, eqx.nn.BatchNorm) else "state"


def from_equinox(model: Any, state: eqx.nn.State | None = None) -> Tree:
    """Convert an Equinox model (and its `eqx.nn.State`) to a `bridge.Tree`.

    The Tree reads like the model (`t.layers[-1].weight`); its leaves are the model's
    arrays (not copied), role `"params"`. The model's other leaves (functions such as
    an MLP's activation, python floats and bools) and its static fields are kept as
    static metadata. With `state`, each entry of the `State` is placed where its
    `StateIndex` sits in the model (a `BatchNorm` in `mode="batch"` gives
    `t.bn.batch_state_index[0]` for the running mean and `[1]` for the variance),
    role `"batch_stats"` for a `BatchNorm`'s entries and `"state"` otherwise. A
    `StateIndex` whose initial value was not deleted (`eqx.nn.State(model)` without
    `eqx.nn.delete_init_state`) keeps it as static data when `state` is given; without
    `state`, the initial values are the leaves, with the roles above.

    **Arguments:**

    - `model`: an `eqx.Module`. It is not modified.
    - `state`: optional, the model's `eqx.nn.State` (from `eqx.nn.make_with_state`).

    **Returns:**

    A `bridge.Tree`; `bridge.to_equinox` gives back the model, or `(model, state)`
    when a state was given.

    **Example:**

    ```python
    >>> import jax, equinox as eqx, bridge
    >>> t = bridge.from_equinox(eqx.nn.Linear(2, 3, key=jax.random.key(0)))
    >>> t.weight.shape
    (3, 2)

    ```
    """
    if not isinstance(model, eqx.Module):
        raise TypeError(
            f"bridge.from_equinox expects `model`, an eqx.Module, got "
            f"{type(model).__name__}. "
            "For NNX modules use bridge.from_nnx, for Linen variables "
            "bridge.from_linen."
        )
    if state is not None and not isinstance(state, eqx.nn.State):
        raise TypeError(f"`state` must be an eqx.nn.State, got {type(state).__name__}.")
    if state is None:
        tree = _walk(model)
        if tree is not None:
            return tree
    # a weight kept quantized is one leaf, as the Tree holds it
    flat, model_def = jtu.tree_flatten_with_path(model, is_leaf=is_quantized)
    nodes = _Nodes(model)
    entries: list[tuple[Path, str, Any, int]] = []
    statics: list[tuple[int, Held]] = []
    array_slots: list[int] = []  # model leaf positions that hold arrays
    for i, (keypath, leaf) in enumerate(flat):
        if not is_array(leaf):
            statics.append((i, Held(leaf)))
            continue
        path = path_of(keypath)
        role = "params"
        index = nodes.index_above(path) if "init" in path else None
        if index is not None:
            if state is not None:  # an undeleted initial value: State has the live one
                statics.append((i, Held(leaf)))
                continue
            role = nodes.state_role(index)
        entries.append((path, role, leaf, len(array_slots)))
        array_slots.append(i)
    kinds = nodes.kinds(e[0] for e in entries)

    state_def = None
    if state is not None:
        index_paths = _index_paths(model)
        by_marker = {index.marker: p for p, index in index_paths.items()}
        state_flat, state_def = jtu.tree_flatten_with_path(state)
        # the State's entries by position (its key path's first entry)
        markers: dict[Key, Any] = dict(enumerate(state_def.node_data()[1]))
        for j, (keypath, leaf) in enumerate(state_flat):
            marker = markers[key_of(keypath[0])]
            if marker not in by_marker:
                raise ValueError(_FOREIGN_STATE)
            at = by_marker[marker]
            path = at + path_of(keypath[1:])
            entries.append((path, nodes.state_role(at), leaf, len(array_slots) + j))
        kinds.update(nodes.kinds(list(index_paths)))
        kinds.update({p: type(index) for p, index in index_paths.items()})
        entries.sort(key=_model_rank(model))
    record = EquinoxRecord(model_def, tuple(statics), tuple(array_slots), state_def)
    return build(entries, kinds, "equinox", record)


# one level of a pytree node: `(children, aux)`, or None for a leaf (C++); with keys:
# `((key, child), ...)` pairs
_flatten_one = getattr(jtu.default_registry, "flatten_one_level", None)
_flatten_one_keyed = getattr(jtu.default_registry, "flatten_one_level_with_keys", None)

_LEAF, _SEQUENCE, _DICT, _NONE, _OTHER = range(5)

# what `_walk` does with an object of each class: one of the above, or for an Equinox
# module class the names of its children (its dynamic fields, in flatten order)
_CLASSES: dict[type, Any] = {}


def _class_of(value: Any) -> Any:
    cls = type(value)
    known = _CLASSES.get(cls)
    if known is None:
        assert _flatten_one_keyed is not None  # `_walk`, its only caller, checks
        pairs = _flatten_one_keyed(value)
        if pairs is None:
            known = _LEAF
        elif cls in (list, tuple):
            known = _SEQUENCE
        elif cls is dict:
            known = _DICT
        elif value is None:
            known = _NONE
        elif (
            issubclass(cls, eqx.Module)
            and not issubclass(cls, Mapping)  # `child` would index it
            and all(type(k) is jtu.GetAttrKey for k, _ in pairs[0])
        ):  # the same names for every instance: Equinox generates its flatten
            known = tuple(k.name for k, _ in pairs[0])
        else:
            known = _OTHER  # a custom pytree, a weight kept quantized
        _CLASSES[cls] = known
    return known


class _Unwalkable(Exception):
    """A node `_walk` does not read."""


def _walk(model: Any) -> Tree | None:
    """`from_equinox(model)` without a state, in one walk over the model's nodes
    (modules, tuples, lists, dicts), making the Tree's nodes as it returns from
    them: no key paths, no second pass. None when the model holds a node of
    another kind or is deeper than `MAX_DEPTH` (then `from_equinox` takes the
    general path), or when its leaves are not `jax.tree_util`'s (checked)."""
    flatten_one, flatten_keyed = _flatten_one, _flatten_one_keyed
    if flatten_one is None or flatten_keyed is None:
        return None
    kinds: dict[Path, Any] = {(): type(model)}
    maker = Maker(kinds)
    seen: list[Any] = []  # every model leaf, in jax.tree_util's order
    statics: list[tuple[int, Held]] = []
    array_slots: list[int] = []  # the model leaf position of each Tree leaf

    def visit(
        node: Any, how: Any, path: Path, role: str, owner: Any
    ) -> tuple[tuple[Key, ...], list, list]:
        """The Tree's `(keys, roles, children)` of `node` (`how`: its class's
        `_class_of`); `owner` holds `node`."""
        if len(path) >= MAX_DEPTH:
            raise _Unwalkable
        if type(how) is tuple:  # an Equinox module
            pairs: Any = zip(how, flatten_one(node)[0])
        elif how == _SEQUENCE:
            pairs = enumerate(node)
        elif how == _DICT:
            pairs = ((key_of(k), v) for k, v in flatten_keyed(node)[0])
        elif how == _NONE:
            return (), [], []
        else:
            raise _Unwalkable
        index = isinstance(node, eqx.nn.StateIndex)
        keys, roles, children = [], [], []
        for key, value in pairs:
            # a StateIndex's initial value: the role of the index's owner
            inner = _owner_role(owner) if index and key == "init" else role
            kind = _CLASSES.get(type(value))
            if kind is None:
                kind = _class_of(value)
            if kind == _LEAF:
                if is_array(value):
                    maker.leaf(path + (key,), value, len(array_slots))
                    array_slots.append(len(seen))
                    keys.append(key)
                    roles.append(inner)
                    children.append(value)
                else:
                    statics.append((len(seen), Held(value)))
                seen.append(value)
                continue
            here = path + (key,)
            sub = visit(value, kind, here, inner, node)
            if sub[0]:  # a node without arrays is no node of the Tree
                kinds[here] = type(value)
                children.append(maker.node(here, *sub))
                keys.append(key)
                roles.append(None)
        return tuple(keys), roles, children

    try:
        top = visit(model, _class_of(model), (), "params", None)
    except _Unwalkable:
        return None
    flat, model_def = jtu.tree_flatten(model)
    if len(flat) != len(seen) or not all(map(operator.is_, flat, seen)):
        return None
    record = EquinoxRecord(model_def, tuple(statics), tuple(array_slots), None)
    return maker.root(*top, "equinox", record)


class EquinoxRecord(NamedTuple):
    """What `to_equinox` rebuilds the model from (a Tree's `Source.record`)."""

    model_def: Any  # the model's treedef
    statics: tuple[tuple[int, Held], ...]  # (model leaf position, non-array leaf)
    array_slots: tuple[int, ...]  # the model leaf position of each Tree leaf
    state_def: Any  # the eqx.nn.State's treedef, or None: no state


def _model_rank(model: Any):
    """Sort key: a State entry goes where its StateIndex is in the model."""
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=_index_or_quantized)
    rank = {path_of(p): i for i, (p, _) in enumerate(flat)}

    def key(entry: tuple[Path, str, Any, int]) -> int:
        path = entry[0]
        return next(
            rank[path[:d]] for d in range(len(path), -1, -1) if path[:d] in rank
        )

    return key


def _index_paths(model: Any) -> dict[Path, Any]:
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=_index_or_quantized)
    return {path_of(p): x for p, x in flat if _is_index(x)}


def to_equinox(tree: Tree) -> Any:
    """Rebuild the Equinox model of a `bridge.Tree` made by `bridge.from_equinox`.

    **Arguments:**

    - `tree`: a `bridge.Tree` from `bridge.from_equinox`, with the same leaf paths.

    **Returns:**

    The model, or `(model, state)` when the Tree was made with an `eqx.nn.State`.
    The model's arrays are the Tree's leaves (not copied); its other leaves and
    static fields are those of the source model.
    """
    src, leaves = native_leaves(tree, "equinox", EquinoxRecord)
    record = src.record
    model_leaves: list[Any] = [None] * record.model_def.num_leaves
    for i, static in record.statics:
        model_leaves[i] = static.value
    for i, leaf in zip(record.array_slots, leaves):
        model_leaves[i] = leaf
    model = jtu.tree_unflatten(record.model_def, model_leaves)
    if record.state_def is None:
        return model
    state = leaves[len(record.array_slots) :]
    return model, jtu.tree_unflatten(record.state_def, state)


# --- the adapter record -------------------------------------------------------------


_STATE_FORM = """\
This Equinox model has an eqx.nn.State, so loss_fn is called as
`loss_fn(model, state, *batch)` and must return `(loss, new_state)` (with has_aux=True:
`((loss, aux), new_state)`), the new state being what the model's layers return, but it
returned {got}."""


def _is_pair(obj: Any) -> bool:
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and isinstance(obj[0], eqx.Module)
        and isinstance(obj[1], eqx.nn.State)
    )


def _to_tree(obj: Any) -> Tree:
    return from_equinox(*obj) if _is_pair(obj) else from_equinox(obj)


def _has_state(tree: Tree) -> bool:
    """Whether `to_equinox(tree)` gives `(model, state)` (a model may be a tuple
    itself: an `nn.Sequential` read from a file, numbered `0`, `1`, ...)."""
    record = source_of(tree, "equinox", EquinoxRecord).record
    return record.state_def is not None


def _model(tree: Tree) -> Any:
    native = to_equinox(tree)
    return native[0] if _has_state(tree) else native


def _placeholders(target: Any) -> Any:
    """A model made with `eqx.filter_eval_shape` holds `ShapeDtypeStruct`s: stand in
    zero-memory read-only zeros (`np.broadcast_to`), which Equinox counts as arrays,
    keeping their shardings (`bridge.port` and `bridge.load` place arrays by them)."""
    return jtu.tree_map(placeholder, target)


def _forward(
    tree: Tree, loss_fn: Callable[..., Any], batch: tuple, rngs: Any
) -> tuple[Any, Tree | None]:
    native = to_equinox(tree)
    if not _has_state(tree):
        return loss_fn(native, *batch), None
    model, state = native
    # before the call: a layer's `state.set` makes the given State unusable
    structure = jtu.tree_structure(state)
    result = loss_fn(model, state, *batch)
    if not (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[1], eqx.nn.State)
        and jtu.tree_structure(result[1]) == structure
    ):
        raise TypeError(_STATE_FORM.format(got=_describe(result)))
    return result[0], from_equinox(model, result[1])


_EMBEDDED_STATE_FORM = """\
The wrapped Equinox model has an eqx.nn.State, so it is called as
`model(*args, state, **kwargs)` and must return `(output, new_state)`, but it returned
{got}."""


def _embed(
    tree: Tree, args: tuple, kwargs: dict[str, Any], keys: Keys, inference: Any
) -> tuple[Any, Tree | None, tuple[str, ...]]:
    """A call inside a wrapper: `inference` sets `eqx.nn.inference_mode`; a model
    whose `__call__` takes `key` gets `keys.one()` (unless the call gives `key=`); a
    model with a `State` is called `model(*args, state, **kwargs) -> (out, state)`."""
    native = to_equinox(tree)
    model, state = native if isinstance(native, tuple) else (native, None)
    if inference is not None:
        model = eqx.nn.inference_mode(model, inference)
    if "key" not in kwargs and _takes_key(model):
        key = keys.one()
        kwargs = kwargs if key is None else {**kwargs, "key": key}
    if state is None:
        return model(*args, **kwargs), None, ()
    result = model(*args, state, **kwargs)
    if not (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[1], eqx.nn.State)
    ):
        raise TypeError(_EMBEDDED_STATE_FORM.format(got=_describe(result)))
    return result[0], from_equinox(model, result[1]), ()


_TAKES_KEY: dict[type, bool] = {}


def _takes_key(model: Any) -> bool:
    """Whether an Equinox model's `__call__` has a `key` argument (or `**kwargs`)."""
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


def _describe(result: Any) -> str:
    if isinstance(result, tuple):
        inner = ", ".join(type(x).__name__ for x in result)
        return f"a tuple ({inner})"
    return f"a {type(result).__name__}"


def _infer(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`eqx.nn.inference_mode(model)` vmapped over the batch (with a state:
    `model(*x, state, **kwargs)[0]`)."""
    state = None
    if isinstance(model, tuple):
        model, state = model
    model = eqx.nn.inference_mode(model)

    def one(*xs):
        if state is None:
            return model(*xs, **kwargs)
        return model(*xs, state, **kwargs)[0]

    return jax.vmap(one)(*inputs)


def _from_file(
    tensors: list[tuple[str, Path, str, Any]],
    modules: dict[Path, tuple[str, dict[str, Any]]],
    kinds: dict[Path, Any],
    empty: list[tuple[str, Path]],
) -> Tree:
    """The Tree of an Equinox checkpoint read without the model: its native model is
    a skeleton holding the arrays and each module's recorded settings."""
    paths = [path for _, path, _, _ in tensors]
    model_def, position = skeleton(paths, modules)
    entries = [(path, role, array, position[path]) for _, path, role, array in tensors]
    record = EquinoxRecord(model_def, (), tuple(range(len(paths))), None)
    return build(entries, kinds, "equinox", record)


def _optimizer_params(tree: Tree) -> Any:
    return eqx.filter(_model(tree), eqx.is_array)


def _creation_order(cls: Any, keys: Sequence[Key]) -> bool | None:
    """An Equinox module's fields come in class order: its creation order."""
    return True if isinstance(cls, type) and issubclass(cls, eqx.Module) else None


ADAPTER = register_adapter(
    Adapter(
        name="equinox",
        display="Equinox",
        recognise=lambda obj: isinstance(obj, eqx.Module) or _is_pair(obj),
        to_tree=_to_tree,
        to_native=to_equinox,
        module_types=(eqx.Module,),
        layout="equinox",
        placeholders=_placeholders,
        forward=_forward,
        infer=_infer,
        rngs_hint="Equinox layers take a `key=` argument: pass the key as a batch "
        "argument, `step(tree, opt_state, x, y, key)`, and give it to the model in "
        "loss_fn.",
        shape_hint="An Equinox model takes one example, not a batch: wrap a module "
        "whose __call__ maps it over the batch, `jax.vmap(self.model)(x)` (see "
        "docs/guides/mixing.md), or call the wrapper under `nnx.vmap` / `nn.vmap`.",
        modules=_model,
        settings=settings,
        from_file=_from_file,
        embed=_embed,
        optimizer=Optimizer(
            lambda obj: None, lambda like, state, step: state, params=_optimizer_params
        ),
        creation_order=_creation_order,
    )
)
