"""Reading a checkpoint: opening it (its format by suffix, a directory probed by the
formats), its arrays read one at a time and placed, or lazily, and read into a model
given as `like` (the fit checked first)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._paths import path_of
from .._placement import place, sharding_of
from .._progress import advance
from .._tree import Tree
from ._atomic import reachable
from ._contents import Contents, dotted
from ._errors import CheckpointError
from ._files import inode
from ._format import format_named, format_of, formats, probing
from ._plugins import dense


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


def fits_jax(dtype: np.dtype) -> bool:
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
    path = given = Path(path)
    found = None
    for attempt in range(_PROBES):
        path = reachable(given)  # a folder swap a killed save left half done
        if path.suffix in PICKLE_SUFFIXES:
            raise _pickle(path)
        before = inode(path)
        try:
            found = _probe(path) if path.is_dir() else format_of(path).metadata(path)
        except CheckpointError:
            if attempt == _PROBES - 1 or (path == given and inode(path) == before):
                raise
            # gone while it was read: where the filesystem cannot exchange two
            # directories, a save moves the old one aside (`reachable` gives it while
            # nothing is at `given`) and removes it once the new one is in place
            continue
        if found is not None or inode(path) == before:
            break
        # a save swapped the directory while it was probed: probe the one there now
    if found is not None:
        return found
    return next(f for f in formats() if not f.suffixes).metadata(path)


def _probe(directory: Path) -> Contents | None:
    """The contents of a Hugging Face `save_pretrained` directory or an orbax one,
    found by each format's probe; None where no probe knows it."""
    for fmt in probing():
        found = fmt.probe(directory) if fmt.probe is not None else None
        if found is not None:
            return fmt.metadata(found)
    if (directory / "pytorch_model.bin").is_file():  # a Hugging Face folder of v4
        raise _pickle(directory / "pytorch_model.bin")
    return None


_PROBES = 5


def read(
    contents: Contents,
    shardings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every array of a checkpoint as a JAX array, by dotted name, one at a time
    (typed PRNG keys re-wrapped). `shardings` places arrays (by name); each array's
    size in bytes is counted (`bridge._progress.advance`) once it is read.

    A 64-bit array (`int64`, `uint64`, `float64`, `complex128`) while
    `jax_enable_x64` is off stays a NumPy array: JAX would truncate it silently."""
    shardings = shardings or {}
    by_name = {s.key: s for s in contents.tensors}
    out: dict[str, Any] = {}
    batch: list[tuple[str, np.ndarray]] = []  # moved into JAX arrays by one call

    def flush() -> None:
        arrays = jax.device_put([array for _, array in batch]) if batch else []
        for (name, _), array in zip(batch, arrays, strict=True):
            out[name] = array
            advance(by_name[name].nbytes)
        batch.clear()

    for name, array in format_named(contents.format).restore(contents, shardings):
        impl, sharding = by_name[name].prng_impl, shardings.get(name)
        if (
            isinstance(array, np.ndarray)
            and fits_jax(array.dtype)
            and impl is None
            and sharding is None
        ):
            batch.append((name, array))
            if len(batch) >= BATCH:
                flush()
            continue
        out[name] = _placed(array, impl, sharding)
        advance(by_name[name].nbytes)
    flush()
    return {name: out[name] for name in by_name if name in out}


# host arrays moved to the device by one `jax.device_put` call (a call costs ~30 µs
# of Python whatever its size; the memory a read filled is used as it is, not copied)
BATCH = 1024


def _placed(array: Any, impl: str | None, sharding: Any) -> Any:
    """An array as a format restored it, as `read` gives it: on its devices."""
    if isinstance(array, np.ndarray) and not fits_jax(array.dtype):
        return np.array(array)  # 64-bit with x64 off: kept whole, in NumPy
    if isinstance(array, np.ndarray):  # host memory the format made: moved once,
        # each device taking only its own shard
        if impl is None and sharding is not None:
            array = place(array, sharding)
        else:
            array = jax.device_put(array)
    if impl is not None:
        array = jax.random.wrap_key_data(array, impl=impl)
    return place(array, sharding)


def lazy(contents: Contents, dtype: Any = None) -> dict[str, Any] | None:
    """Every array of a checkpoint whose format reads lazily (`Format.lazy`: the
    safetensors formats) by dotted name, as a `LazyArray` that `bridge.port` reads
    when it converts its layer (then places and drops it), so that a port holds the
    model being filled plus about one array of the file. Typed PRNG keys and 64-bit
    arrays JAX would truncate (small) are read now, as `read` gives them. None when
    the format reads no array lazily. The tensors of each quantized weight come as
    one `LazyArray` that dequantizes them into `dtype` (as a plug-in reads them:
    `bridge._io._plugins`)."""
    fmt = format_named(contents.format)
    if fmt.lazy is None:
        return None
    stored = fmt.lazy(contents)
    found = dense(contents, stored, dtype)
    arrays: dict[str, Any] = dict(stored) if found is None else found
    for s in contents.tensors:
        if s.key not in arrays:  # a part of a quantized weight
            continue
        if s.prng_impl is not None:
            data = jax.device_put(arrays[s.key].read())
            arrays[s.key] = jax.random.wrap_key_data(data, impl=s.prng_impl)
        elif not fits_jax(np.dtype(arrays[s.key].dtype)):
            arrays[s.key] = np.array(arrays[s.key].read())
    return arrays


def read_all(contents: Contents, dtype: Any = None) -> dict[str, Any]:
    """Every array of a checkpoint, read now, floating-point ones cast to `dtype`
    (what `load` without `like` gives): by `read`, or where a plug-in changes the
    file's arrays (`_plugins.dense`: quantized weights dequantized), each as it
    gives it. A 64-bit array JAX would truncate stays a NumPy array."""
    fmt = format_named(contents.format)
    found = None if fmt.lazy is None else dense(contents, fmt.lazy(contents), dtype)
    if found is None:
        return {k: cast(v, dtype) for k, v in read(contents).items()}
    out = {}
    for name, array in found.items():
        value = array.read()
        if not fits_jax(value.dtype):
            out[name] = np.array(value)
            continue
        if dtype is not None and jnp.issubdtype(value.dtype, jnp.floating):
            value = value.astype(jnp.dtype(dtype))
        out[name] = jnp.asarray(value)
    return out


def cast(array: Any, dtype: Any) -> Any:
    """`array` as `dtype` if both are floating point, else as it is."""
    if dtype is None or not jnp.issubdtype(array.dtype, jnp.floating):
        return array
    return array.astype(dtype)


def misfits(contents: Contents, target: Tree, dtype: Any = None) -> list[str]:
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


def fill(contents: Contents, target: Tree, dtype: Any = None) -> Tree:
    """`target` with every leaf read from the checkpoint, with `target`'s shardings
    (and cast to `dtype`)."""
    shardings = {}
    for keypath, leaf in jtu.tree_flatten_with_path(target)[0]:
        sharding = sharding_of(leaf, jtu.keystr(keypath))
        if sharding is not None:
            shardings[dotted(path_of(keypath))] = sharding
    arrays = read(contents, shardings)
    return jtu.tree_map_with_path(
        lambda p, _: cast(arrays[dotted(path_of(p))], dtype), target
    )


def without_prefix(contents: Contents, prefix: str) -> Contents:
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


def prefix_hint(contents: Contents, target: Tree) -> str:
    """A sentence proposing `prefix=` when stripping one would name most of
    `target`'s arrays, else nothing."""
    wanted = {dotted(path_of(p)) for p, _ in jtu.tree_flatten_with_path(target)[0]}
    names = [dotted(s.path) for s in contents.tensors]
    heads = {n.split(".")[0] + "." for n in names if "." in n}
    for head in sorted(heads):
        hits = sum(n.removeprefix(head) in wanted for n in names if n.startswith(head))
        if hits and hits >= len(wanted) // 2:
            return _PREFIX_HINT.format(prefix=head)
    return ""
