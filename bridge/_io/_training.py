"""Training checkpoints: the optimizer state, the step and extra arrays saved next to
the model, and restored into a model and optimizer of any framework.

The optimizer's arrays are stored as ordinary tensors of role `opt_state` under the
prefix `opt_state.` (`opt_state.0.mu.layers.0.kernel`), extra arrays as role `extra`
under `extra.`. The state's structure is recorded as JSON in the metadata key
`training`, never pickled: tuples, lists, dicts, `None`, named tuples by class name
and fields, and each per-parameter part as the list of its leaves' model paths (with
`null` for an `optax.MaskedNode`). On load a named tuple becomes its class only when
the name is in the allow-list of optax's state classes (every named tuple that an
imported `optax` module defines, looked up by exact name: never an attribute walk,
which could reach other modules' classes through optax's imports); otherwise it is a
dict of its fields, which matches the same paths. A per-parameter part comes back as a
dict keyed by model path (the form of `bridge.make_step`), and `bridge.port_opt_state`
puts it into the form of the optimizer state given as `opt_state_like`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._arguments import check_opt_state
from .._paths import Path, path_str
from .._shown import some
from .._train._opt_state import (
    Params,
    is_container,
    parts_of,
    port_opt_state,
    unwrap,
)
from .._tree import Tree
from ._contents import Stored, dotted, is_key
from ._errors import CheckpointError
from ._read import read


KEY = "training"
OPT, EXTRA = "opt_state", "extra"

_UNSUPPORTED_NODE = """\
Cannot record the optimizer state: opt_state{where} is a {cls}, which bridge does not
store. A training checkpoint stores optax states: tuples, named tuples, dicts, None
and arrays, with one tree of arrays per parameter (Adam's moments)."""

_NO_OPT_STATE = """\
{path} holds no optimizer state, but `opt_state_like` was given. It was saved with
bridge.save(path, model) (not bridge.save_training): load the model alone, and start the
optimizer fresh with its `init`."""

_MALFORMED = """\
{path}: its 'training' metadata does not describe an optimizer state ({reason}). The
file may be damaged; load the model alone (without `opt_state_like`)."""

_TRAINING_IN_TORCH = """\
{path}: a PyTorch-layout export writes a model's arrays only (a PyTorch state dict:
weights, biases, running statistics), but it holds a training state: {found}.
Export the model alone (`bridge.save_pretrained(folder, model)`), and save the
training state in bridge's layout: `bridge.save_training("ckpt.safetensors", model,
opt_state, step=...)`."""

_TRAINING_AS_MODEL = """\
{path}: the model to save is or holds a training state: {found}.
Pass the model alone and its optimizer as `opt_state`: `bridge.save_training(path,
model, optimizer, step=...)` (an `nnx.Optimizer`, a `TrainState` or an optax
state)."""

_TAKEN = """\
The model has a top-level entry named {name!r}, which a training checkpoint uses for
its own arrays. Save the model alone, or rename that entry."""


class TrainingState(NamedTuple):
    """What `bridge.load(path, like=model, opt_state_like=...)` returns."""

    model: Any
    opt_state: Any
    step: int | None
    extra: dict[str, Any]


def add(
    contents: Any,
    arrays: dict[str, Any],
    tree: Tree,
    opt_state: Any,
    step: Any,
    extra: Mapping[str, Any] | None,
) -> tuple[Any, dict[str, Any]]:
    """`contents` and `arrays` with the training state added."""
    for s in contents.tensors:
        if s.path[:1] in ((OPT,), (EXTRA,)):
            raise ValueError(_TAKEN.format(name=s.path[0]))
    arrays = dict(arrays)
    stored = []

    def put(path: Path, role: str, value: Any) -> str:
        name = dotted(path)
        impl = None
        if is_key(value):
            impl = str(jax.random.key_impl(value))
            value = jax.random.key_data(value)
        value = value if hasattr(value, "dtype") else jnp.asarray(value)
        arrays[name] = value
        stored.append(
            Stored(name, path, role, tuple(value.shape), str(value.dtype), impl)
        )
        return name

    record: dict[str, Any] = {"step": None if step is None else int(step)}
    if opt_state is not None:
        state, own_step = unwrap(opt_state)
        check_opt_state(state, "opt_state")
        if step is None and own_step is not None:
            record["step"] = int(own_step)
        parts = parts_of(state, tree)
        record[OPT] = _record(state, (), parts, put)
    record[EXTRA] = [put((EXTRA, k), EXTRA, v) for k, v in (extra or {}).items()]
    training = json.dumps(record)
    tensors = contents.tensors + tuple(stored)
    return dataclasses.replace(contents, tensors=tensors, training=training), arrays


def refuse_training_state(
    path: Any, obj: Any, torch_layout: bool, argument: str = "obj"
) -> None:
    """Raise `ValueError` when `obj`, given to `save` as the model, is or holds a
    training state (an optimizer container such as `nnx.Optimizer` or
    `TrainState`, an optax state; for `layout="torch"` also a Linen `opt_state`
    collection), naming the first few and where they are (in `argument`, the
    name `obj` was given as). `save` asks before
    `layout="torch"`, else once `obj` is not a model it can read."""

    def training(x: Any) -> bool:
        return is_container(x) or _is_optax_state(x)

    found = []
    flat = jax.tree_util.tree_flatten_with_path(obj, is_leaf=training)[0]
    for where, x in flat:
        if training(x):
            where = jax.tree_util.keystr(where)
            found.append(f"{type(x).__name__} at {argument}{where}")
    variables = obj[1] if isinstance(obj, tuple) and len(obj) == 2 else obj
    if torch_layout and isinstance(variables, Mapping) and OPT in variables:
        found.append(f"the collection {OPT!r}")
    if found:
        message = _TRAINING_IN_TORCH if torch_layout else _TRAINING_AS_MODEL
        raise ValueError(message.format(path=path, found=some(found, 3, str)))


def _is_optax_state(x: Any) -> bool:
    """An optax state node: a named tuple (or `EmptyState`) defined by optax."""
    return isinstance(x, tuple) and type(x).__module__.split(".")[0] == "optax"


def _record(node: Any, where: Path, parts: Mapping[str, Any], put: Any) -> Any:
    """The JSON record of one node of an optimizer state (arrays stored by `put`)."""
    part = parts.get(path_str(where))
    if isinstance(part, Params):
        return {
            "t": "params",
            "leaves": [
                [list(p), None if _masked(x) else put((OPT, *where, *p), OPT, x)]
                for p, x in zip(part.paths, part.leaves)
            ],
        }
    if node is None:
        return {"t": "none"}
    if _masked(node):
        return {"t": "masked"}
    fields = getattr(node, "_fields", None)
    if isinstance(node, tuple) and fields is not None:
        cls = type(node)
        return {
            "t": "namedtuple",
            "cls": f"{cls.__module__}:{cls.__qualname__}",
            "fields": list(fields),
            "c": [_record(x, (*where, f), parts, put) for f, x in zip(fields, node)],
        }
    if isinstance(node, (tuple, list)):
        return {
            "t": type(node).__name__,
            "c": [_record(x, (*where, i), parts, put) for i, x in enumerate(node)],
        }
    if isinstance(node, Mapping) and all(isinstance(k, (str, int)) for k in node):
        keys = list(node)
        return {
            "t": "dict",
            "k": keys,
            "c": [_record(node[k], (*where, k), parts, put) for k in keys],
        }
    if hasattr(node, "dtype") or isinstance(node, (int, float)):
        return {"t": "array", "name": put((OPT, *where), OPT, node)}
    raise TypeError(
        _UNSUPPORTED_NODE.format(where=path_str(where), cls=type(node).__name__)
    )


def _masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


# --- loading --------------------------------------------------------------------------


def split(contents: Any) -> tuple[Any, Any]:
    """`(the model's contents, the training tensors' contents)`."""
    model = tuple(s for s in contents.tensors if s.role not in (OPT, EXTRA))
    rest = tuple(s for s in contents.tensors if s.role in (OPT, EXTRA))
    return (
        dataclasses.replace(contents, tensors=model),
        dataclasses.replace(contents, tensors=rest),
    )


def read_state(contents: Any, training: Any) -> tuple[Any, int | None, dict]:
    """`(opt_state, step, extra)` as stored: the optimizer state rebuilt from its
    record, each per-parameter part a dict keyed by the file's model paths.

    Raises `ValueError` naming the file when it holds no optimizer state or its
    record is malformed."""
    record = _json(contents.training, contents.path)
    if OPT not in record:
        raise ValueError(_NO_OPT_STATE.format(path=contents.path))
    arrays = read(training)
    shapes = {
        tuple(s.path): tuple(s.logical[0])
        for s in contents.tensors
        if s.role not in (OPT, EXTRA)
    }
    try:
        state = _build(record[OPT], _Reading(arrays, shapes))
        step = record.get("step")
        if step is not None and not (_integer(step) and 0 <= step < 2**31):
            raise ValueError(f"step {_shown(step)} is not a whole number 0..2**31 - 1")
        names = record.get(EXTRA, [])
        if not isinstance(names, list):
            raise TypeError(f"extra is {_shown(names)}, not a list of names")
        extra = {n.partition(".")[2]: _array(n, arrays) for n in names}
    except (
        KeyError,
        TypeError,
        ValueError,
        IndexError,
        AttributeError,
        RecursionError,
    ) as e:
        reason = str(e)[:300]
        raise CheckpointError(
            _MALFORMED.format(path=contents.path, reason=reason)
        ) from None
    return state, step, extra


def restore(
    saved: tuple[Any, int | None, dict], source: Tree, target: Any, like: Any
) -> TrainingState:
    """The loaded training state: the stored optimizer state, made for the
    parameters of `source` (the file's model), ported into the form of `like` for
    `target` (the loaded model)."""
    state, step, extra = saved
    ported = port_opt_state(state, source, target, like=like, step=step)
    return TrainingState(target, ported, step, extra)


def _json(text: str, path: Any) -> dict:
    try:
        record = json.loads(text or "{}")
    except (ValueError, RecursionError) as e:  # ValueError: an int of 5,000 digits
        reason = f"{type(e).__name__}: {str(e)[:200]}"
        raise CheckpointError(_MALFORMED.format(path=path, reason=reason)) from None
    if not isinstance(record, dict):
        raise CheckpointError(_MALFORMED.format(path=path, reason="not a JSON object"))
    return record


class _Reading(NamedTuple):
    """What a recorded state is checked against: the training arrays by name, and
    the shape of each leaf of the file's model by path."""

    arrays: Mapping[str, Any]
    shapes: Mapping[tuple, tuple[int, ...]]


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _array(name: Any, arrays: Mapping[str, Any]) -> Any:
    if not isinstance(name, str) or name not in arrays:
        raise KeyError(f"it names an array {_shown(name)} the file does not hold")
    return arrays[name]


def _leaf_path(p: Any, shapes: Mapping[tuple, tuple[int, ...]]) -> tuple:
    if not (isinstance(p, list) and all(isinstance(k, str) or _integer(k) for k in p)):
        raise TypeError(f"a leaf path is {_shown(p)}, not a list of names and indexes")
    path = tuple(p)
    if path not in shapes:
        raise KeyError(f"a leaf names {path_str(path)!r}, which the file's model lacks")
    return path


def _build(rec: Any, reading: _Reading, field: str = "") -> Any:
    """The optimizer state node recorded as `rec` (`field`: its name in a named
    tuple), checked: each array one the file holds, each per-parameter leaf a
    parameter of the file's model of its shape, a `count` a scalar."""
    if not isinstance(rec, Mapping):
        raise TypeError(f"a node is {_shown(rec)}, not an object")
    arrays = reading.arrays
    kind = rec["t"]
    if kind == "none":
        return None
    if kind == "masked":
        return optax.MaskedNode()
    if kind == "array":
        array = _array(rec["name"], arrays)
        if field == "count" and len(getattr(array, "shape", ())) != 0:
            shape = tuple(array.shape)
            raise ValueError(f"count {rec['name']} has shape {shape}, not a scalar")
        return array
    if kind == "params":
        out = {}
        for p, name in rec["leaves"]:
            path = _leaf_path(p, reading.shapes)
            key = path_str(path)
            if key in out:
                raise ValueError(f"two leaves name {key!r}")
            if name is None:
                out[key] = optax.MaskedNode()
                continue
            array = _array(name, arrays)
            want = reading.shapes[path]
            if tuple(getattr(array, "shape", ())) != want:
                shape = tuple(getattr(array, "shape", ()))
                raise ValueError(
                    f"{name} has shape {shape}, its parameter {key} {want}"
                )
            out[key] = array
        return out
    names = rec.get("fields") or rec.get("k") or []
    children = rec["c"]
    if not isinstance(children, list) or not isinstance(names, list):
        raise TypeError(f"a {kind} node's children are {_shown(children)}")
    if kind in ("namedtuple", "dict") and len(names) != len(children):
        raise ValueError(
            f"a {kind} node has {len(names)} names, {len(children)} children"
        )
    built = [
        _build(c, reading, str(names[i]) if kind == "namedtuple" else "")
        for i, c in enumerate(children)
    ]
    if kind == "namedtuple":
        cls = _optax_class(rec["cls"], names)
        return cls(*built) if cls else dict(zip(names, built))
    if kind == "tuple":
        return tuple(built)
    if kind == "list":
        return built
    if kind == "dict":
        return dict(zip(names, built))
    raise ValueError(f"unknown node {_shown(kind)} in the recorded optimizer state")


def _optax_class(name: str, fields: list[str]) -> type | None:
    """The optax named tuple class recorded as `module:qualname`, if it is in the
    allow-list and has these fields; else None."""
    cls = _optax_classes(len(sys.modules)).get(name)
    if cls is not None and tuple(cls.__dict__["_fields"]) == tuple(fields):
        return cls
    return None


@functools.lru_cache(maxsize=1)
def _optax_classes(modules: int) -> dict[str, type]:
    """The allow-list: `{"module:qualname": class}` of every named tuple class defined
    by an imported `optax` module (`optax._src.transform:ScaleByAdamState`), read
    from the modules' `__dict__`s (no attribute hook runs). `modules`, the number of
    imported modules, renews it when more are imported."""
    found: dict[str, type] = {}
    for module_name, module in list(sys.modules.items()):
        if module_name != "optax" and not module_name.startswith("optax."):
            continue
        for value in list(getattr(module, "__dict__", {}).values()):
            if not isinstance(value, type) or not issubclass(value, tuple):
                continue
            home = value.__dict__.get("__module__", "")
            if "_fields" in value.__dict__ and home == module_name:
                found[f"{home}:{value.__qualname__}"] = value
    return found


# --- inspect --------------------------------------------------------------------------


def summary(contents: Any, human: Callable[[int], str]) -> list[str]:
    """Lines describing a checkpoint's training state: the step, each part of the
    optimizer state with its arrays and size (`human` writes sizes), the extras."""
    if not contents.training:
        return []
    try:
        record = _json(contents.training, contents.path)
        return _summary(record, {s.key: s.nbytes for s in contents.tensors}, human)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return [f"training state: unreadable ({e})"]


def _summary(
    record: dict, sizes: Mapping[str, int], human: Callable[[int], str]
) -> list[str]:
    lines = []
    if record.get("step") is not None:
        lines.append(f"step: {record['step']}")
    if OPT in record:
        parts = list(_parts(record[OPT], "", "", sizes))
        total = sum(n for _, _, n in parts)
        lines.append(f"optimizer state: {len(parts)} parts, {human(total)}")
        lines += [
            f"  {where or '(root)'}: {what}, {human(n)}" for where, what, n in parts
        ]
    if record.get(EXTRA):
        total = sum(sizes[n] for n in record[EXTRA])
        names = ", ".join(n.partition(".")[2] for n in record[EXTRA])
        lines.append(f"extra: {names}, {human(total)}")
    return lines


def _parts(rec: Mapping[str, Any], where: str, owner: str, sizes: Mapping[str, int]):
    """`(path, what, bytes)` of each part of a recorded optimizer state."""
    kind = rec["t"]
    of = f" of {owner}" if owner else ""
    if kind == "params":
        names = [n for _, n in rec["leaves"] if n is not None]
        masked = len(rec["leaves"]) - len(names)
        note = f" ({masked} masked)" if masked else ""
        yield where, f"{len(names)} arrays{note}{of}", sum(sizes[n] for n in names)
    elif kind == "array":
        yield where, f"scalar{of}", sizes[rec["name"]]
    elif kind in ("namedtuple", "tuple", "list", "dict"):
        keys = rec.get("fields") or rec.get("k") or range(len(rec["c"]))
        cls = rec["cls"].rpartition(":")[2] if kind == "namedtuple" else ""
        for key, child in zip(keys, rec["c"]):
            yield from _parts(child, where + path_str((key,)), cls, sizes)
