"""`save` and `load`: a model of any framework to and from a checkpoint on disk.

A checkpoint is in one of the registered formats (`bridge._io._format`): a
safetensors file (`*.safetensors`), a flax msgpack file (`*.msgpack`) or an orbax
checkpoint directory (any other path). Arrays are stored under their dotted neutral
path (`layers.0.kernel`); the metadata records, for each array, its path, role, shape
and dtype (and for a typed PRNG key its impl), plus the source framework, its
layout, the native class of each module (and for Equinox its plain settings, so a
file can be ported without the model) and the bridge version.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._adapters._linen import from_linen
from .._adapters._native import (
    check_model,
    like as like_form,
    placeholders,
    to_neutral,
)
from .._adapters._registry import Adapter, registered
from .._adapters._torch import from_torch
from .._arguments import (
    check_dtype,
    check_extra,
    check_rules,
    check_step,
    check_str,
)
from .._paths import Path as TreePath, at, path_of
from .._placement import place, sharding_of
from .._port._errors import PortError
from .._port._port import port_and_plan
from .._quant import _gguf, _write as _quant_write
from .._quant._read import dense, dequantized, lazy_arrays
from .._tree import (
    Tree,
    build,
    framework,
    kind,
    leaf_roles,
    native_order,
    native_paths,
    source_of,
    walk,
)
from . import (  # noqa: F401  (they register formats)
    _experts,
    _hf_folder,
    _msgpack,
    _orbax,
    _safetensors,
    _sharded,
    _training,
)
from ._contents import (
    RESERVED,
    VERSION as VERSION,
    Contents as Contents,
    Stored,
    dotted as dotted,
    encode as encode,
    split,
)
from ._errors import CheckpointError
from ._format import format_named, format_of, formats
from ._torch_layout import torch_state


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_PICKLE = """\
{path} is a pickle file (PyTorch's torch.save format): loading it can run any code, so
bridge never unpickles. Convert it to safetensors once, with torch's weights-only
loader (which refuses code), by pasting this one line:
python -c "import torch, safetensors.torch as st; sd = torch.load('{path}', \
weights_only=True); st.save_file({{k: v.contiguous().clone() for k, v in sd.items()}}, \
'{out}', metadata={{'format': 'pt'}})"
or pass the state dict to bridge.from_torch(torch.load(path, weights_only=True))."""


def _pickle(path: Path) -> CheckpointError:
    """The refusal of a pickle file, with the command that converts it: Hugging
    Face's `pytorch_model.bin` becomes `model.safetensors` beside it, which
    `bridge inspect FOLDER` and `bridge.load(FOLDER)` then find."""
    out = path.with_suffix(".safetensors")
    if path.name == "pytorch_model.bin":
        out = path.with_name("model.safetensors")
    return CheckpointError(_PICKLE.format(path=path, out=out))


_RESERVED_KEY = """\
metadata keys {keys} are reserved: bridge writes {reserved} itself. Rename your keys
(for example with a prefix: 'user.step')."""

_NOT_STRINGS = """\
`metadata` must map strings to strings (safetensors stores text only); got {problems}.
Encode other values yourself, e.g. json.dumps(value)."""

_NOT_AN_ARRAY = """\
Only arrays can be saved, but {problems}. Save the whole model (eqx.combine a
partitioned Tree first), not a filter spec."""

_KEY_COLLISION = """\
Two paths give the same dotted name in the file: {problems}. Rename one of them."""

_DTYPES_NOT_STORED = """\
The {format} format cannot store {problems}. Convert these arrays (e.g. with
jax.tree.map and .astype), or save to a format that stores them: {others}."""

_TRAINING_NO_METADATA = """\
{path}: a {format} checkpoint holds arrays only, with no metadata to record the
optimizer state's structure. Save a training checkpoint as *.safetensors or as an
orbax directory."""

_PORTING = """\
(while porting {path} into `like`: the file came from another framework, so its
arrays were paired with `like`'s layers by bridge.port)"""

_MISMATCH = """\
{path} does not fit the model given as `like`:
{problems}
A file of `like`'s own framework fills it only with exactly its arrays (the same paths,
shapes and dtypes). To see what the file holds, run `bridge inspect` on it, or load it
without `like`."""

_NOT_ADDRESSABLE = """\
{path}: a {format} checkpoint is one file, written by one process, but arrays of this
model are sharded over the devices of {processes} processes (this process cannot read
their other shards): {names}. Save to an orbax checkpoint directory (a path without a
file suffix), which every process writes its own shards to, e.g.
`bridge.save("ckpt/step_100", model)` called in every process."""


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


# --- saving -----------------------------------------------------------------------


def describe(tree: Tree, metadata: Mapping[str, str] | None) -> tuple[Contents, dict]:
    """The `Contents` a Tree is saved as, and `{dotted name: array to store}`."""
    flat = list(zip(jtu.tree_flatten_with_path(tree)[0], leaf_roles(tree)))
    if native_order(tree):  # the file lists the arrays in the model's native order
        at_path = {path_of(kp): ((kp, leaf), role) for (kp, leaf), role in flat}
        flat = [at_path[path] for path in native_paths(tree)]
    problems, collisions, names, arrays, tensors = [], [], {}, {}, []
    for (keypath, leaf), role in flat:
        path = path_of(keypath)
        name = dotted(path)
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            problems.append(f"{jtu.keystr(keypath)} is a {type(leaf).__name__}")
            continue
        if name in names:
            collisions.append(f"{jtu.keystr(names[name])} and {jtu.keystr(keypath)}")
        names[name] = keypath
        impl = None
        if _is_key(leaf):
            impl = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        arrays[name] = leaf
        tensors.append(
            Stored(name, path, str(role), tuple(leaf.shape), str(leaf.dtype), impl)
        )
    if problems:
        raise TypeError(_NOT_AN_ARRAY.format(problems=", ".join(problems)))
    if collisions:
        raise ValueError(_KEY_COLLISION.format(problems="; ".join(collisions)))
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(
            f"`metadata` must be a dict of strings to strings, got a "
            f"{type(metadata).__name__}."
        )
    user = dict(metadata or {})
    bad = [f"{k!r}: {v!r}" for k, v in user.items() if not _both_str(k, v)]
    if bad:
        raise TypeError(_NOT_STRINGS.format(problems=", ".join(bad)))
    taken = [key for key in user if key in RESERVED]
    if taken:
        raise ValueError(_RESERVED_KEY.format(keys=taken, reserved=RESERVED))
    fw = framework(tree)
    adapter = registered(fw)
    settings = _settings(tree, adapter)
    modules = tuple(
        (path, f"{cls.__module__}:{cls.__qualname__}", settings(path))
        for path, node in walk(tree)
        if (cls := kind(node)) is not None
    )
    layout = "" if adapter is None else adapter.layout
    empty = (
        () if adapter is None or adapter.empty is None else tuple(adapter.empty(tree))
    )
    contents = Contents(
        Path(), "", fw, layout, VERSION, modules, user, tuple(tensors), empty=empty
    )
    return contents, arrays


def _settings(tree: Tree, adapter: Adapter | None) -> Callable[[TreePath], dict]:
    """Each module's plain settings by path, where its adapter records them."""
    if adapter is None or adapter.settings is None or adapter.modules is None:
        return lambda path: {}
    native, settings = adapter.modules(tree), adapter.settings
    return lambda path: settings(at(native, path))


def _both_str(key: Any, value: Any) -> bool:
    return isinstance(key, str) and isinstance(value, str)


def write(path: Path, contents: Contents, arrays: Mapping[str, Any]) -> None:
    """Write `arrays` (by dotted name; typed PRNG keys as their key data) with
    `contents`' metadata, atomically, in the format `path` names."""
    fmt = format_of(path)
    if contents.training and fmt.name == "msgpack":
        raise ValueError(_TRAINING_NO_METADATA.format(path=path, format=fmt.name))
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"{path.parent}: no such directory to save {path.name} in."
        )
    if fmt.suffixes and path.is_dir():
        raise IsADirectoryError(
            f"{path} is a directory: a {fmt.name} checkpoint is one file; pick a "
            "file name."
        )
    if fmt.dtypes is not None:
        bad = [
            f"{s.key} ({s.dtype})"
            for s in contents.tensors
            if s.dtype not in fmt.dtypes
        ]
        if bad:
            dtypes = {s.dtype for s in contents.tensors}
            others = [
                f.name for f in formats() if f.dtypes is None or dtypes <= f.dtypes
            ]
            raise ValueError(
                _DTYPES_NOT_STORED.format(
                    format=fmt.name,
                    problems=", ".join(bad),
                    others=", ".join(others) or "none",
                )
            )
    spread = [
        k
        for k, v in arrays.items()
        if isinstance(v, jax.Array) and not v.is_fully_addressable
    ]
    if fmt.suffixes and spread:
        raise ValueError(
            _NOT_ADDRESSABLE.format(
                path=path,
                format=fmt.name,
                processes=jax.process_count(),
                names=", ".join(spread[:5]) + (", ..." if len(spread) > 5 else ""),
            )
        )
    arrays = {k: jax.random.key_data(v) if _is_key(v) else v for k, v in arrays.items()}
    fmt.save(path, contents, arrays)


def save(
    path: str | os.PathLike,
    obj: Any,
    *,
    metadata: dict | None = None,
    layout: str | None = None,
    rules: Mapping[str, str] | None = None,
    prefix: str = "",
    quantize: str | None = None,
    opt_state: Any = None,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    max_shard_size: int | str | None = None,
    config: Any = None,
    generation_config: Any = None,
    packed_experts: str | None = None,
) -> None:
    """Save a model of any framework as a checkpoint, atomically; with `opt_state`,
    `step` or `extra`, the whole training state.

    The format follows the path: `*.safetensors` writes one safetensors file, keyed
    by the dotted neutral paths (`layers.0.kernel`), with the role, shape and dtype
    of every array, the source framework and its layout (`"flax"` or `"equinox"`),
    and the bridge version in the file's metadata, so any framework can read it.
    `*.msgpack` writes a flax msgpack file of Linen-style variables
    (`{role: {module: {name: array}}}`). Any other path is an orbax checkpoint
    directory (items `state`: the arrays as a nested dict with their shardings, and
    `bridge`: the metadata).

    Typed PRNG keys (NNX's `RngKey`) are stored as their key data, with the impl name
    in the metadata (safetensors, orbax), and come back as typed keys.

    A training checkpoint (safetensors or orbax) adds the optimizer state's arrays
    under the prefix `opt_state.` (`opt_state.0.mu.layers.0.kernel`: Adam's first
    moment of that parameter), `extra` arrays under `extra.`, and records the
    state's structure and the step as JSON in the metadata (no pickle). It loads into
    a model and optimizer of any framework: `bridge.load(path, like=model,
    opt_state_like=...)`.

    The checkpoint is written under a temporary name in the same directory, flushed
    to disk, then renamed to `path`: a failure leaves any earlier checkpoint at
    `path` intact. An existing orbax directory is replaced only if it is a bridge
    checkpoint.

    **Arguments:**

    - `path`: where to write.
    - `obj`: a `bridge.Tree` or a native model (anything `bridge.to_neutral` takes).
    - `metadata`: optional `dict[str, str]` stored with the arrays (safetensors,
      orbax); `bridge inspect` shows it.
    - `layout`: `"torch"` writes a plain PyTorch-layout safetensors file (no bridge
      metadata, `{"format": "pt"}` as PyTorch's writers add), as
      `safetensors.torch.save_file(module.state_dict(), path)` would: `nn.Linear`
      weights `(out, in)`, OIHW convolutions, `running_mean`/`running_var` (and
      `num_batches_tracked` 0), fused `in_proj_weight`. Layers are named by their
      dotted paths, or by `rules` read backwards. Default: the model's own layout.
    - `rules`: with `layout="torch"`, the rules that imported the PyTorch model
      (`{PyTorch layer regex: this model's layer path}`, as given to `bridge.port`):
      each is read backwards to name the layers as the PyTorch model does. A rule is
      reversible when its regex is literal text and capturing groups, each used in
      the replacement.
    - `prefix`: with `layout="torch"`, put before every name (`"bert."`), as
      Hugging Face's `base_model_prefix`.
    - `quantize`: with `layout="torch"` and a `*.safetensors` path, `"fp8-block"`
      writes each linear layer's weight (but `lm_head`) as `float8_e4m3fn` with a
      float32 `weight_scale_inv` per 128x128 block, and the matching
      `quantization_config` into the `config.json` beside the file (DeepSeek-V3's
      form, read by transformers and serving engines). See the quantized
      checkpoints guide.
    - `opt_state`: optional, the optimizer state made for `obj`'s parameters: an
      optax state (`tx.init(params)`, `step.init(tree)`), an `nnx.Optimizer` or a
      Linen `TrainState` (their step is saved too). See "Resuming training in
      another framework" in the checkpoints guide.
    - `step`: optional, the step count (an int).
    - `extra`: optional `{name: array}` saved with it (a PRNG key, a data loader's
      position).
    - `max_shard_size`, `config`, `generation_config`: with `layout="torch"` and a
      folder `path` (no `.safetensors` suffix): a Hugging Face model folder as
      `save_pretrained` writes it: shards of at most `max_shard_size` (bytes, or
      `"5GB"`; default `"50GB"`) named `model-00001-of-00003.safetensors` with
      `model.safetensors.index.json` (one `model.safetensors` when one shard holds
      everything), and `config.json` / `generation_config.json` from a transformers
      configuration object, a dict, or the folder the weights came from. Written
      atomically as a whole (a temporary folder swapped in); under
      `jax.distributed`, called in every process, each writes only its own shards'
      bytes.
    - `packed_experts`: with a Hugging Face folder, a model family (`"qwen2_moe"`,
      `"mixtral"`) whose per-expert weights (`mlp.experts.{e}.gate_proj.weight`, as
      a stack of experts is written) are written packed as transformers v5 holds
      them (`mlp.experts.gate_up_proj` `(E, 2F, D)`, `mlp.experts.down_proj`).

    **Returns:**

    Nothing.

    **Example:**

    ```python
    >>> import bridge, tempfile, os
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> path = os.path.join(tempfile.mkdtemp(), "linear.safetensors")
    >>> bridge.save(path, model, metadata={"step": "100"})
    >>> bridge.load(path).kernel.shape
    (2, 3)

    ```
    """
    path = _path(path)
    check_model(obj, "obj")
    check_str(layout, "layout", optional=True)
    check_rules(rules)
    check_str(prefix, "prefix")
    check_step(step)
    check_extra(extra)
    training = opt_state is not None or step is not None or extra is not None
    folder = {"max_shard_size": max_shard_size, "config": config}
    folder["generation_config"] = generation_config
    folder["packed_experts"] = packed_experts
    if layout is None and any(v is not None for v in folder.values()):
        raise ValueError(_FOLDER_OPTIONS.format(options=_given(folder)))
    if layout is not None or rules is not None or prefix or quantize is not None:
        if training:
            raise ValueError(
                "A PyTorch-layout file holds the model's arrays only: save the "
                "training state (`opt_state`, `step`, `extra`) in bridge's layout."
            )
        tree = to_neutral(obj)
        _save_layout(path, tree, metadata, layout, rules, prefix, folder, quantize)
        return
    tree = to_neutral(obj)
    contents, arrays = describe(tree, metadata)
    if training:
        contents, arrays = _training.add(contents, arrays, tree, opt_state, step, extra)
    write(path, contents, arrays)


def _path(path: Any) -> Path:
    """`path` as a Path, or `TypeError`/`ValueError` naming the argument."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"`path` must be a str or os.PathLike, got {type(path).__name__}."
        )
    if os.fspath(path) in ("", "."):
        raise ValueError(f"`path` must name a file or directory, got {path!r}.")
    return Path(path)


_FOLDER_OPTIONS = """\
{options} apply to a Hugging Face folder only: pass layout="torch" and a folder path
(no .safetensors suffix): bridge.save("out/model", model, layout="torch", ...)."""


def _given(options: Mapping[str, Any]) -> str:
    return ", ".join(f"`{k}`" for k, v in options.items() if v is not None)


_QUANTIZE_FOLDER = """\
{path}: `quantize` writes one *.safetensors file (and the quantization_config into the
config.json beside it); a Hugging Face folder is not written quantized yet."""

_LAYOUT_OPTIONS = """\
`layout` must be "torch" (or None for the model's own layout), got {layout!r}; `rules`
and `prefix` apply only with layout="torch"."""


def _save_layout(
    path: Path,
    tree: Tree,
    metadata: Mapping[str, str] | None,
    layout: str | None,
    rules: Mapping[str, str] | None,
    prefix: str,
    folder: Mapping[str, Any],
    quantize: str | None = None,
) -> None:
    if layout != "torch":
        raise ValueError(_LAYOUT_OPTIONS.format(layout=layout))
    _quant_write.check(quantize)
    user = dict(metadata or {})
    bad = [f"{k!r}: {v!r}" for k, v in user.items() if not _both_str(k, v)]
    if bad:
        raise TypeError(_NOT_STRINGS.format(problems=", ".join(bad)))
    if not format_of(path).suffixes:  # a folder: save_pretrained's layout
        if quantize is not None:
            raise ValueError(_QUANTIZE_FOLDER.format(path=path))
        if not path.parent.is_dir():
            raise FileNotFoundError(
                f"{path.parent}: no such directory to save {path.name} in."
            )
        _hf_folder.save_folder(
            path, tree, rules=rules, prefix=prefix, metadata=user, **folder
        )
        return
    if format_of(path) is not _safetensors.FORMAT:
        raise ValueError(
            f"{path}: a PyTorch-layout checkpoint is a safetensors file (name it "
            "*.safetensors) or a Hugging Face folder (a path without a suffix)."
        )
    if any(v is not None for v in folder.values()):
        raise ValueError(_FOLDER_OPTIONS.format(options=_given(folder)))
    kinds: dict[str, str] = {}
    state = torch_state(tree, rules, prefix, kinds=kinds)
    if quantize is not None:
        linear = {n.rpartition(".")[0] for n, k in kinds.items() if k == "Dense"}
        state = _quant_write.quantized_state(state, linear)
    tensors = tuple(
        Stored(k, (k,), "params", tuple(np.shape(v)), str(v.dtype))
        for k, v in state.items()
    )
    contents = Contents(path, "safetensors", None, "", None, (), user, tensors)
    _safetensors.save_plain(path, contents, state, {**user, "format": "pt"})
    if quantize is not None:
        _quant_write.write_config(path.parent)


# --- reading ------------------------------------------------------------------------


def _fits_jax(dtype: np.dtype) -> bool:
    """Whether JAX holds `dtype` as it is (not 64-bit while `jax_enable_x64` is off)."""
    return jax.dtypes.canonicalize_dtype(dtype) == dtype


def open_checkpoint(path: str | os.PathLike) -> Contents:
    """Open a checkpoint and read what it holds from its header (no array is read).

    The checkpoint stays open in the result (`Contents.source`) so that `read` takes
    the arrays from the very file the header came from; close it with
    `contents.close()` or `with open_checkpoint(path) as contents:`.

    Raises `bridge.CheckpointError` naming the file for anything that is not a
    readable checkpoint (also a `FileNotFoundError` for a missing path and a
    `PermissionError` for one this user may not read).
    """
    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise _pickle(path)
    if path.is_dir():  # a Hugging Face save_pretrained directory, or orbax
        index = _sharded.index_of(path)
        if index is not None:
            return _sharded.FORMAT.metadata(index)
        if (path / "model.safetensors").is_file():
            return _safetensors.FORMAT.metadata(path / "model.safetensors")
        if (path / "pytorch_model.bin").is_file():  # a Hugging Face folder of v4
            raise _pickle(path / "pytorch_model.bin")
        fmt = next(f for f in formats() if not f.suffixes)
    else:
        fmt = format_of(path)
    return fmt.metadata(path)


def read(
    contents: Contents, shardings: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Every array of a checkpoint as a JAX array, by dotted name, one at a time
    (typed PRNG keys re-wrapped). `shardings` places arrays (by name).

    A 64-bit array (`int64`, `uint64`, `float64`, `complex128`) while
    `jax_enable_x64` is off stays a NumPy array: JAX would truncate it silently."""
    shardings = shardings or {}
    by_name = {s.key: s for s in contents.tensors}
    out = {}
    for name, array in format_named(contents.format).restore(contents, shardings):
        impl, sharding = by_name[name].prng_impl, shardings.get(name)
        if isinstance(array, np.ndarray) and not _fits_jax(array.dtype):
            out[name] = np.array(array)  # 64-bit with x64 off: kept whole, in NumPy
            continue
        if isinstance(array, np.ndarray):  # host memory the format made: moved once,
            # each device taking only its own shard
            if impl is None and sharding is not None:
                array = place(array, sharding)
            else:
                array = jax.device_put(array)
        if impl is not None:
            array = jax.random.wrap_key_data(array, impl=impl)
        out[name] = place(array, sharding)
    return out


_LAZY = (_safetensors.NAME, _sharded.NAME, _gguf.NAME)  # read array by array


def _lazy(contents: Contents, dtype: Any = None) -> dict[str, Any]:
    """Every array of a safetensors or sharded checkpoint by dotted name, as a
    `LazyArray` that `bridge.port` reads when it converts its layer (then places and
    drops it), so that a port holds the model being filled plus about one array of
    the file. Typed PRNG keys and 64-bit arrays JAX would truncate (small) are read
    now, as `read` gives them. The tensors of each quantized weight come as one
    `LazyArray` that dequantizes them into `dtype` (`bridge._quant._read`)."""
    raw = lazy_arrays(contents)
    assert raw is not None  # a format in _LAZY
    arrays: dict[str, Any] = dense(contents, raw, dtype)
    for s in contents.tensors:
        if s.key not in arrays:  # a part of a quantized weight
            continue
        if s.prng_impl is not None:
            data = jax.device_put(arrays[s.key].read())
            arrays[s.key] = jax.random.wrap_key_data(data, impl=s.prng_impl)
        elif not _fits_jax(np.dtype(arrays[s.key].dtype)):
            arrays[s.key] = np.array(arrays[s.key].read())
    return arrays


def _natural(path: tuple) -> tuple:
    return tuple((0, k, "") if isinstance(k, int) else (1, 0, k) for k in path)


def _resolve(name: str) -> type | None:
    """The class named `module:qualname`, found only among modules already imported,
    by their `__dict__` (nothing is imported, no attribute of a module is touched, so
    no module `__getattr__` or property runs); None when there is no such class."""
    module, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        namespace = _namespace(obj)
        if namespace is None:
            return None
        obj = namespace.get(part)
    return obj if issubclass(type(obj), type) else None


def _namespace(obj: Any) -> Mapping[str, Any] | None:
    """The `__dict__` of a module or a class, read without calling anything of it."""
    if issubclass(type(obj), type):
        return vars(type)["__dict__"].__get__(obj)
    if issubclass(type(obj), types.ModuleType):
        return vars(types.ModuleType)["__dict__"].__get__(obj)
    return None


def file_tree(contents: Contents, arrays: Mapping[str, Any]) -> Tree:
    """The Tree of a checkpoint's arrays, with their roles.

    From a file of a framework whose adapter reads files itself (`from_file`:
    Equinox, whose native model is then a skeleton, `bridge._adapters._skeleton`):
    that framework's Tree. Each module's class is its kind where that class is
    already imported. From any other file: the Tree of Linen-style variables
    (`{role: {module: {name: array}}}`, Flax's layout), so `bridge.to_native` gives
    that dict.
    """
    if contents.layout == "torch":  # files sort names: 2 before 10, as PyTorch
        # (by `arrays`' names: a quantized weight's parts are one array there;
        # a name whose path lost a `prefix=` goes by that path)
        renamed = {s.key: dotted(s.path) for s in contents.tensors}
        ordered = sorted(arrays, key=lambda name: _natural(split(name)))
        state = {renamed.get(name, name): arrays[name] for name in ordered}
        if _experts.has_packed(state):  # transformers v5: read per expert
            state = _experts.unpack(state)
        return from_torch(state)
    kinds = {p: cls for p, c, _ in contents.modules if (cls := _resolve(c))}
    adapter = registered(contents.framework)
    if adapter is not None and adapter.from_file is not None:
        tensors = [(s.path, s.role, arrays[s.key]) for s in contents.tensors]
        modules = {p: (c, f) for p, c, f in contents.modules}
        return adapter.from_file(tensors, modules, kinds)
    variables: dict[str, Any] = {}
    for s in contents.tensors:
        node = variables.setdefault(s.role, {})
        for key in s.path[:-1]:
            node = node.setdefault(key, {})
        node[s.path[-1]] = arrays[s.key]
    for role, path in contents.empty:  # checked: none holds or is inside an array
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


def _without_prefix(contents: Contents, prefix: str) -> Contents:
    """`contents` with `prefix` (dotted: `"model."`) taken off the paths that start
    with it; the names the arrays are read by stay."""
    head = tuple(k for k in prefix.split(".") if k)
    n = len(head)
    tensors = tuple(
        dataclasses.replace(s, path=s.path[n:])
        if tuple(map(str, s.path[:n])) == head and len(s.path) > n
        else s
        for s in contents.tensors
    )
    modules = tuple(
        (p[n:], c, f) if tuple(map(str, p[:n])) == head else (p, c, f)
        for p, c, f in contents.modules
    )
    return dataclasses.replace(contents, tensors=tensors, modules=modules)


_PREFIX_HINT = """
Most of the missing arrays are in the file under {prefix!r}: pass prefix={prefix!r}."""


def _prefix_hint(contents: Contents, target: Tree) -> str:
    """A sentence proposing `prefix=` when stripping one would name most of
    `target`'s arrays, else nothing."""
    wanted = {dotted(p) for p in source_of(target).paths}
    names = [dotted(s.path) for s in contents.tensors]
    heads = {n.split(".")[0] + "." for n in names if "." in n}
    for head in sorted(heads):
        hits = sum(n.removeprefix(head) in wanted for n in names if n.startswith(head))
        if hits and hits >= len(wanted) // 2:
            return _PREFIX_HINT.format(prefix=head)
    return ""


_LOG = logging.getLogger("bridge")


def _report(plan: Any, path: Path, like: Any) -> None:
    """Log what a non-strict load left as it was, as Hugging Face's
    `from_pretrained` does."""
    name = type(like).__name__
    if plan.unexpected:
        _LOG.warning(
            "Some weights of the checkpoint at %s were not used when initializing "
            "%s: %s",
            path,
            name,
            list(plan.unexpected),
        )
    if plan.missing:
        _LOG.warning(
            "Some weights of %s were not initialized from the checkpoint at %s and "
            "keep their values: %s\nYou should probably TRAIN this model.",
            name,
            path,
            list(plan.missing),
        )
    if plan.mismatched:
        _LOG.warning(
            "Some weights of %s were not initialized from the checkpoint at %s and "
            "keep their values because the shapes did not match:\n- %s\nYou should "
            "probably TRAIN this model.",
            name,
            path,
            "\n- ".join(plan.mismatched),
        )
    if plan.dropped:
        _LOG.info("Left out by rules: %s", list(plan.dropped))


def _cast(array: Any, dtype: Any) -> Any:
    """`array` as `dtype` if both are floating point, else as it is."""
    if dtype is None or not jnp.issubdtype(array.dtype, jnp.floating):
        return array
    return array.astype(dtype)


def _problems(contents: Contents, target: Tree, dtype: Any = None) -> list[str]:
    """Every missing, unexpected, shape and dtype problem of filling `target` from the
    file (with `dtype`, floating-point arrays are cast: their dtypes may differ)."""
    stored = {s.key: s for s in contents.tensors}
    flat = jtu.tree_flatten_with_path(target)[0]
    problems = []
    for keypath, leaf in flat:
        name = dotted(path_of(keypath))
        where = jtu.keystr(keypath)
        if name not in stored:
            problems.append(f"  missing {where} (no '{name}' in the file)")
            continue
        shape, saved = stored.pop(name).logical
        if shape != tuple(np.shape(leaf)):
            problems.append(
                f"  {where}: shape {shape} in the file, {np.shape(leaf)} in `like`"
            )
        cast = dtype is not None and all(
            jnp.issubdtype(d, jnp.floating) for d in (saved, leaf.dtype)
        )
        if saved != str(leaf.dtype) and not cast:
            problems.append(
                f"  {where}: dtype {saved} in the file, {leaf.dtype} in `like` "
                "(pass dtype= to cast floating-point arrays)"
            )
    problems += [
        f"  unexpected '{name}' in the file (not in `like`)" for name in stored
    ]
    return problems


def _fill(contents: Contents, target: Tree, dtype: Any = None) -> Tree:
    """`target` with every leaf read from the checkpoint, with `target`'s shardings
    (and cast to `dtype`)."""
    shardings = {}
    for keypath, leaf in jtu.tree_flatten_with_path(target)[0]:
        sharding = sharding_of(leaf, jtu.keystr(keypath))
        if sharding is not None:
            shardings[dotted(path_of(keypath))] = sharding
    arrays = read(contents, shardings)
    return jtu.tree_map_with_path(
        lambda p, _: _cast(arrays[dotted(path_of(p))], dtype), target
    )


def load(
    path: str | os.PathLike,
    like: Any = None,
    *,
    dtype: Any = None,
    opt_state_like: Any = None,
    rules: Mapping[str, str | None] | None = None,
    prefix: str = "",
    strict: bool = True,
) -> Any:
    """Load a checkpoint written by `bridge.save` (or any safetensors file).

    Arrays are read one at a time, from the file handle the header was read from, so
    memory stays near one copy of the model and a file replaced meanwhile is never
    mixed with its successor. Nothing in the file is executed or imported: the formats
    hold data only, and module classes recorded in the metadata are matched only
    against classes already imported (see the checkpoints guide, "Security").

    **Arguments:**

    - `path`: a `*.safetensors` or `*.msgpack` file, an orbax checkpoint directory,
      a `*.safetensors.index.json` file (a sharded checkpoint), or a Hugging Face
      folder (`save_pretrained`'s: `model.safetensors`, or shards and their
      `model.safetensors.index.json`).
    - `like`: optional, the model to fill: a `bridge.Tree` or a native model of any
      framework (anything `bridge.to_neutral` takes). Its arrays' shardings are kept.
      When the file has exactly `like`'s arrays (same dotted paths, shapes, dtypes)
      they are read straight into it; when it was saved from another framework, its
      arrays go through `bridge.port` (layers paired by kind, shape and order,
      layouts converted), read from a safetensors file as each layer is converted,
      so memory holds the filled model plus about one array of the file.
    - `dtype`: optional, the dtype every floating-point array is cast to as it is
      read (`jnp.bfloat16`, ...); default: the file's dtypes (with `like`, cast to
      `like`'s only where they agree, else an error naming the arrays).
    - `rules`: with `like`, as in `bridge.port`: `{source regex: target path}`
      pairs the file's layers with `like`'s by name (`{r"\\.model(.*)": r"\\1"}`),
      and a rule to `None` leaves the layers it matches out. The file is then
      always ported.
    - `prefix`: with `like`, stripped from the file's names that start with it
      (Hugging Face's `base_model_prefix`: `"model."`, `"transformer."`) before
      pairing: a file of `LlamaForCausalLM` into a model without the `model.` level.
    - `strict`: with `False`, as Hugging Face's `from_pretrained(...,
      ignore_mismatched_sizes=True)`: `like`'s layers the file does not fill, and
      layers whose shapes differ (a new head), keep `like`'s values; the file's
      layers that go nowhere are left out; all of them are logged as a warning
      (logger `"bridge"`) in the form Hugging Face uses. With `True` (the default),
      each is an error.
    - `opt_state_like`: optional, with `like`: the optimizer state to fill, as the
      target's optimizer makes it (`tx.init(params)`, `step.init(tree)`, an
      `nnx.Optimizer(model, tx, wrt=...)`, a Linen `TrainState`). The saved state
      is put into its form by `bridge.port_opt_state`, whatever framework it was
      saved from.

    **Returns:**

    Without `like`: a `bridge.Tree` of the file's arrays, with their roles (typed
    PRNG keys restored, sharded arrays with their saved sharding under orbax). From
    a Flax (Linen or NNX) file or any other safetensors file it is the Tree of
    Linen-style variables (`bridge.to_native` gives `{role: {module: {name:
    array}}}`); from an Equinox file, its native model is an inert skeleton holding
    the arrays and each module's recorded settings (enough for `bridge.port`, not
    callable). With `like`: the same kind of object as `like` (a Tree, an NNX
    module, an Equinox model or `(model, state)`, Linen variables, `(module,
    variables)` or a bound module), filled from the file. With `opt_state_like`: a
    named tuple `(model, opt_state, step, extra)`: the model as above, the optimizer
    state of `opt_state_like`'s kind, the saved step (or None), and the `extra`
    arrays by name.

    **Raises:**

    `bridge.CheckpointError` (a `ValueError`) naming the file and what is wrong for
    anything that is not a readable checkpoint (a truncated, corrupted or hostile
    file, a special file, a directory that is not a checkpoint; also a
    `FileNotFoundError` for a missing path); `TypeError`/`ValueError` naming the
    argument for a `path` that is not a path; `ValueError`
    listing every missing, unexpected, shape and dtype problem when a file of
    `like`'s own framework does not fit it; `bridge.PortError` listing every problem
    when a file of another framework cannot be ported into it; `ValueError` when
    `opt_state_like` is given for a file saved without an optimizer state.

    **Example:**

    ```python
    >>> import bridge, tempfile, os
    >>> from flax import nnx
    >>> path = os.path.join(tempfile.mkdtemp(), "linear.safetensors")
    >>> bridge.save(path, nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> model = bridge.load(path, like=nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
    >>> type(model).__name__
    'Linear'

    ```
    """
    path = _path(path)
    if like is not None:
        check_model(like, "like")
    check_dtype(dtype)
    target = None if like is None else to_neutral(placeholders(like))
    if target is None and opt_state_like is not None:
        raise TypeError("`opt_state_like` needs `like`, the model to load into.")
    model = saved = None
    with open_checkpoint(path) as everything:
        contents, training = _training.split(everything)
        if target is None:
            arrays = dequantized(contents, dtype)  # None: not quantized
            if arrays is None:
                arrays = {k: _cast(v, dtype) for k, v in read(contents).items()}
            return file_tree(contents, arrays)
        if prefix:
            contents = _without_prefix(contents, prefix)
        problems = _problems(contents, target, dtype)
        plan = None
        as_saved = rules is None and not prefix  # else: ported, by the paths
        if not problems and as_saved:
            # orbax restores into `like`'s shardings only when every array is named
            whole = everything if everything.format == "orbax" else contents
            source = _fill(whole, target, dtype)
            model = like_form(like, source)
        elif contents.framework == framework(target) and as_saved and strict:
            raise ValueError(
                _MISMATCH.format(path=contents.path, problems="\n".join(problems))
                + _prefix_hint(contents, target)
            )
        else:
            try:
                if contents.format in _LAZY:  # read while porting, array by array
                    source = file_tree(contents, _lazy(contents, dtype))
                    model, plan = port_and_plan(source, like, rules, strict, dtype)
                else:
                    source = file_tree(contents, read(contents))
            except PortError as error:
                error.add_note(_PORTING.format(path=contents.path))
                raise
        if opt_state_like is not None:
            saved = _training.read_state(everything, training)
    if model is None:
        try:
            model, plan = port_and_plan(source, like, rules, strict, dtype)
        except PortError as error:
            error.add_note(_PORTING.format(path=contents.path))
            raise
    if plan is not None:
        _report(plan, contents.path, like)
    if saved is None:
        return model
    return _training.restore(saved, source, model, opt_state_like)
