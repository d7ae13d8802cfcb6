"""Adapter: PyTorch-layout state dicts (and `torch.nn.Module`s) <-> `bridge.Tree`.

A state dict is a flat mapping of dotted names (`encoder.layer.0.attention.self.query.
weight`) to arrays: numpy arrays, or `torch.Tensor`s when torch is installed. The Tree
splits the names at the dots (`t.encoder.layer[0].attention.self.query.weight`), keeps
the arrays (torch tensors become numpy views of the same memory, bfloat16 and float8
through `ml_dtypes`), and records what `to_torch` needs to give the same state dict
back: the names in order, a stripped prefix, fused weights that were split, and tied
names that share one array. torch itself is optional: it is imported only when a
tensor or a module is given, or tensors are asked for.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import itertools
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from .._arguments import check_bool, check_names, check_pattern, check_str, type_error
from .._families import _experts
from .._families._gpt2 import CONV1D_CLASS, CONV1D_NAMES, named_class
from .._families._tied_heads import folder_head
from .._gc import paused
from .._paths import Path, parse
from .._shown import shown
from .._tree import Held, Key, Source, Tree, items, kind, walk
from .._uses import Untraced, Uses
from . import _torch_folder, _torch_real, _torch_trace
from ._build import build, native_leaves, source_of
from ._registry import APART, Adapter, LayoutWriter, register_adapter


ROLE_OF = {
    "running_mean": "batch_stats",
    "running_var": "batch_stats",
    "num_batches_tracked": "counters",
}
"""A state dict entry's role, by its last name; every other entry is `"params"`.
`counters` (BatchNorm's `num_batches_tracked`) belong to one model and are never
ported."""


class Split(NamedTuple):
    """A fused weight split into parts: `module` (dotted) held `weight` (and `bias`)
    for `parts` (sibling names); `conv1d` when the weight was stored `(in, out)`
    (Hugging Face's `Conv1D`) rather than `(out, in)` (`nn.Linear`). The parts are
    stored in `nn.Linear` layout."""

    module: str
    parts: tuple[str, ...]
    conv1d: bool
    entries: tuple[str, ...]


class TorchRecord(NamedTuple):
    """What `to_torch` needs: the Tree's names in native order, the tied names
    (`(name, same as)`), `prefix` and the names (without it) that had it, the
    splits, and the module (or None) whose classes and settings the codecs read;
    `config`, a Hugging Face folder (or its `config.json` as a dict) whose model
    `trace` builds when there is no module (None: none)."""

    names: tuple[str, ...]
    ties: tuple[tuple[str, str], ...]
    prefix: str
    stripped: frozenset[str]
    splits: tuple[Split, ...]
    module: Held
    config: Held = Held(None)


_NOT_A_STATE_DICT = """\
bridge.from_torch expects `obj`, a state dict (a mapping of dotted names to numpy arrays
or torch.Tensors, as `module.state_dict()` gives) or a torch.nn.Module; got {what}."""

_NOT_ARRAYS = """\
bridge.from_torch: `obj`, a state dict, maps names to arrays, but {problems}. Pass
`module.state_dict()`, or a flat mapping of arrays."""

_LEAF_AND_NODE = """\
bridge.from_torch: {name} is both an array and a prefix of {other}; a state dict
from PyTorch never has this. Rename one of them."""

_SPLIT_UNUSED = """\
bridge.from_torch: split pattern {pattern!r} fully matches no module holding a 2-D
`weight` (modules with one: {modules})."""

_SPLIT_SHAPE = """\
bridge.from_torch: cannot split {module!r} into {n} parts {parts}: {reason}."""

_NO_TORCH = """\
torch is not installed: to_torch(tree, tensors=True) gives torch.Tensors only with
torch (`pip install bridge[torch]`). Without it, to_torch gives numpy arrays."""

_UNREADABLE = """\
bridge.from_torch cannot read these tensors of `obj` as arrays: {problems}. Convert
them first (the fix is named for each), or leave them out of the state dict."""

_SPLIT_CLASH = """\
bridge.from_torch: `split` would {problems}. Choose part names no other entry has."""


def _torch() -> Any:
    return sys.modules.get("torch")


def _import_torch() -> Any:
    """torch, imported if it is installed but not imported yet (None without it)."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def is_module(obj: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.nn.Module)


def _is_tensor(value: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def is_state_dict(obj: Any) -> bool:
    """A non-empty flat mapping of string names to arrays (not Linen variables,
    whose values are mappings)."""
    if not isinstance(obj, Mapping) or not obj:
        return False
    return all(
        isinstance(k, str) and (_is_tensor(v) or _is_array(v)) for k, v in obj.items()
    )


_NUMPY_VIEW = {
    "bfloat16": ("int16", ml_dtypes.bfloat16),
    "float8_e4m3fn": ("uint8", ml_dtypes.float8_e4m3fn),
    "float8_e5m2": ("uint8", ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": ("uint8", ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": ("uint8", ml_dtypes.float8_e5m2fnuz),
    "float8_e8m0fnu": ("uint8", ml_dtypes.float8_e8m0fnu),
}

_NO_NUMPY_DTYPE = {
    "complex32": "numpy has no complex32: `.to(torch.complex64)`",
    "float4_e2m1fn_x2": "two float4 values packed per byte: unpack them first",
}


def unreadable(tensor: Any) -> str | None:
    """Why a `torch.Tensor` has no numpy view (and the fix), or None if it has one."""
    name = str(tensor.dtype).removeprefix("torch.")
    if tensor.is_nested:
        return "a nested tensor: `.to_padded_tensor(0)`, or one entry per part"
    if tensor.layout != _torch().strided:
        return f"a sparse tensor, {tensor.layout}: `.to_dense()`"
    if tensor.device.type == "meta":
        return "a meta tensor, which holds no data: materialise and load the weights"
    if tensor.is_quantized:
        return f"a quantized tensor, {name}: `.dequantize()`"
    if name in _NO_NUMPY_DTYPE:
        return _NO_NUMPY_DTYPE[name]
    if name not in _NUMPY_VIEW and not _has_numpy_dtype(tensor):
        return f"{name}: numpy has no such dtype; `.to()` one it has"
    return None


def _has_numpy_dtype(tensor: Any) -> bool:
    try:
        tensor.new_empty(0).numpy()
    except (TypeError, RuntimeError):
        return False
    return True


def tensor_to_numpy(tensor: Any) -> np.ndarray:
    """A CPU `torch.Tensor` as a numpy array sharing its memory (dtypes numpy lacks,
    like bfloat16, through a same-width integer view and `ml_dtypes`)."""
    torch = _torch()
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()  # a conjugate or negative view: one copy
    name = str(t.dtype).removeprefix("torch.")
    if name in _NUMPY_VIEW:
        carrier, dtype = _NUMPY_VIEW[name]
        return t.view(getattr(torch, carrier)).numpy().view(dtype)
    return t.numpy()


def numpy_to_tensor(array: Any) -> Any:
    """An array as a `torch.Tensor`, sharing memory where the source allows it
    (DLPack for JAX arrays, `torch.from_numpy` for writable numpy arrays)."""
    torch = _import_torch()
    if torch is None:
        raise ImportError(_NO_TORCH)
    name = str(array.dtype)
    if name in _NUMPY_VIEW:
        carrier, _ = _NUMPY_VIEW[name]
        host = np.asarray(array).view(carrier)
        return numpy_to_tensor(host).view(getattr(torch, name))
    if not isinstance(array, np.ndarray):
        try:
            return torch.from_dlpack(array)
        except (TypeError, RuntimeError, BufferError):
            array = np.asarray(array)
    if not array.flags.writeable:  # torch tensors are writable: copy once
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def _split_name(name: str) -> Path:
    return parse(name)


def _memory_key(a: Any) -> tuple:
    """Equal for two arrays that are one view of one memory (numpy), or one object
    (any other array): a tie."""
    if isinstance(a, np.ndarray):
        i = a.__array_interface__
        return ("numpy", i["data"][0], i["shape"], i["strides"], a.dtype.str)
    return ("object", id(a))


def _tensor_key(t: Any) -> tuple:
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.is_conj(),
        t.is_neg(),
    )


@paused()  # ~100k short-lived entries: the collector would walk them (bridge/_gc.py)
def from_torch(
    obj: Any,
    *,
    prefix: str = "",
    split: Mapping[str, Sequence[str] | Mapping[str, int]] | None = None,
) -> Tree:
    """Convert a PyTorch-layout state dict (or a `torch.nn.Module`) to a `bridge.Tree`.

    The dotted names become paths (`encoder.layer.0.query.weight` ->
    `t.encoder.layer[0].query.weight`); numbers are sequence indices. Arrays are not
    copied: numpy arrays are kept, `torch.Tensor`s become numpy views of their memory
    (bfloat16 included, through `ml_dtypes`). Roles: `running_mean`/`running_var` are
    `"batch_stats"`, `num_batches_tracked` `"counters"` (never ported), all else
    `"params"`. With a module, each node records the module's class, so the port
    codecs recognise layers by class (`nn.Linear`, Hugging Face's `Conv1D`, ...)
    and read their settings (heads, epsilon, strides); with a state dict they go by
    names and shapes.

    Tied weights (one tensor under two names, as `lm_head.weight` and
    `transformer.wte.weight`) are kept once, under the first name; `bridge.port_plan`
    lists them and `bridge.to_torch` writes both names again.

    **Arguments:**

    - `obj`: a state dict, `Mapping[str, array]` (numpy arrays, `torch.Tensor`s or
      JAX arrays), or a `torch.nn.Module` (its `state_dict()`).
    - `prefix`: stripped from the names that start with it, as Hugging Face's
      `base_model_prefix` (`"bert."`, `"model."`, `"transformer."`); `to_torch`
      adds it back to those names.
    - `split`: fused weights to split, `{regex: part names}`: a module whose dotted
      name fully matches the regex and holds a 2-D `weight` (and `bias`) is replaced
      by equal parts along its output axis, siblings named `part names`:
      `{r".*\\.c_attn": ("query", "key", "value")}` turns GPT-2's `c_attn`
      (`Conv1D`, weight `(in, 3*E)`) into three `nn.Linear`-layout layers
      (`query.weight` `(E, in)`, views, no copy); `to_torch` fuses them back.
      Parts of other sizes are `{name: rows}`, in order: Phi-3's `qkv_proj` with
      grouped-query attention is `{"q_proj": H * hd, "k_proj": KV * hd, "v_proj":
      KV * hd}`.

    **Returns:**

    A `bridge.Tree` of framework `"torch"`.

    **Example:**

    ```python
    >>> import numpy as np, bridge
    >>> sd = {"fc.weight": np.ones((3, 2), "f4"), "fc.bias": np.zeros(3, "f4")}
    >>> t = bridge.from_torch(sd)
    >>> t.fc.weight.shape
    (3, 2)
    >>> sorted(bridge.to_torch(t))
    ['fc.bias', 'fc.weight']

    ```
    """
    check_str(prefix, "prefix")
    checked = _check_split(split)
    module = None
    kinds: dict[Path, Any] = {}
    if is_module(obj):
        module = obj
        for name, sub in obj.named_modules():
            kinds[_split_name(name) if name else ()] = type(sub)
        state = obj.state_dict(keep_vars=True)
    elif isinstance(obj, Mapping):
        state = obj
    else:
        raise TypeError(_NOT_A_STATE_DICT.format(what=type(obj).__name__))
    return _state_tree(state, kinds, module, prefix, checked)


def _placeholders(target: Any) -> Any:
    """A module whose tensors hold no data (built on the `meta` device or inside
    `FakeTensorMode`: a model made from its config at no memory cost) as a Tree of
    `jax.ShapeDtypeStruct`s recording the module (its classes, the forward pass a
    trace runs), a tie (one tensor under several names) kept once; anything else as
    it is (`from_torch` reads it)."""
    if not is_module(target):
        return target
    state = target.state_dict(keep_vars=True)
    if not any(_holds_nothing(t) for t in state.values()):
        return target
    shapes: dict[int, Any] = {}  # by object: a tied parameter is one object
    abstract = {
        name: shapes.setdefault(
            id(t), jax.ShapeDtypeStruct(tuple(t.shape), _numpy_dtype(t))
        )
        for name, t in state.items()
    }
    kinds = {
        (_split_name(name) if name else ()): type(sub)
        for name, sub in target.named_modules()
    }
    return _state_tree(abstract, kinds, target, "", None)


def _holds_nothing(tensor: Any) -> bool:
    """A meta or fake tensor: a shape and a dtype, no values."""
    return tensor.device.type == "meta" or type(tensor).__name__ == "FakeTensor"


def _numpy_dtype(tensor: Any) -> Any:
    """The numpy dtype `tensor_to_numpy` would give `tensor`, read without values."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _NUMPY_VIEW:
        return np.dtype(_NUMPY_VIEW[name][1])
    return _torch().empty((), dtype=tensor.dtype).numpy().dtype


def _numeric(dtype: Any) -> bool:
    """Numbers or bools a JAX array can hold (ml_dtypes' too): not objects,
    strings, structured records or dates."""
    numbers = np.issubdtype(dtype, np.number) or np.issubdtype(dtype, np.bool_)
    return numbers or dtype.type.__module__.startswith("ml_dtypes")


def _state_tree(
    state: Mapping[str, Any],
    kinds: dict[Path, Any],
    module: Any,
    prefix: str,
    split: dict[str, Parts] | None,
) -> Tree:
    """`from_torch` of a state dict whose modules' classes are `kinds`."""
    bad = [
        f"{k!r} is a {type(v).__name__}"
        for k, v in state.items()
        if not (isinstance(k, str) and (_is_tensor(v) or _is_array(v)))
    ]
    bad += [
        f"{k[:60]!r} is an array of {str(v.dtype)[:40]}, not of numbers"
        for k, v in state.items()
        if isinstance(v, np.ndarray) and not _numeric(v.dtype)
    ]
    if bad:
        shown = ", ".join(bad[:5]) + (
            f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        )
        raise TypeError(_NOT_ARRAYS.format(problems=shown))
    arrays, ties = _arrays(state)
    stripped = frozenset(
        _strip(n, prefix) for n in [*arrays, *(a for a, _ in ties)] if _has(n, prefix)
    )
    if stripped:
        arrays = {_strip(n, prefix): a for n, a in arrays.items()}
        ties = [(_strip(a, prefix), _strip(b, prefix)) for a, b in ties]
        kinds = _strip_kinds(kinds, prefix)
    splits: list[Split] = []
    if split:
        arrays, splits = _split(arrays, split, kinds)
    names = tuple(arrays)
    _check_nodes(names)
    entries = [
        (_split_name(n), ROLE_OF.get(n.rsplit(".", 1)[-1], "params"), arrays[n], i)
        for i, n in enumerate(names)
    ]
    record = TorchRecord(
        names, tuple(ties), prefix, stripped, tuple(splits), Held(module)
    )
    return build(entries, kinds, "torch", record)


class Parts(NamedTuple):
    """What `split` makes of a fused weight: the parts' names, and their numbers of
    rows (None: equal parts)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...] | None


def _check_split(split: Any) -> dict[str, Parts] | None:
    if split is None:
        return None
    if not isinstance(split, Mapping):
        raise type_error("split", "a dict of regex -> part names, or None", split)
    for pattern in split:
        check_pattern(pattern, "split")
    return {p: _parts(parts, f"split[{p!r}]") for p, parts in split.items()}


def _parts(parts: Any, argument: str) -> Parts:
    """Part names, or `{name: rows}`: each part's size along the output axis."""
    if not isinstance(parts, Mapping):
        return Parts(check_names(parts, argument), None)
    sizes = tuple(parts.values())
    bad = [n for n in sizes if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise type_error(argument, "part names, or {name: rows} with rows > 0", bad[0])
    return Parts(check_names(tuple(parts), argument), sizes)


def _has(name: str, prefix: str) -> bool:
    return bool(prefix) and name.startswith(prefix)


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) :] if _has(name, prefix) else name


def _strip_kinds(kinds: dict[Path, Any], prefix: str) -> dict[Path, Any]:
    head = _split_name(prefix.rstrip("."))
    out = {}
    for path, cls in kinds.items():
        if path[: len(head)] == head:
            out[path[len(head) :]] = cls
        elif path not in out:
            out[path] = cls
    return out


def _arrays(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Numpy (or JAX) arrays by name, tied names left out, and the ties (one dict
    look-up per entry: linear in the number of entries)."""
    problems = [
        f"{name!r} ({why})"
        for name, value in state.items()
        if _is_tensor(value) and (why := unreadable(value))
    ]
    if problems:
        raise TypeError(_UNREADABLE.format(problems="; ".join(problems)))
    arrays: dict[str, Any] = {}
    ties: list[tuple[str, str]] = []
    seen: dict[tuple, str] = {}
    for name, value in state.items():
        key = _tensor_key(value) if _is_tensor(value) else _memory_key(value)
        if key in seen:
            ties.append((name, seen[key]))
            continue
        seen[key] = name
        arrays[name] = tensor_to_numpy(value) if _is_tensor(value) else value
    return arrays, ties


_SAME_PATH = """\
bridge.from_torch: {other} and {name} name the same array (their numbers are the
same index, e.g. 01 and 1); rename one of them."""


def _check_nodes(names: Sequence[str]) -> None:
    seen: dict[tuple, str] = {}
    for name in names:
        # ASCII numbers compared as numbers: "01" is index 1 to a reader of "1"
        key = tuple(
            int(k) if k.isascii() and k.isdecimal() else k for k in name.split(".")
        )
        other = seen.setdefault(key, name)
        if other != name:
            raise ValueError(_SAME_PATH.format(name=shown(name), other=shown(other)))
    taken = set(names)
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts)):
            head = ".".join(parts[:i])
            if head in taken:
                raise ValueError(
                    _LEAF_AND_NODE.format(name=shown(head), other=shown(name))
                )


def _is_conv1d(cls: Any) -> bool:
    return any(
        c.__name__ == CONV1D_CLASS and c.__module__.startswith("transformers")
        for c in getattr(cls, "__mro__", ())
    )


def _split(
    arrays: dict[str, Any], split: Mapping[str, Parts], kinds: dict[Path, Any]
) -> tuple[dict[str, Any], list[Split]]:
    """The arrays with each matched module's `weight` (and `bias`) replaced, where
    the weight was, by its parts; one pass over the entries, whatever their number."""
    modules = [n[: -len(".weight")] for n in arrays if n.endswith(".weight")]
    modules = [m for m in modules if np.ndim(arrays[m + ".weight"]) == 2]
    chosen: dict[str, Parts] = {}
    problems: list[str] = []
    for pattern, parts in split.items():
        matched = [m for m in modules if re.fullmatch(pattern, m)]
        if not matched:
            raise ValueError(_SPLIT_UNUSED.format(pattern=pattern, modules=modules))
        for module in matched:
            if module in chosen:
                problems.append(f"split {module!r} twice (two patterns match it)")
            chosen[module] = parts
    pieces: dict[str, list[tuple[str, Any]]] = {}  # at the weight's name
    removed: set[str] = set()
    splits = []
    for module, (parts, sizes) in chosen.items():
        weight, bias = arrays[module + ".weight"], arrays.get(module + ".bias")
        cls = kinds.get(_split_name(module))
        if cls is not None:
            conv1d = _is_conv1d(cls)
        elif bias is not None and weight.shape[0] != weight.shape[1]:
            conv1d = bias.shape[0] == weight.shape[1]
        else:
            conv1d = module.rsplit(".", 1)[-1] in CONV1D_NAMES
        size = weight.shape[1 if conv1d else 0]
        if sizes is None and size % len(parts):
            reason = f"its output size {size} is not a multiple (give each part's rows)"
        elif sizes is not None and sum(sizes) != size:
            reason = f"its output size {size} is not {' + '.join(map(str, sizes))}"
        else:
            reason = ""
        if reason:
            raise ValueError(
                _SPLIT_SHAPE.format(
                    module=module, n=len(parts), parts=parts, reason=reason
                )
            )
        sizes = sizes or (size // len(parts),) * len(parts)
        ends = list(itertools.accumulate(sizes))
        head = module.rsplit(".", 1)[0] + "." if "." in module else ""
        entries = ("weight", "bias") if bias is not None else ("weight",)
        new = []
        for part, end, rows in zip(parts, ends, sizes):
            piece = slice(end - rows, end)
            new.append(
                (
                    f"{head}{part}.weight",
                    weight[:, piece].T if conv1d else weight[piece],
                )
            )
            if bias is not None:
                new.append((f"{head}{part}.bias", bias[piece]))
        pieces[module + ".weight"] = new
        removed.update(f"{module}.{e}" for e in entries)
        splits.append(
            Split(module, tuple(f"{head}{p}" for p in parts), conv1d, entries)
        )
        kinds.pop(_split_name(module), None)
    made: dict[str, str] = {}
    for (module, _), new in zip(chosen.items(), pieces.values()):
        for name, _ in new:
            if name in arrays and name not in removed:
                problems.append(f"replace the entry {name!r} by a part of {module!r}")
            elif name in made:
                problems.append(
                    f"make {name!r} twice (from {made[name]!r} and {module!r})"
                )
            made[name] = module
    if problems:
        raise ValueError(_SPLIT_CLASH.format(problems="; ".join(problems)))
    out: dict[str, Any] = {}
    for name, array in arrays.items():
        out.update(pieces.get(name, ()))
        if name not in removed:
            out[name] = array
    return out, splits


def to_torch(tree: Tree, *, tensors: bool = False, prefix: str | None = None) -> dict:
    """A `bridge.Tree` of framework `"torch"` as a state dict, ready for
    `module.load_state_dict(state_dict, strict=True)`.

    Names are the dotted paths, with what `bridge.from_torch` recorded undone: the
    stripped prefix added back, split weights fused again (a copy), tied names
    written again (the same array under both names).

    **Arguments:**

    - `tree`: a whole-model Tree from `bridge.from_torch` (or a port into one).
    - `tensors`: `False` (default) gives numpy arrays (views of the Tree's arrays
      where possible); `True` gives `torch.Tensor`s (needs torch), sharing memory
      with the arrays where the source allows it (numpy, DLPack).
    - `prefix`: add this prefix to every name (default: the prefix `from_torch`
      stripped, on the names it stripped it from).

    **Returns:**

    A `dict[str, array]` in the original order.

    **Example:**

    ```python
    >>> import numpy as np, bridge
    >>> sd = {"bert.pooler.dense.weight": np.ones((2, 2), np.float32)}
    >>> t = bridge.from_torch(sd, prefix="bert.")
    >>> list(t.pooler.dense), list(bridge.to_torch(t))
    (['weight'], ['bert.pooler.dense.weight'])

    ```
    """
    check_bool(tensors, "tensors")
    check_str(prefix, "prefix", optional=True)
    src, leaves = native_leaves(tree, "torch", TorchRecord)
    record = src.record
    out: dict[str, Any] = {}
    for name, leaf in zip(record.names, leaves):
        out[name] = leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf)
    for s in record.splits:
        out = _fuse(out, s)
    for name, same in record.ties:
        out[name] = out[same]
    if prefix is None:
        out = {
            (record.prefix + n if n in record.stripped else n): a
            for n, a in out.items()
        }
    else:
        out = {prefix + n: a for n, a in out.items()}
    if tensors:  # tied names: one tensor, as `module.state_dict()` gives
        made: dict[int, Any] = {}
        for name, array in out.items():
            if id(array) not in made:
                made[id(array)] = numpy_to_tensor(array)
            out[name] = made[id(array)]
    return out


def _fuse(arrays: dict[str, Any], s: Split) -> dict[str, Any]:
    items = list(arrays.items())
    names = {f"{p}.{e}" for p in s.parts for e in s.entries}
    at = next(i for i, (k, _) in enumerate(items) if k in names)
    fused = []
    for entry in s.entries:
        pieces = [np.asarray(arrays[f"{p}.{entry}"]) for p in s.parts]
        if entry == "weight":
            value = (
                np.concatenate([p.T for p in pieces], axis=1)
                if s.conv1d
                else np.concatenate(pieces, axis=0)
            )
        else:
            value = np.concatenate(pieces, axis=0)
        fused.append((f"{s.module}.{entry}", value))
    rest = [(k, v) for k, v in items if k not in names]
    rest[at:at] = fused
    return dict(rest)


def ties_of(tree: Tree) -> tuple[tuple[str, ...], ...]:
    """The tied names `(name, same as)` `from_torch` found (empty for other Trees),
    and for a Hugging Face folder's Tree (its `config.json` recorded, no module),
    its LM head: `(name, same as, why)` where the config ties it and the files hold
    it once, `(name, "", why)` where they hold no head that can fill it
    (`bridge._families._tied_heads`)."""
    src = tree._info.source
    if src is None or src.framework != "torch":
        return ()
    record = src.record
    config = record.config.value
    if is_module(record.module.value) or not isinstance(config, Mapping):
        return record.ties
    _, leaves = native_leaves(tree, "torch", TorchRecord)
    shapes = {n: tuple(getattr(x, "shape", ())) for n, x in zip(record.names, leaves)}
    shapes.update((a, shapes.get(b, ())) for a, b in record.ties)
    head = folder_head(config, shapes)
    return record.ties if head is None else (*record.ties, head)


def _infer(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A `torch.nn.Module` run for inference (`Adapter.infer`): arrays given as
    tensors (numpy's dtypes), in evaluation mode and without gradients (its mode
    put back after), its outputs as numpy arrays (a transformers `ModelOutput` as
    a dict of them); keyword arguments its `forward` does not name are left out,
    as the trace leaves them (the JAX model's `deterministic=`, `key=`)."""
    if not is_module(model):
        raise TypeError(
            "a PyTorch state dict has no forward pass to run: give the module"
        )
    torch = _torch()

    def tensor(x: Any) -> Any:
        return torch.from_numpy(np.array(x)) if hasattr(x, "shape") else x

    def array(x: Any) -> Any:
        """Tensors as numpy arrays; what is none (a cache object) left out."""
        if isinstance(x, torch.Tensor):
            return x.detach().cpu().numpy()
        if isinstance(x, Mapping):
            kept = {k: array(v) for k, v in x.items()}
            return {k: v for k, v in kept.items() if v is not None}
        if isinstance(x, list | tuple):
            kept = [array(v) for v in x]
            return tuple(v for v in kept if v is not None)
        return x if isinstance(x, int | float | np.ndarray) else None

    kwargs = _torch_trace.forward_kwargs(model, inputs, kwargs)  # as traced
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(
                *map(tensor, inputs), **{k: tensor(v) for k, v in kwargs.items()}
            )
    finally:
        model.train(training)
    return array(out)


def _runnable(target: Any, ported: Any) -> Any:
    """A copy of the `target` module holding the `ported` state dict (tensors), or
    None where it cannot run: a state dict, a module on the `meta` device."""
    if not is_module(target):
        return None
    torch = _torch()
    if any(t.is_meta for t in target.state_dict().values()):
        return None
    state = {k: _tensor(v, torch) for k, v in ported.items()}
    return _holding(target, state, strict=True)


def _tensor(x: Any, torch: Any) -> Any:
    """A tensor of an array: a copy (a file's arrays are read-only), ml_dtypes'
    (bfloat16), which torch cannot take, as float32: loaded into a module, the
    copy is cast to the parameter's dtype."""
    if isinstance(x, torch.Tensor):
        return x
    array = np.asarray(x)
    return torch.tensor(array if array.dtype.kind != "V" else array.astype("f4"))


def _holding(module: Any, state: dict[str, Any], strict: bool) -> Any:
    """A copy of `module` holding `state`, in evaluation mode."""
    copied = copy.deepcopy(module)
    copied.load_state_dict(state, strict=strict)
    return copied.eval()


def _run_tree(tree: Tree) -> Any:
    """What a PyTorch-layout Tree runs as (`Adapter.run_tree`): a copy of the
    module it holds, or for a folder's Tree a copy of the folder's model built
    with real tensors (`_torch_real`: at full size, at most `MOST_REAL` bytes),
    holding the Tree's arrays; the state dict (which runs as nothing) where there
    is no such module, or where the module holds an array the Tree does not give
    (a weight its library makes from several of the file's)."""
    state = to_torch(tree)
    record = source_of(tree, "torch", TorchRecord).record
    module, renamed = record.module.value, {}
    if not is_module(module) and record.config.value is not None:
        real = _torch_real.real_module(record.config.value, keys=_files(record))
        module, renamed = (None if real.twin else real.module), real.keys
    if not is_module(module):
        return state
    wanted = module.state_dict(keep_vars=True)
    if any(t.is_meta for t in wanted.values()):
        return state
    torch = _torch()
    files = {name: renamed.get(name, name) for name in wanted}
    given = {n: _tensor(state[f], torch) for n, f in files.items() if f in state}
    held = {id(wanted[n]) for n in given}  # a tie's second name: one tensor
    if any(n not in given and id(t) not in held for n, t in wanted.items()):
        return state
    return _holding(module, given, strict=False)


def constants(tree: Tree) -> dict[Path, np.ndarray]:
    """The non-persistent buffers of the module a Tree holds (transformers' Gemma 3
    `embed_tokens.embed_scale`, `sqrt(hidden)`: in no state dict, no file), by the
    path their name has in the Tree, with their values (floats in float64); for a
    folder's Tree those of its model built with real tensors (`_torch_real`: where
    it takes at most `MOST_REAL` bytes; none of a larger one); empty for a state
    dict and any other Tree.

    Example: `{("model", "embed_tokens", "embed_scale"): array(4.)}`.
    """
    src = tree._info.source
    if src is None or src.framework != "torch":
        return {}
    record = src.record
    module = record.module.value
    if not is_module(module) and record.config.value is not None:
        real = _torch_real.real_module(record.config.value, keys=_files(record))
        module = None if real.twin else real.module  # a twin's are of its widths
    if not is_module(module):
        return {}
    out = {}
    for name, sub in module.named_modules():
        for key in sorted(getattr(sub, "_non_persistent_buffers_set", ())):
            buffer = sub._buffers.get(key)
            if buffer is None or buffer.is_meta:
                continue
            value = buffer.detach().cpu()
            value = value.double() if value.is_floating_point() else value
            full = f"{name}.{key}" if name else key
            out[_split_name(_strip(full, record.prefix))] = value.numpy()
    return out


class TorchNode(Mapping):
    """A node of a PyTorch-layout Tree as the codecs' `hyperparameters` see it: the
    `torch.nn.Module` at this path (None for a state dict, a file, or a split part),
    its class, and the dotted name. Children by key (`node["layer"][0]`)."""

    def __init__(
        self,
        root: Any,
        prefix: str,
        split: frozenset[str],
        name: str,
        kinds: Mapping[str, type] | None = None,
    ):
        self.root, self.prefix, self.split, self.name = root, prefix, split, name
        self.kinds = kinds or {}
        self.module = None
        if root is not None and name not in split:
            for full in (prefix + name, name):
                try:
                    self.module = root.get_submodule(full.rstrip("."))
                    break
                except AttributeError:
                    continue
        self.cls = self.kinds.get(name) if self.module is None else type(self.module)

    def __getitem__(self, key: Any) -> TorchNode:
        name = f"{self.name}.{key}" if self.name else str(key)
        return TorchNode(self.root, self.prefix, self.split, name, self.kinds)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def modules(tree: Tree) -> TorchNode:
    """The root `TorchNode` of a PyTorch-layout Tree."""
    record = source_of(tree, "torch", TorchRecord).record
    split = frozenset(p for s in record.splits for p in s.parts)
    kinds = None
    if record.module.value is None:  # a file's classes, where its folder told them
        kinds = {
            ".".join(map(str, path)): cls
            for path, node in walk(tree)
            if (cls := kind(node)) is not None
        }
    return TorchNode(record.module.value, record.prefix, split, "", kinds)


def wants_tensors(obj: Any) -> bool:
    """A `torch.nn.Module`, or a state dict holding `torch.Tensor`s: what was given
    as a target is given back as `torch.Tensor`s."""
    torch = _torch()
    if torch is None:
        return False
    if isinstance(obj, torch.nn.Module):
        return True
    return isinstance(obj, Mapping) and any(
        isinstance(v, torch.Tensor) for v in obj.values()
    )


TORCH_NAMES = frozenset(
    {"weight", "running_mean", "running_var", "in_proj_weight", "num_batches_tracked"}
)
"""Last names that make a file without bridge metadata a PyTorch-layout one."""


def is_torch_layout(meta: Mapping[str, str], shapes: Iterable[str]) -> bool:
    """A file without bridge metadata is in PyTorch layout when its metadata says
    `{"format": "pt"}` (as torch's and Hugging Face's writers add) or one of its
    arrays has a PyTorch-only last name (`weight`, `running_mean`, ...)."""
    return meta.get("format") == "pt" or any(
        name.rsplit(".", 1)[-1] in TORCH_NAMES for name in shapes
    )


def role_of(name: str) -> str:
    """The role of a state dict entry by its dotted name (`ROLE_OF`)."""
    return ROLE_OF.get(name.rsplit(".", 1)[-1], "params")


def _from_file(
    tensors: list[tuple[str, Path, str, Any]],
    modules: dict[Path, tuple[str, dict[str, Any]]],
    kinds: dict[Path, Any],
    empty: list[tuple[str, Path]],
) -> Tree:
    """The Tree of a PyTorch-layout file: its state dict named by the arrays' paths
    (a `prefix=` taken off), in natural name order (2 before 10, as PyTorch), packed
    experts tensors (transformers v5's `mlp.experts.gate_up_proj`) read per expert;
    `kinds` the classes the file tells (`{path: class}`), as a module's."""
    ordered = sorted(tensors, key=lambda t: _natural(t[1]))
    state = {".".join(map(str, path)): array for _, path, _, array in ordered}
    if _experts.has_packed(state):
        state = _experts.unpack(state)
    return _state_tree(state, dict(kinds), None, "", None)


def _natural(path: tuple) -> tuple:
    return tuple((0, k, "") if isinstance(k, int) else (1, 0, k) for k in path)


_NOT_BUILT = """\
The PyTorch side of this Tree could not be traced: {reason}."""


def trace(tree: Tree, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Uses | None:
    """What the forward pass of the module a PyTorch-layout Tree holds (or of the
    model built from the Hugging Face config it records, on fake tensors) does with
    each of its arrays, keyed by leaf path (`_torch_trace.trace_module`).

    Names the Tree does not hold (a tie's second name, a fused weight it split) are
    left out; a folder's keys are matched as transformers renames them on load.

    **Returns:**

    A `bridge._uses.Uses`, or None when the Tree holds no module and no config (a
    bare state dict or file).

    **Raises:**

    `ValueError` naming why when it records a config but no model could be built
    from it (torch or transformers missing, an unknown class); whatever the
    module's forward pass raises on these inputs.
    """
    record = source_of(tree, "torch", TorchRecord).record
    module, renamed = record.module.value, {}
    folder = not is_module(module) and record.config.value is not None
    if folder:
        built = _torch_folder.folder_module(record.config.value, keys=_files(record))
        if built.module is None:
            raise Untraced(_NOT_BUILT.format(reason=built.reason))
        module, renamed = built.module, built.keys
    if not is_module(module):
        return None
    config = getattr(module, "config", None)
    channels = getattr(config, "num_channels", None)
    if channels is None:  # CLIP: its vision tower's
        channels = getattr(getattr(config, "vision_config", None), "num_channels", None)
    if channels is None:  # a diffusers model's (UNet2DModel, AutoencoderKL)
        channels = getattr(config, "in_channels", None)
    inputs = tuple(_channel_first(x, channels) for x in inputs)
    kwargs = {k: _channel_first(x, channels) for k, x in kwargs.items()}
    try:
        uses = _torch_trace.trace_module(module, inputs, kwargs)
    except Exception:
        if not folder:
            raise
        # a forward pass that reads values (a `.item()`), which a model of no
        # memory cannot give: the model again with real tensors, or its twin
        real = _torch_real.real_module(record.config.value, keys=_files(record))
        if real.module is None:
            raise
        uses = _torch_trace.trace_module(real.module, inputs, kwargs)
    held = set(record.names)
    names: dict[Any, str] = {}
    for name in [*uses.positions, *uses.unused]:
        if not isinstance(name, str):  # trace_module's keys are names
            continue
        file = renamed.get(name, name)
        own = _strip(file, record.prefix)
        if own in held and (own == file or own in record.stripped):
            names[name] = own
    # a tie's second name: keyed by its own name (its module's uses), the Tree's
    # name it is the same array as in `tied`
    tied = {}
    for name, same in uses.tied.items():
        if not isinstance(name, str) or name not in renamed and name in names:
            continue
        own = _strip(name, record.prefix)
        kept = names.get(same) or names.get(name)
        if kept is not None and own != kept:
            names[name] = own
            tied[_split_name(own)] = _split_name(kept)
    out = _torch_trace.rekeyed(uses, names, _split_name)
    return out._replace(tied=tied)


def _channel_first(x: Any, channels: Any) -> Any:
    """An image batch given channel-last, as a Flax model takes it `(N, H, W, C)`,
    moved to PyTorch's `(N, C, H, W)` for a Hugging Face model whose configuration
    says `C` (`num_channels`); anything else as it is."""
    shape = getattr(x, "shape", ())
    if not isinstance(channels, int) or len(shape) != 4:
        return x
    if shape[-1] != channels or shape[1] == channels:
        return x
    if not hasattr(x, "__array__"):  # a jax.ShapeDtypeStruct: shape only
        return type(x)((shape[0], shape[3], shape[1], shape[2]), x.dtype)
    return np.moveaxis(np.asarray(x), -1, 1)


def with_config(tree: Tree, config: Any) -> Tree:
    """The same PyTorch-layout Tree (the same arrays) recording `config`, a Hugging
    Face folder or its `config.json` as a dict, whose model `trace` builds (on fake
    tensors) when the Tree holds no module: a folder's Tree read from its files."""
    src = source_of(tree, "torch", TorchRecord)
    record = src.record._replace(config=Held(config))
    source = Source(src.framework, src.paths, src.order, record, src.native)
    info = dataclasses.replace(tree._info, source=source)
    return Tree._make(info, [child for _, child in items(tree)])


def _files(record: TorchRecord) -> list[str]:
    """The names of a folder's Tree as the folder's files hold them."""
    files = [_unstrip(n, record) for n in record.names]
    return files + [_unstrip(a, record) for a, _ in record.ties]


def _unstrip(name: str, record: TorchRecord) -> str:
    return record.prefix + name if name in record.stripped else name


COUNTERS = {"BatchNorm": {"num_batches_tracked": np.zeros((), np.int64)}}
"""Entries a PyTorch layer has that no other framework keeps: written fresh."""


def _named(name: str, family: str | None = None) -> TorchNode:
    """A layer known by its dotted name alone, as the codecs' `hyperparameters` see
    it: no module, so the name and the model family (`model_type`, or None) decide
    (GPT-2's `c_attn` is a `Conv1D`, GPT-Neo's `c_fc` an `nn.Linear`)."""
    cls = named_class(family, name)
    return TorchNode(None, "", frozenset(), name, None if cls is None else {name: cls})


WRITER = LayoutWriter(
    own=lambda tree, prefix: to_torch(tree, prefix=prefix or None),
    node=_named,
    fresh=COUNTERS,
)


def _creation_order(cls: Any, keys: Sequence[Key]) -> str | None:
    """A `torch.nn.Module` registers its parameters and its submodules, each in the
    order `__init__` assigned them, in two dicts (`state_dict` lists the first,
    then the second): each is in creation order, one against the other is not."""
    torch = _torch()
    if torch is None or not isinstance(cls, type):
        return None
    return APART if issubclass(cls, torch.nn.Module) else None


ADAPTER = register_adapter(
    Adapter(
        name="torch",
        display="PyTorch-layout",
        recognise=lambda obj: is_module(obj) or is_state_dict(obj),
        to_tree=from_torch,
        to_native=to_torch,
        module_types=(),  # torch is optional: its classes are read by name
        layout="torch",
        like=lambda target, tree: to_torch(tree, tensors=wants_tensors(target)),
        runnable=_runnable,
        infer=_infer,
        run_tree=_run_tree,
        placeholders=_placeholders,
        rngs_hint="A state dict has no random streams: drop `rngs`.",
        modules=modules,
        records_classes=False,
        from_file=_from_file,
        ties=ties_of,
        plain_file=is_torch_layout,
        role_of=role_of,
        writer=WRITER,
        trace=trace,
        with_config=with_config,
        creation_order=_creation_order,
        constants=constants,
    )
)
