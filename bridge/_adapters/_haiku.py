"""Adapter: Haiku's `params` and `state` dicts (and the transformed function) <->
`bridge.Tree`.

A Haiku model is a transformed function (`hk.transform(f)`,
`hk.transform_with_state(f)`) and plain dicts `{module name: {entry: array}}`. The
dicts alone look like Linen variables and record neither module classes nor call
order, so `bridge.from_haiku` takes the function beside them and, given example
inputs, records each module's class and settings from one abstract forward pass
(`hk.intercept_methods` under `jax.eval_shape`: no FLOPs). haiku itself is imported
only when a transformed function is given: `bridge` works without it.
"""

from __future__ import annotations

import abc
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.tree_util as jtu

from .._paths import Path, is_array, natural, path_str
from .._shown import shown, some
from .._tree import Held, NativeOrder, Tree
from ._build import build, module_nodes, native_leaves, native_order, source_of
from ._registry import Adapter, Optimizer, register_adapter


if TYPE_CHECKING:
    from ._keys import Keys


PARAMS, STATE = "params", "state"

EMA_NAMES = ("mean_ema", "var_ema")
"""The names `hk.BatchNorm` gives its two `hk.ExponentialMovingAverage`s."""
EMA_ENTRIES = frozenset({"counter", "hidden", "average"})
"""An `hk.ExponentialMovingAverage`'s state: `average` is what evaluation reads,
`hidden` (not debiased) and `counter` what training updates."""

_NO_HAIKU = """\
bridge.from_haiku: `fn` is given, but haiku is not installed. Install it with
`pip install "bridge[haiku]"` (dm-haiku)."""

_NOT_DICTS = """\
bridge.from_haiku: `{argument}` must be Haiku's {argument} dict, {{module name:
{{entry: array}}}} as `fn.init` returns it, but {problems}."""

_NOT_TRANSFORMED = """\
bridge.from_haiku: `fn` must be what hk.transform(f) or hk.transform_with_state(f)
returns (an hk.Transformed or hk.TransformedWithState), got {got}."""

_STATE_WITHOUT_STATEFUL = """\
bridge.from_haiku: `state` is given, but `fn` was made by hk.transform, whose apply
takes no state. Make it with hk.transform_with_state(f), or leave `state` out."""

_EXAMPLE_WITHOUT_FN = """\
bridge.from_haiku: `example` inputs are run through the model's function: pass
`fn=` (what hk.transform returned) with them."""

_SAME_PATH = """\
bridge.from_haiku: modules {a} and {b} both read as {path} in a Tree (a `/~/` and a
`/` both nest a module): rename one of them (`name=` in its constructor)."""

_BOTH = """\
bridge.from_haiku: {path} is both an array of `params` and of `state` (module
{module!r}, entry {entry!r}); a Tree holds one array per path: rename one of them."""

_STATE_FORM = """\
This Haiku model has state, so loss_fn is called as `loss_fn(params, state, *batch)`
and must return `(loss, new_state)` (with has_aux=True: `((loss, aux), new_state)`),
the new state being what `fn.apply` returned, with the same modules and entries; it
returned {got}."""

_NO_FN = """\
This Haiku Tree was made from the dicts alone: there is no function to run. Make it
with bridge.from_haiku(params, state, fn=model), model = hk.transform(f), or pass
`(model, params)` / `(model, params, state)`."""


def _haiku() -> Any:
    """haiku, imported (ImportError naming the extra without it)."""
    try:
        return importlib.import_module("haiku")
    except ImportError:
        raise ImportError(_NO_HAIKU) from None


def _is_transformed(obj: Any) -> bool:
    """Whether `obj` is an `hk.Transformed` or `hk.TransformedWithState` (haiku is
    not imported for it: an object of its classes means it is)."""
    hk = sys.modules.get("haiku")
    return hk is not None and isinstance(obj, (hk.Transformed, hk.TransformedWithState))


class HaikuModule(abc.ABC):
    """Stands for `hk.Module` in `Adapter.module_types` without importing haiku:
    `issubclass(cls, HaikuModule)` is whether `cls` is a Haiku module class."""

    @classmethod
    def __subclasshook__(cls, sub: type) -> bool:
        hk = sys.modules.get("haiku")
        return hk is not None and issubclass(sub, hk.Module)


class HaikuRecord(NamedTuple):
    """What `to_haiku` rebuilds the dicts from (a Tree's `Source.record`).

    - `layout`: `((collection, module name, (entry, ...)), ...)`, modules and
      entries sorted (as JAX flattens dicts); the Tree's leaves in that order are
      the native leaves.
    - `orders`: the same in the dicts' own order (no part of equality: the dicts
      before and after an optax step, which sorts them, have one Tree structure).
    - `fn`: the transformed function, or None.
    - `stateful`: whether the model has a state dict (`hk.transform_with_state`,
      or a `state` given): `to_haiku` then gives it.
    - `rng`: whether `fn.apply` takes an `rng` (not `hk.without_apply_rng`).
    - `modules`: `{Tree path: hk.Module}` recorded by the example forward pass (their
      settings: `eps`, `decay_rate`, ...), or None.
    """

    layout: tuple[tuple[str, str, tuple[str, ...]], ...]
    orders: NativeOrder
    fn: Held
    stateful: bool
    rng: bool
    modules: Held


def split_name(name: str) -> Path:
    """A Haiku module name as a Tree path: `"net/~/block_0/conv"` -> `("net",
    "block_0", "conv")` (`/~/` marks a submodule made in its parent's `__init__`,
    `/` one made in a method: both nest it); `"~"`, the parameters a transformed
    function makes outside any module (`hk.get_parameter` at its top), is the
    root `()`."""
    if name == "~":
        return ()
    parts = tuple(p for p in name.split("/") if p not in ("", "~"))
    return parts or (name,)


def from_haiku(
    params: Mapping[str, Mapping[str, Any]],
    state: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    fn: Any = None,
    example: Any = None,
) -> Tree:
    """Convert Haiku's `params` (and `state`) to a `bridge.Tree`, without copying.

    Module names become nested nodes, `/~/` and `/` alike:
    `"res_net18/~/block_group_0/~/block_0/~/conv_0"`'s `w` is
    `t.res_net18.block_group_0.block_0.conv_0.w`; the names are recorded, so
    `bridge.to_native` gives the very dicts back. Roles: `params` entries are
    `"params"`; an `hk.BatchNorm`'s moving averages (`<bn>/~/mean_ema`, `var_ema`:
    `average`, `hidden`, `counter`) are `"batch_stats"` (evaluation reads `average`;
    a port writes `hidden` and `counter` to match it); any other state is `"state"`.
    The Tree's children come in natural key order, so the dicts have the same Tree
    structure before and after an optax step (which sorts them).

    **Arguments:**

    - `params`: what `fn.init` returns (with state: its first dict). Not modified.
    - `state`: optional, the state dict of `hk.transform_with_state`.
    - `fn`: optional, the transformed function (`hk.transform(f)`,
      `hk.transform_with_state(f)`, `hk.without_apply_rng(...)`). With it
      `bridge.to_native` gives `(fn, params)` or `(fn, params, state)`, which
      `bridge.compare`, `bridge.port`'s traces and `bridge.as_nnx` run.
    - `example`: optional, with `fn`: the positional arguments of one call (a tuple,
      or one array; arrays or `jax.ShapeDtypeStruct`s), e.g. `(x, False)` for
      `f(x, is_training)`. One abstract forward pass records every module's class and
      settings: the Tree's nodes carry their classes, and `bridge.port` reads each
      layer's kind and settings from them.

    **Returns:**

    A `bridge.Tree`; `bridge.to_native` gives the dicts back: `params`, or
    `(params, state)`, preceded by `fn` when it was given.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, haiku as hk, bridge
    >>> model = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([4, 2])(x)))
    >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> t = bridge.from_haiku(params, fn=model, example=jnp.ones((1, 3)))
    >>> t.mlp.linear_1.w.shape, bridge.roles(t).mlp.linear_1.w
    ((4, 2), 'params')
    >>> fn, again = bridge.to_native(t)
    >>> again["mlp/~/linear_1"]["w"] is params["mlp/~/linear_1"]["w"]
    True

    ```
    """
    problems = _dict_problems(params, "params")
    if problems:
        raise TypeError(_NOT_DICTS.format(argument="params", problems=problems))
    if state is not None:
        problems = _dict_problems(state, "state")
        if problems:
            raise TypeError(_NOT_DICTS.format(argument="state", problems=problems))
    stateful, rng = state is not None, False
    if fn is not None:
        hk = _haiku()
        if not isinstance(fn, (hk.Transformed, hk.TransformedWithState)):
            raise TypeError(_NOT_TRANSFORMED.format(got=type(fn).__name__))
        with_state = isinstance(fn, hk.TransformedWithState)
        if stateful and not with_state:
            raise TypeError(_STATE_WITHOUT_STATEFUL)
        stateful = with_state
        rng = _takes_rng(fn)
    elif example is not None:
        raise TypeError(_EXAMPLE_WITHOUT_FN)
    state = {} if state is None else state
    modules: dict[Path, Any] | None = None
    if example is not None:
        args = example if isinstance(example, tuple) else (example,)
        called = _called(fn, rng, params, state if stateful else None, args)
        modules = {split_name(name): module for name, module in called.items()}
    return _build(params, state, stateful, fn, rng, modules)


def _dict_problems(obj: Any, argument: str) -> str:
    """What keeps `obj` from being a Haiku dict (empty: nothing)."""
    if not isinstance(obj, Mapping):
        return f"got a {type(obj).__name__}"
    bad = []
    for name, entries in obj.items():
        if not isinstance(name, str):
            bad.append(f"the key {shown(name)} is not a module name (a str)")
        elif not isinstance(entries, Mapping):
            bad.append(f"{shown(name)} holds a {type(entries).__name__}, not a dict")
        else:
            bad += [
                f"{shown(name)}[{shown(k)}] is a {type(v).__name__}, not an array"
                for k, v in entries.items()
                if not (isinstance(k, str) and is_array(v))
            ]
    return some(bad, show=str) if bad else ""


def _takes_rng(fn: Any) -> bool:
    """Whether `fn.apply` takes an `rng` after its dicts (hk.without_apply_rng's
    does not: its signature says so)."""
    try:
        names = list(inspect.signature(fn.apply).parameters)
    except (TypeError, ValueError):
        return True
    hk = sys.modules["haiku"]
    at = 2 if isinstance(fn, hk.TransformedWithState) else 1
    return len(names) > at and names[at] == "rng"


def _build(
    params: Mapping[str, Mapping[str, Any]],
    state: Mapping[str, Mapping[str, Any]],
    stateful: bool,
    fn: Any,
    rng: bool,
    modules: dict[Path, Any] | None,
    kinds: dict[Path, Any] | None = None,
) -> Tree:
    layout: list[tuple[str, str, tuple[str, ...]]] = []
    orders: list[tuple[str, str, tuple[str, ...]]] = []
    entries: list[tuple[Path, str, Any, int]] = []
    in_order: list[Path] = []  # the leaves' paths in the dicts' order
    named: dict[Path, str] = {}
    seen: set[Path] = set()
    for collection, dicts in ((PARAMS, params), (STATE, state)):
        for name, values in dicts.items():
            at = split_name(name)
            other = named.setdefault(at, name)
            if other != name:
                raise ValueError(
                    _SAME_PATH.format(a=shown(other), b=shown(name), path=path_str(at))
                )
            orders.append((collection, name, tuple(values)))
            in_order += [at + (entry,) for entry in values]
        for name in sorted(dicts):
            values, at = dicts[name], split_name(name)
            role = PARAMS if collection == PARAMS else _state_role(at, values)
            layout.append((collection, name, tuple(sorted(values))))
            for entry in sorted(values):
                path = at + (entry,)
                if path in seen:
                    raise ValueError(
                        _BOTH.format(path=path_str(path), module=name, entry=entry)
                    )
                seen.add(path)
                entries.append((path, role, values[entry], len(entries)))
    entries.sort(key=lambda e: tuple(map(natural, e[0])))
    kinds = dict(kinds or {})
    if modules is not None:
        kinds.update({path: type(module) for path, module in modules.items()})
    record = HaikuRecord(
        tuple(layout),
        NativeOrder(tuple(orders)),
        Held(fn),
        stateful,
        rng,
        Held(modules),
    )
    return build(entries, kinds, "haiku", record, native_order(in_order))


def _state_role(at: Path, values: Mapping[str, Any]) -> str:
    """`batch_stats` for an `hk.BatchNorm`'s moving averages, else `state`."""
    if at[-1] in EMA_NAMES and set(values) == EMA_ENTRIES:
        return "batch_stats"
    return STATE


def _called(
    fn: Any, rng: bool, params: Any, state: Any, args: tuple[Any, ...]
) -> dict[str, Any]:
    """`{module name: module}` of every module one abstract forward pass calls."""
    hk = _haiku()
    seen: dict[str, Any] = {}

    def record(method: Callable, a: Any, k: Any, context: Any) -> Any:
        out = method(*a, **k)
        name = getattr(context.module, "module_name", None)
        if name is not None:
            seen.setdefault(name, context.module)
        return out

    with hk.intercept_methods(record):
        _abstract(lambda: None, fn, rng, params, state, args, {})
    return seen


def _abstract(
    around: Callable[[], Any],
    fn: Any,
    rng: bool,
    params: Any,
    state: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Any:
    """`fn.apply` on `args` under `jax.eval_shape`: arrays stand in as shapes, the
    other arguments (flags such as `is_training`) are passed as they are."""
    leaves, treedef = jtu.tree_flatten((params, state, args, dict(kwargs)))
    arrays = [i for i, x in enumerate(leaves) if is_array(x)]

    def run(given: list[Any]) -> Any:
        xs = list(leaves)
        for i, x in zip(arrays, given):
            xs[i] = x
        p, s, a, k = jtu.tree_unflatten(treedef, xs)
        key = jax.random.key(0) if rng else None
        return _apply(fn, rng, p, s, key, a, k)

    structs = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in arrays]
    return jax.eval_shape(run, structs)


def _apply(
    fn: Any, rng: bool, params: Any, state: Any, key: Any, args: tuple, kwargs: Any
) -> Any:
    """`fn.apply(params[, state][, key], *args, **kwargs)`, as `fn` takes them."""
    lead = (params,) if state is None else (params, state)
    if rng:
        lead += (key,)
    return fn.apply(*lead, *args, **kwargs)


def to_haiku(tree: Tree) -> Any:
    """Rebuild the Haiku dicts of a `bridge.Tree` made by `bridge.from_haiku`.

    **Arguments:**

    - `tree`: a `bridge.Tree` from `bridge.from_haiku`, with the same leaf paths.

    **Returns:**

    `params`, or `(params, state)` for a model with state; preceded by the
    transformed function when the Tree was made with one: `(fn, params)`, `(fn,
    params, state)`. The dicts are new, in the source's order; their arrays are the
    Tree's leaves (not copied).
    """
    params, state = dicts(tree)
    record = source_of(tree, "haiku", HaikuRecord).record
    native = (params, state) if record.stateful else (params,)
    fn = record.fn.value
    if fn is not None:
        return (fn, *native)
    return native[0] if len(native) == 1 else native


def dicts(tree: Tree) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """`(params, state)` of a Haiku Tree (state `{}` without one)."""
    src, leaves = native_leaves(tree, "haiku", HaikuRecord)
    found: dict[tuple[str, str], dict[str, Any]] = {}
    at = 0
    for collection, name, names in src.record.layout:
        found[(collection, name)] = dict(zip(names, leaves[at : at + len(names)]))
        at += len(names)
    out: dict[str, dict[str, dict[str, Any]]] = {PARAMS: {}, STATE: {}}
    for collection, name, names in src.record.orders.value:  # the dicts' order
        values = found[(collection, name)]
        out[collection][name] = {entry: values[entry] for entry in names}
    return out[PARAMS], out[STATE]


def _with_state(tree: Tree, state: Mapping[str, Mapping[str, Any]]) -> Tree:
    """`tree` with the state arrays of `state` (same modules and entries), for the
    Tree after a forward pass."""
    src = source_of(tree, "haiku", HaikuRecord)
    leaves, treedef = jtu.tree_flatten(tree)
    native: list[Any] = [None] * len(leaves)
    for leaf, pos in zip(leaves, src.order):
        native[pos] = leaf
    at = 0
    for collection, name, names in src.record.layout:
        if collection == STATE:
            for k, entry in enumerate(names):
                native[at + k] = state[name][entry]
        at += len(names)
    return jtu.tree_unflatten(treedef, [native[pos] for pos in src.order])


def _same_form(state: Any, record: HaikuRecord) -> bool:
    """Whether `state` has the modules and entries of the record's state."""
    if not isinstance(state, Mapping):
        return False
    want = {name: set(names) for c, name, names in record.layout if c == STATE}
    return set(state) == set(want) and all(
        isinstance(state[n], Mapping) and set(state[n]) == e for n, e in want.items()
    )


# --- the adapter record -------------------------------------------------------------


def _is_native(obj: Any) -> bool:
    """`(fn, params)` or `(fn, params, state)`, `fn` a transformed function."""
    return (
        isinstance(obj, tuple)
        and len(obj) in (2, 3)
        and _is_transformed(obj[0])
        and all(isinstance(x, Mapping) for x in obj[1:])
    )


def _to_tree(obj: Any) -> Tree:
    fn, params, *state = obj
    return from_haiku(params, state[0] if state else None, fn=fn)


def _record(tree: Tree) -> HaikuRecord:
    return source_of(tree, "haiku", HaikuRecord).record


def _forward(
    tree: Tree, loss_fn: Callable[..., Any], batch: tuple, rngs: Any
) -> tuple[Any, Tree | None]:
    """`loss_fn(params, *batch)`; with state `loss_fn(params, state, *batch) ->
    (loss, new_state)` (Equinox's convention), the new state put in the Tree."""
    record = _record(tree)
    params, state = dicts(tree)
    if not record.stateful:
        return loss_fn(params, *batch), None
    result = loss_fn(params, state, *batch)
    if not (
        isinstance(result, tuple) and len(result) == 2 and _same_form(result[1], record)
    ):
        raise TypeError(_STATE_FORM.format(got=_describe(result)))
    return result[0], _with_state(tree, result[1])


def _describe(result: Any) -> str:
    if isinstance(result, tuple):
        return f"a tuple ({', '.join(type(x).__name__ for x in result)})"
    return f"a {type(result).__name__}"


def _run(model: Any, key: Any, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """`fn.apply` of a native `(fn, params[, state])` on `args`: `(out, state)` or
    `out`."""
    if not _is_native(model):
        raise TypeError(_NO_FN)
    fn, params, *state = model
    stateful = isinstance(fn, sys.modules["haiku"].TransformedWithState)
    state = (state[0] if state else {}) if stateful else None
    return _apply(fn, _takes_rng(fn), params, state, key, args, kwargs)


def _infer(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`fn.apply(params[, state], None, *inputs, **kwargs)`, the output alone (a
    model's flags, `is_training=False`, are keyword arguments of the call)."""
    out = _run(model, None, inputs, kwargs)
    return out[0] if _stateful(model) else out


def _stateful(model: Any) -> bool:
    return isinstance(model[0], sys.modules["haiku"].TransformedWithState)


def _embed(
    tree: Tree, args: tuple, kwargs: dict[str, Any], keys: Keys, inference: Any
) -> tuple[Any, Tree | None, tuple[str, ...]]:
    """A call inside a wrapper: `fn.apply` with the caller's one key as `rng`; the
    mode is an argument of the call (`is_training`), as for Linen."""
    record = _record(tree)
    if record.fn.value is None:
        raise TypeError(_NO_FN)
    params, state = dicts(tree)
    fn = record.fn.value
    native = (fn, params, state) if record.stateful else (fn, params)
    key = keys.one() if record.rng else None
    out = _run(native, key, args, kwargs)
    if not record.stateful:
        return out, None, ()
    return out[0], _with_state(tree, out[1]), ()


def _modules(tree: Tree) -> Any:
    """The recorded modules by Tree path (`Adapter.modules`); None without them."""
    modules = _record(tree).modules.value
    return None if not modules else module_nodes(list(modules.items()))


def _called_modules(run: Callable[[], Any]) -> tuple[Any, dict[tuple, Any]]:
    """`run()` with every Haiku module it calls recorded by Tree path."""
    seen: dict[tuple, Any] = {}
    hk = sys.modules.get("haiku")
    if hk is None:
        return run(), seen

    def record(method: Callable, a: Any, k: Any, context: Any) -> Any:
        out = method(*a, **k)
        name = getattr(context.module, "module_name", None)
        if name is not None:
            seen.setdefault(split_name(name), context.module)
        return out

    with hk.intercept_methods(record):
        out = run()
    return out, seen


def _optimizer_params(tree: Tree) -> Any:
    return dicts(tree)[0]


def _from_file(
    tensors: list[tuple[str, Path, str, Any]],
    modules: dict[Path, tuple[str, dict[str, Any]]],
    kinds: dict[Path, Any],
    empty: list[tuple[str, Path]],
) -> Tree:
    """The Tree of a Haiku checkpoint read without the model: its dicts, each
    module named by its path joined with `/` (the file records paths, not whether
    Haiku nested a module with `/~/`), `params` and the other roles' `state`; the
    recorded classes on its nodes."""
    params: dict[str, dict[str, Any]] = {}
    state: dict[str, dict[str, Any]] = {}
    for _, path, role, array in tensors:
        name = "/".join(map(str, path[:-1])) or "~"
        (params if role == PARAMS else state).setdefault(name, {})[str(path[-1])] = (
            array
        )
    return _build(params, state, bool(state), None, False, None, kinds)


ADAPTER = register_adapter(
    Adapter(
        name="haiku",
        display="Haiku",
        recognise=_is_native,
        to_tree=_to_tree,
        to_native=to_haiku,
        module_types=(HaikuModule,),
        layout="haiku",
        forward=_forward,
        infer=_infer,
        rngs_hint="A Haiku model takes its key as `fn.apply`'s `rng`: pass it as a "
        "batch argument, `step(tree, opt_state, x, key)`, and give it to `fn.apply` "
        "in loss_fn.",
        modules=_modules,
        records_classes=False,
        called=_called_modules,
        embed=_embed,
        from_file=_from_file,
        optimizer=Optimizer(
            lambda obj: None, lambda like, state, step: state, params=_optimizer_params
        ),
    )
)
