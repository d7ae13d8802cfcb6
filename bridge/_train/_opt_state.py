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

from .._adapters._native import (
    check_model,
    optimizer_params,
    optimizer_start,
    to_neutral,
)
from .._adapters._registry import Optimizer, adapters
from .._arguments import check_bool, check_opt_state, check_rules, check_step
from .._paths import Path, path_of, path_str
from .._port._errors import PortWarning
from .._port._port import port
from .._tree import Tree, leaf_roles, map_with_path
from . import _torch as torch_opt
from ._torch import is_torch_state


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

_BOTH_TORCH = """\
`opt_state` is a PyTorch optimizer state for a PyTorch target: between two PyTorch
models load the state with `optimizer.load_state_dict`. port_opt_state moves a PyTorch
optimizer state into an optax state (`like`: the target's optax state, or None) or an
optax state into a PyTorch one (`like`: the torch optimizer or its state_dict())."""

_TORCH_LIKE = """\
`target` is a torch.nn.Module: pass `like`, its torch optimizer (or that optimizer's
state_dict()). The state dict port_opt_state gives takes its parameter groups and
settings (learning rate, betas, weight decay) from it, as `optimizer.load_state_dict`
would otherwise replace the optimizer's own with whatever it is given."""

_MOMENTS = """\
`{side}` holds {n} `optax.{cls}` records where one is needed: a PyTorch optimizer's
state fills the one optax record of the same update. {fix}"""

_FIX = """Pass like=None for the state of the optax optimizer that updates as the
PyTorch one does (`optax.adamw(lr, b1, b2, eps, weight_decay=...)`,
`optax.sgd(lr, momentum)`), or a `like` of such an optimizer, possibly inside an
optax.chain."""

_FIX_TORCH = """Train with the optax optimizer that updates as the PyTorch one does
(`optax.adamw` for AdamW, `optax.sgd(lr, momentum)` for SGD with momentum)."""

_ID0 = 1024.0  # source entry i is marked 1024 + i: exact in float32, above defaults


def port_opt_state(
    opt_state: Any,
    source: Any,
    target: Any,
    *,
    like: Any = None,
    step: Any = None,
    tx: Any = None,
    rules: Mapping[str, str] | None = None,
    strict: bool = True,
) -> Any:
    """Convert an optimizer state made for `source`'s parameters into the state for
    `target`'s parameters, whatever their frameworks, PyTorch included.

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

    **PyTorch optimizers.** A `torch.optim.AdamW`, `Adam` or `SGD` (or its
    `state_dict()`) with `source` the `torch.nn.Module` it trains becomes the state of
    the optax optimizer that makes the same updates (`optax.adamw(lr, b1, b2, eps,
    weight_decay=...)`; `optax.sgd(lr, momentum, nesterov)`; a coupled weight decay
    as `optax.chain(optax.add_decayed_weights(w), ...)`): `exp_avg`, `exp_avg_sq`,
    `step` and `momentum_buffer` are `mu`, `nu`, `count` and `trace`. A state dict
    numbers the parameters: the optimizer's tensors are found in `source` by
    identity; a bare state dict indexes `source.parameters()` in order. The other
    way, an optax state with `target` a `torch.nn.Module` and `like` its torch
    optimizer (or `state_dict()`) gives a state dict for `optimizer.load_state_dict`
    (the parameter groups and settings are `like`'s). `amsgrad`, `maximize`,
    dampening and parameter groups with different settings are refused.

    **Arguments:**

    - `opt_state`: the source's optimizer state: an optax state (`tx.init(params)`,
      `step.init(tree)` of `bridge.make_step`), an `nnx.Optimizer`, a Linen
      `flax.training.train_state.TrainState` (its `opt_state` and `step`), or a
      `torch.optim.Optimizer` or its `state_dict()`.
    - `source`: the model the state was made for: anything `bridge.to_neutral`
      takes, or a `TrainState` (its `params`); the `torch.nn.Module` for a PyTorch
      optimizer.
    - `target`: the model the new state is for, in any framework, likewise.
    - `like`: the target's optimizer state as its optimizer makes it, giving the
      structure and the trainable set: `tx.init(eqx.filter(model, eqx.is_array))`,
      `step.init(tree)`, `tx.init(params)`, an `nnx.Optimizer(model, tx, wrt=...)`,
      a `TrainState`, or for a PyTorch target its torch optimizer (or its
      `state_dict()`). Default (None): `target` when it is a `TrainState`, else the
      target framework's usual state built from the source state's structure:
      `tx.init(params)` for Linen, `tx.init(eqx.filter(model, eqx.is_array))` for
      Equinox, and for NNX `nnx.Optimizer(model, tx, wrt=nnx.Param)` when the optax
      optimizer is known (`tx`, the source's `nnx.Optimizer` or `TrainState`, or the
      one a PyTorch optimizer corresponds to), else `tx.init(nnx.state(model,
      nnx.Param))`.
    - `step`: the step count for an `nnx.Optimizer` or `TrainState` result
      (default: the source's, when `opt_state` is one of these or a PyTorch Adam;
      without `like`, also the optax state's `count` when its records agree).
    - `tx`: the optax optimizer the JAX side trains with (default: the one an
      `nnx.Optimizer` or `TrainState` holds). It makes the `nnx.Optimizer` of an
      NNX target without `like`; and with a PyTorch optimizer on the other side,
      its updates are compared with PyTorch's on a probe of a few steps: a
      learning rate, betas, eps or weight decay that changes the updates is
      reported as a `bridge.PortWarning` naming the optax optimizer that matches.
    - `rules`, `strict`: as for `bridge.port` (`strict=False` also leaves out
      entries that the target does not train).

    **Returns:**

    The new state, of `like`'s kind: an optax state, a new `nnx.Optimizer`,
    `like.replace(opt_state=..., step=...)` for a `TrainState`, or a PyTorch
    optimizer state dict (`{"state": ..., "param_groups": ...}`).

    **Raises:**

    `ValueError` naming the first path where `opt_state` does not match the source's
    parameters, the parts of an unsupported optimizer structure, where `like`'s
    structure differs, or what a PyTorch optimizer state has that cannot be ported;
    `TypeError` for a PyTorch optimizer state without its `torch.nn.Module`;
    `bridge.PortError` as `bridge.port`.

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
    if tx is not None and not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            "`tx` must be an optax optimizer (an optax.GradientTransformation such "
            f"as optax.adamw(1e-3)) or None, got a {type(tx).__name__}."
        )
    from_torch, into_torch = is_torch_state(opt_state), is_torch_state(like)
    if from_torch and (into_torch or torch_opt.is_torch_module(target)):
        raise ValueError(_BOTH_TORCH)
    if like is None and torch_opt.is_torch_module(target):
        raise ValueError(_TORCH_LIKE)
    if into_torch:
        return _into_torch(opt_state, source, target, like, step, tx, rules, strict)
    update = None
    if from_torch:
        read = torch_opt.read(opt_state, source, "source")
        update = read.update
        src_state, src_step = torch_opt.to_optax(read)
        src_tree = to_neutral(source)
        _check_update(tx if tx is not None else _tx_of(like), update)
        tx = update.tx()
    else:
        src_state, src_step = unwrap(opt_state)
        check_opt_state(src_state, "opt_state")
        src_tree = _model(source)
        tx = tx if tx is not None else _tx_of(opt_state)
    tgt_tree = _model(target)
    if step is None:
        step = src_step
    if like is None and _holds_model(target):
        like = target
    if like is None:
        like_state = _fresh(src_state, src_tree, tgt_tree, rules, strict)
        started = None if tx is None else optimizer_start(tgt_tree, tx)
        like = like_state if started is None else started
        if started is not None and step is None:
            # the optax count; torch's SGD counts no steps
            step = 0 if from_torch else _count(src_state)
    else:
        like_state, _ = unwrap(like)
        check_opt_state(like_state, "like")
        if update is not None:
            src_state = _relocate(src_state, like_state, update.moments(), step)
    if step is None and _container(like) is not None:
        raise ValueError(_NO_STEP.format(kind=f"an {type(like).__name__}"))
    state, _ = _port_state(src_state, src_tree, like_state, tgt_tree, rules, strict)
    return _wrap(like, state, step)


def _port_state(
    src_state: Any, src_tree: Tree, like_state: Any, tgt_tree: Tree, rules, strict
) -> tuple[Any, _Porter]:
    """The optax state of `like_state`'s structure holding `src_state`'s entries,
    ported from `src_tree`'s parameters to `tgt_tree`'s; and the porter (which
    target entries started fresh)."""
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
    return jtu.tree_unflatten(tgt_def, new), porter


def _count(state: Any) -> Any:
    """The step an optax state has counted (its records' `count`), when they agree;
    else None."""
    counts = set()

    def visit(node: Any) -> None:
        fields = getattr(node, "_fields", None)
        if isinstance(node, tuple) and fields is not None and "count" in fields:
            count = getattr(node, "count")
            if np.ndim(count) == 0:
                counts.add(int(count))
        if isinstance(node, (tuple, list)):
            for x in node:
                visit(x)
        elif isinstance(node, dict):
            for x in node.values():
                visit(x)

    visit(state)
    return counts.pop() if len(counts) == 1 else None


def _tx_of(obj: Any) -> Any:
    """The optax optimizer an optimizer container holds (`nnx.Optimizer.tx`,
    `TrainState.tx`), or None."""
    tx = getattr(obj, "tx", None) if _container(obj) is not None else None
    return tx if isinstance(tx, optax.GradientTransformation) else None


def _check_update(tx: Any, update: torch_opt.Update) -> None:
    if tx is None:
        return
    problem = torch_opt.hyperparameter_problem(tx, update)
    if problem:
        warnings.warn(problem, PortWarning, stacklevel=3)


def _fresh(
    src_state: Any, src_tree: Tree, tgt_tree: Tree, rules: Any, strict: bool
) -> Any:
    """The target's state of the source state's structure, with no `like`: each
    per-parameter part holds the target's parameters in the form its framework's
    optimizers take them (`optimizer_params`), zeros where a source entry arrives
    and `optax.MaskedNode` where none does and the source part masks some; the
    scalars are the source's."""
    form = optimizer_params(tgt_tree)
    index = _Index(tgt_tree)
    parts, treedef = _parts(src_state, _Index(src_tree), "opt_state")
    porter = _Porter(src_tree, tgt_tree, rules, strict)
    every = tuple(index.shapes)
    new = []
    for part in parts.values():
        if not isinstance(part, Params):
            new.append(part)
            continue
        have = part.arrays()
        masks = len(have) < len(part.leaves)
        marks, _ = porter._marks(tuple(have), every)
        dtype = jnp.result_type(*have.values()) if have else jnp.float32

        def entry(keypath: Any, leaf: Any, marks=marks, masks=masks, dtype=dtype):
            path = index.resolve(keypath)
            if path is not None and masks and not bool(marks[path].any()):
                return optax.MaskedNode()
            return jnp.zeros(np.shape(leaf), dtype)

        new.append(jtu.tree_map_with_path(entry, form))
    return jtu.tree_unflatten(treedef, new)


def _relocate(src_state: Any, like_state: Any, moments: Any, step: Any) -> Any:
    """`like_state` with its optimizer record of type `moments` (Adam's moments, a
    momentum trace) replaced by the one `src_state` holds, and its other counts
    set to `step`: the source state in the structure of the target's optimizer
    (`optax.adamw` or a chain around it), for a PyTorch optimizer's state."""
    if moments is None:
        return torch_opt.replace_record(like_state, None, None, step)
    found = torch_opt.records(src_state, moments)
    into = torch_opt.records(like_state, moments)
    if len(into) != 1:
        raise ValueError(
            _MOMENTS.format(cls=moments.__name__, n=len(into), side="like", fix=_FIX)
        )
    return torch_opt.replace_record(like_state, moments, found[0], step)


def _into_torch(
    opt_state: Any,
    source: Any,
    target: Any,
    like: Any,
    step: Any,
    tx: Any,
    rules: Any,
    strict: bool,
) -> dict[str, Any]:
    """An optax state (or container) as a PyTorch optimizer state dict for `target`,
    a torch.nn.Module, with `like`'s parameter groups."""
    read = torch_opt.read(like, target, "target")
    update = read.update
    src_state, src_step = unwrap(opt_state)
    check_opt_state(src_state, "opt_state")
    _check_update(tx if tx is not None else _tx_of(opt_state), update)
    if step is None:
        step = src_step
    src_tree, tgt_tree = _model(source), to_neutral(target)
    like_state = update.tx().init(torch_opt.params_of(read, target))
    moments = update.moments()
    if moments is None:
        return torch_opt.from_optax(read, like_state, set())
    found = torch_opt.records(src_state, moments)
    if len(found) != 1:
        raise ValueError(
            _MOMENTS.format(
                cls=moments.__name__, n=len(found), side="opt_state", fix=_FIX_TORCH
            )
        )
    record = found[0]
    if step is not None and "count" in record._fields:
        record = record._replace(count=jnp.asarray(step, jnp.result_type(record.count)))
    if "count" in record._fields:  # PyTorch's `step` of every entry
        torch_opt.check_count(record.count, f"opt_state's {moments.__name__}.count")
    src_state = torch_opt.replace_record(like_state, moments, record, None)
    state, porter = _port_state(
        src_state, src_tree, like_state, tgt_tree, rules, strict
    )
    fresh = {p.split(": ", 1)[1] for p in porter.missing}
    kept = {path_str(p) for p in _Index(tgt_tree).shapes} - fresh
    return torch_opt.from_optax(read, state, kept)


# --- the containers -------------------------------------------------------------------


def _containers() -> list[Optimizer]:
    return [a.optimizer for a in adapters() if a.optimizer is not None]


def _container(obj: Any) -> Optimizer | None:
    """The adapter hooks of the optimizer container `obj` is, or None."""
    return next((c for c in _containers() if c.unwrap(obj) is not None), None)


def is_container(obj: Any) -> bool:
    """Whether `obj` is a framework's optimizer container (`Adapter.optimizer`)."""
    return _container(obj) is not None


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
        found = self.names.get(path_of(keypath))
        if found is None and keypath and keypath[-1] == _BOXED:
            # a parameter in a box holding its array as `.value` (an NNX Variable
            # of `tx.init(nnx.state(model, nnx.Param))`, a Linen `nn.Partitioned`)
            found = self.names.get(path_of(keypath[:-1]))
        return found


_BOXED = jtu.GetAttrKey("value")


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
