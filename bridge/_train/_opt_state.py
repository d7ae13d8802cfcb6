"""`port_opt_state`: an optimizer state follows its parameters to another model.

An optax state is a pytree whose parts are either *per-parameter* trees (Adam's
`mu`/`nu`, momentum traces, the inner states of `masked` and `multi_transform`, with
`optax.MaskedNode` where a transformation does not apply) or scalars (counts,
injected hyperparameters) and empty markers (`EmptyState`, `None`). A per-parameter
tree is recognised by its leaf paths, which name the model's parameters in one of
the forms optimizers are given them:

- Linen: the `params` dict (`('Dense_0', 'kernel')`), or the whole variables
  (`('params', 'Dense_0', 'kernel')`);
- NNX: `nnx.state(model, wrt)` (`('layers', 0, 'kernel')`), as `nnx.Optimizer` holds it;
- Equinox: `eqx.filter(model, ...)` (`.layers[0].weight`);
- `bridge.make_step`: a dict keyed by `keystr` path (`'.layers[0].kernel'`).

Each per-parameter tree is ported with `bridge.port` itself: its leaves take the
place of the source Tree's parameters, the port pairs the layers and converts the
layouts (linear layout changes, right for elementwise moments), and the target's
parameters are read back in the form the target's state holds them. Nothing is
matched by order: parts by their path in the optimizer state, parameters by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax

from .._adapters._native import check_model, to_neutral
from .._adapters._registry import Optimizer, adapters
from .._arguments import check_bool, check_opt_state, check_rules, check_step
from .._paths import Path, path_of, path_str
from .._port._errors import PortWarning
from .._port._port import port
from .._tree import Tree, leaf_roles, map_with_path


_NOT_THE_SOURCE = """\
`{name}` does not match the {side}'s parameters: at {first}, a name that is no
parameter of the {side}.{rest}
The state must be made for this very model: `tx.init(params)` with the parameters in
one of the forms bridge reads (Linen's `params` dict, `nnx.state(model, wrt)`,
`eqx.filter(model, ...)`, or `step.init(tree)` of `bridge.make_step`). Pass the model
the state was made for as `{side}`."""

_UNSUPPORTED = """\
Unsupported optimizer state: {problems}
bridge ports the parts of an optimizer state that hold one array per parameter, of
the parameter's shape (Adam's moments, momentum traces, the inner states of
`optax.masked` and `optax.multi_transform`), and copies scalars (counts). Optimizers
that keep other shapes (such as `optax.adafactor`'s factored moments) cannot follow
a layout change: start that optimizer fresh on the target (`tx.init(...)`)."""

_STRUCTURE = """\
The optimizer states (`opt_state` and `like`) differ in structure: {problems}
`like` must be the state of the same optimizer (the same `optax` chain, the same
`multi_transform` labels) for the target's parameters, e.g. `tx.init(params)`,
`step.init(tree)` or an `nnx.Optimizer(model, tx, wrt=...)`."""

_UNEXPECTED = """\
The source's optimizer state has entries that the target does not train:{paths}
The target's optimizer (`like`) has no entry for these parameters (a different spec,
`wrt` or `multi_transform` labels). Pass strict=False to leave them out."""

_MISSING = """\
Optimizer state entries start fresh (no entry in the source's state):{paths}
These parameters are trained by the target's optimizer but were not by the source's;
their entries keep the values of `like` (a fresh `init`)."""

_NO_STEP = """\
`like` is {kind}, which counts steps, but the step to resume at is unknown: the source
state is a bare optax state. Pass it, e.g. `step=1000`."""

_ID0 = 1024.0  # source entry i is marked 1024 + i: exact in float32, above defaults


def port_opt_state(
    opt_state: Any,
    source: Any,
    target: Any,
    *,
    like: Any = None,
    step: Any = None,
    rules: Mapping[str, str] | None = None,
    strict: bool = True,
) -> Any:
    """Convert an optimizer state made for `source`'s parameters into the state for
    `target`'s parameters, whatever their frameworks.

    Every part of the state that holds one array per parameter (Adam's `mu` and
    `nu`, momentum traces, the inner states of `optax.masked` and
    `optax.multi_transform`) goes through `bridge.port`, with the same pairing and
    layout conversions as the parameters themselves: the moment of a Dense kernel
    `(in, out)` becomes the moment of the Equinox weight `(out, in)`. Scalars (counts,
    injected hyperparameters) are copied; `optax.EmptyState` and `optax.MaskedNode`
    stay where `like` has them. Parts are matched by their path in the state and
    parameters by name, never by order. `opt_state`, `source`, `target` and `like`
    are not modified, and the result shares no array with them.

    When the trainable sets differ (another spec, `wrt` or labels): entries that
    both sides train are ported; parameters only the target trains keep `like`'s
    fresh entries, with a `bridge.PortWarning` listing them; entries only the source
    has are an error unless `strict=False`.

    **Arguments:**

    - `opt_state`: the source's optimizer state: an optax state (`tx.init(params)`,
      `step.init(tree)` of `bridge.make_step`), an `nnx.Optimizer`, or a Linen
      `flax.training.train_state.TrainState` (its `opt_state` and `step`).
    - `source`: the model the state was made for: anything `bridge.to_neutral`
      takes, or a `TrainState` (its `params`).
    - `target`: the model the new state is for, in any framework, likewise.
    - `like`: the target's optimizer state as its optimizer makes it, giving the
      structure and the trainable set: `tx.init(eqx.filter(model, eqx.is_array))`,
      `step.init(tree)`, `tx.init(params)`, an `nnx.Optimizer(model, tx, wrt=...)`
      or a `TrainState` (default: `target` when it is a `TrainState`).
    - `step`: the step count for an `nnx.Optimizer` or `TrainState` result
      (default: the source's, when `opt_state` is one of these).
    - `rules`, `strict`: as for `bridge.port` (`strict=False` also leaves out
      entries that the target does not train).

    **Returns:**

    The new state, of `like`'s kind: an optax state, a new `nnx.Optimizer`, or
    `like.replace(opt_state=..., step=...)` for a `TrainState`.

    **Raises:**

    `ValueError` naming the first path where `opt_state` does not match the source's
    parameters, the parts of an unsupported optimizer structure, or where `like`'s
    structure differs; `bridge.PortError` as `bridge.port`.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, equinox as eqx, optax, bridge
    >>> from flax import nnx
    >>> source = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> tx = optax.adam(1e-2)
    >>> optimizer = nnx.Optimizer(source, tx, wrt=nnx.Param)
    >>> grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(source)
    >>> _ = optimizer.update(source, grads)
    >>> target = bridge.port(source, eqx.nn.Linear(2, 3, key=jax.random.key(1)))
    >>> like = tx.init(eqx.filter(target, eqx.is_array))
    >>> state = bridge.port_opt_state(optimizer, source, target, like=like)
    >>> mu, before = state[0].mu, optimizer.opt_state[0].mu
    >>> mu.weight.shape, bool(jnp.all(mu.weight == before["kernel"][...].T))
    ((3, 2), True)

    ```
    """
    for model, argument in ((source, "source"), (target, "target")):
        if not _holds_model(model):
            check_model(model, argument)
    check_step(step)
    check_rules(rules)
    check_bool(strict, "strict")
    src_state, src_step = unwrap(opt_state)
    check_opt_state(src_state, "opt_state")
    if like is None:
        if not _holds_model(target):
            raise TypeError(
                "`like` is required: the target's optimizer state as its optimizer "
                "makes it (e.g. `tx.init(params)` or `step.init(tree)`), which gives "
                "the structure and the trainable parameters."
            )
        like = target
    like_state, _ = unwrap(like)
    check_opt_state(like_state, "like")
    if step is None:
        step = src_step
    if step is None and _container(like) is not None:
        raise ValueError(_NO_STEP.format(kind=f"an {type(like).__name__}"))
    src_tree, tgt_tree = _model(source), _model(target)
    src_parts, _ = _parts(src_state, _Index(src_tree), "opt_state")
    tgt_parts, tgt_def = _parts(like_state, _Index(tgt_tree), "like")
    _check_structure(src_parts, tgt_parts)
    porter = _Porter(src_tree, tgt_tree, rules, strict)
    new = [
        porter.part(src_parts[where], part)
        if isinstance(part, Params)
        else _copy(src_parts[where], part)
        for where, part in tgt_parts.items()
    ]
    porter.report()
    state = jtu.tree_unflatten(tgt_def, new)
    return _wrap(like, state, step)


# --- the containers -------------------------------------------------------------------


def _containers() -> list[Optimizer]:
    return [a.optimizer for a in adapters() if a.optimizer is not None]


def _container(obj: Any) -> Optimizer | None:
    """The adapter hooks of the optimizer container `obj` is, or None."""
    return next((c for c in _containers() if c.unwrap(obj) is not None), None)


def unwrap(obj: Any) -> tuple[Any, Any]:
    """`(optax state with array leaves, step or None)` of a state or its container
    (the framework's own, `Adapter.optimizer`: `nnx.Optimizer`, `TrainState`)."""
    for container in _containers():
        found = container.unwrap(obj)
        if found is not None:
            return found
    return obj, None


def _wrap(like: Any, state: Any, step: Any) -> Any:
    container = _container(like)
    return state if container is None else container.wrap(like, state, step)


def _model(obj: Any) -> Tree:
    """The Tree of a model, or of the parameters an optimizer container holds (a
    TrainState's)."""
    for container in _containers():
        tree = container.model(obj)
        if tree is not None:
            return tree
    return to_neutral(obj)


def _holds_model(obj: Any) -> bool:
    return any(c.model(obj) is not None for c in _containers())


# --- the parts of a state -------------------------------------------------------------


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


@dataclass(frozen=True)
class Params:
    """A per-parameter part: `treedef` over its leaves (MaskedNode as leaves),
    `paths[i]` the Tree path of leaf `i`, `leaves[i]` the array or a MaskedNode."""

    where: str
    cls: str
    treedef: Any
    paths: tuple[Path, ...]
    leaves: tuple[Any, ...]

    def arrays(self) -> dict[Path, Any]:
        return {p: x for p, x in zip(self.paths, self.leaves) if not _is_masked(x)}


class _Index:
    """The parameters of a Tree by every name an optimizer may give them."""

    def __init__(self, tree: Tree):
        flat = jtu.tree_flatten_with_path(tree)[0]
        self.shapes: dict[Path, tuple[int, ...]] = {}
        self.names: dict[Path, Path] = {}
        for (keypath, leaf), role in zip(flat, leaf_roles(tree)):
            if role != "params":
                continue
            path = path_of(keypath)
            self.shapes[path] = tuple(np.shape(leaf))
            for name in (path, ("params", *path), (path_str(path),)):
                self.names[name] = path

    def resolve(self, keypath: Any) -> Path | None:
        return self.names.get(path_of(keypath))


def parts_of(state: Any, tree: Tree) -> dict[str, Any]:
    """The parts of an optimizer state made for `tree`'s parameters, by their path in
    the state (`'[0].mu'`): a `Params` for each per-parameter part, the leaf itself
    for the others. Raises as `port_opt_state` does."""
    return _parts(state, _Index(tree), "opt_state")[0]


def _parts(state: Any, index: _Index, name: str) -> tuple[dict[str, Any], Any]:
    """`({path in the state: part}, treedef)`: the per-parameter parts (`Params`)
    and the other leaves (scalars), in flattening order. Raises for leaves that name
    no parameter and for per-parameter arrays of other shapes than their parameter."""
    mismatch: list[str] = []
    unsupported: list[str] = []
    seen: dict[int, bool] = {}

    def is_part(node: Any) -> bool:
        if _is_masked(node) or node is None or isinstance(node, (tuple, list)):
            return False
        if id(node) in seen:
            return seen[id(node)]
        flat = jtu.tree_flatten_with_path(node, is_leaf=_is_masked)[0]
        found = [index.resolve(p) is not None for p, _ in flat]
        part = (
            bool(flat)
            and any(found)
            and not jtu.treedef_is_leaf(jtu.tree_structure(node))
        )
        if part and not all(found):
            first = next(p for (p, _), ok in zip(flat, found) if not ok)
            mismatch.append(f"{jtu.keystr(first)} (in a {type(node).__name__})")
        seen[id(node)] = part
        return part

    flat, treedef = jtu.tree_flatten_with_path(state, is_leaf=is_part)
    parts: dict[str, Any] = {}
    for keypath, node in flat:
        where = path_str(path_of(keypath))
        parent = _parent(state, keypath)
        if not is_part(node):
            if np.ndim(node) != 0:
                if isinstance(parent, (tuple, list)):
                    unsupported.append(
                        f"{name}{where} is an array of shape {np.shape(node)} in a "
                        f"{type(parent).__name__}, not inside a per-parameter tree"
                    )
                else:
                    mismatch.append(f"{name}{where} (shape {np.shape(node)})")
            parts[where] = node
            continue
        leaves = jtu.tree_flatten_with_path(node, is_leaf=_is_masked)[0]
        paths = tuple(index.resolve(p) or () for p, _ in leaves)
        cls = type(parent).__name__
        for path, (_, leaf) in zip(paths, leaves):
            if path and not _is_masked(leaf) and np.shape(leaf) != index.shapes[path]:
                unsupported.append(
                    f"{name}{where} (in {cls}) holds {np.shape(leaf)} for "
                    f"{path_str(path)}, whose parameter is {index.shapes[path]}"
                )
        parts[where] = Params(
            where,
            cls,
            jtu.tree_structure(node, is_leaf=_is_masked),
            paths,
            tuple(leaf for _, leaf in leaves),
        )
    if mismatch:
        raise ValueError(
            _NOT_THE_SOURCE.format(
                name=name,
                side="source" if name == "opt_state" else "target",
                first=mismatch[0],
                rest="".join(f"\n  also {x}" for x in mismatch[1:]),
            )
        )
    if unsupported:
        raise ValueError(_UNSUPPORTED.format(problems="\n  ".join(unsupported)))
    return parts, treedef


def _parent(state: Any, keypath: tuple) -> Any:
    """The node holding the entry at `keypath` (e.g. the named tuple of a moment)."""
    node = state
    for entry in keypath[:-1]:
        if isinstance(entry, jtu.GetAttrKey):
            node = getattr(node, entry.name)
        elif isinstance(entry, jtu.SequenceKey):
            node = node[entry.idx]
        elif isinstance(entry, jtu.DictKey):
            node = node[entry.key]
    return node


def _check_structure(source: dict[str, Any], like: dict[str, Any]) -> None:
    problems = []
    for where, part in like.items():
        if where not in source:
            problems.append(f"like{where} has no counterpart in opt_state")
            continue
        other = source[where]
        if isinstance(part, Params) != isinstance(other, Params):
            kinds = [
                "per-parameter arrays" if isinstance(x, Params) else "a scalar"
                for x in (other, part)
            ]
            problems.append(
                f"{where} holds {kinds[0]} in opt_state, {kinds[1]} in like"
            )
        elif not isinstance(part, Params) and np.shape(part) != np.shape(other):
            problems.append(
                f"{where} has shape {np.shape(other)} in opt_state, "
                f"{np.shape(part)} in like"
            )
    problems += [
        f"opt_state{w} has no counterpart in like" for w in source if w not in like
    ]
    if problems:
        raise ValueError(_STRUCTURE.format(problems="\n  ".join(problems)))


def _copy(value: Any, like: Any) -> Any:
    """A scalar of the source's state, as a new array of `like`'s dtype."""
    return jnp.array(value, dtype=jnp.result_type(like), copy=True)


# --- porting the per-parameter parts --------------------------------------------------


class _Porter:
    """Ports per-parameter parts from the source Tree to the target Tree.

    Which target entries come from which source entries is found once per pair of
    trainable sets, by porting marks: source entry `i` filled with `1024 + i`
    (exact in float32), the rest zeros. A target element holding a mark came from
    the source (codecs only move elements: transposes, reshapes, splits); one
    holding 0 or a codec's default (a filled bias) starts fresh; a mark found in no
    target entry is a source entry the target does not train."""

    def __init__(self, source: Tree, target: Tree, rules: Any, strict: bool):
        self.trees = source, target
        self.index = _Index(source), _Index(target)
        self.rules, self.strict = rules, strict
        self.marks: dict[tuple, tuple[dict[Path, Any], list[Path]]] = {}
        self.missing: dict[str, None] = {}
        self.unexpected: dict[str, None] = {}

    def part(self, source: Params, like: Params) -> Any:
        have, want = source.arrays(), like.arrays()
        marks, lost = self._marks(tuple(have), tuple(want))
        self.unexpected.update(
            dict.fromkeys(f"{source.where}: {path_str(p)}" for p in lost)
        )
        self.missing.update(
            dict.fromkeys(
                f"{like.where}: {path_str(p)}" for p in want if not bool(marks[p].all())
            )
        )
        moved: dict[Path, Any] = {}
        if have and want:
            dtype = jnp.result_type(*have.values(), *want.values())
            moved = self._port(
                {p: jnp.asarray(x, dtype) for p, x in have.items()},
                {p: jnp.asarray(x, dtype) for p, x in want.items()},
                dtype,
            )
        leaves = [
            leaf
            if _is_masked(leaf)
            else jnp.where(marks[p], moved[p], leaf).astype(jnp.result_type(leaf))
            if p in moved
            else jnp.array(leaf, copy=True)
            for p, leaf in zip(like.paths, like.leaves)
        ]
        return jtu.tree_unflatten(like.treedef, leaves)

    def _marks(self, have: tuple, want: tuple) -> tuple[dict[Path, Any], list[Path]]:
        if (have, want) not in self.marks:
            source = {
                p: jnp.full(self.index[0].shapes[p], _ID0 + i, jnp.float32)
                for i, p in enumerate(have)
            }
            target = {p: jnp.zeros(self.index[1].shapes[p], jnp.float32) for p in want}
            out = self._port(source, target, jnp.float32) if have else target
            found = {float(v) for p in want for v in np.unique(np.asarray(out[p]))}
            lost = [p for i, p in enumerate(have) if _ID0 + i not in found]
            marks = {p: out[p] >= _ID0 for p in want}
            self.marks[have, want] = marks, lost
        return self.marks[have, want]

    def _port(self, source: dict, target: dict, dtype: Any) -> dict[Path, Any]:
        """`bridge.port` of the source Tree holding `source` in place of its
        parameters (zeros where it has none) into the target Tree likewise."""
        trees = []
        for tree, index, values in zip(self.trees, self.index, (source, target)):
            trees.append(
                map_with_path(
                    lambda p, x, index=index, values=values: (
                        values[p]
                        if p in values
                        else jnp.zeros(index.shapes[p], dtype)
                        if p in index.shapes
                        else x
                    ),
                    tree,
                )
            )
        with warnings.catch_warnings():
            # the parameters' port warns about differing hyperparameters already
            warnings.simplefilter("ignore", PortWarning)
            out = port(trees[0], trees[1], rules=self.rules, strict=self.strict)
        leaves = jtu.tree_flatten_with_path(out)[0]
        return {path_of(k): x for k, x in leaves if path_of(k) in target}

    def report(self) -> None:
        if self.unexpected and self.strict:
            raise ValueError(_UNEXPECTED.format(paths=_listing(self.unexpected)))
        if self.missing:
            warnings.warn(
                _MISSING.format(paths=_listing(self.missing)), PortWarning, stacklevel=3
            )


def _listing(paths: Mapping[str, None]) -> str:
    return "".join(f"\n  {p}" for p in paths)
