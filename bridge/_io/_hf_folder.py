"""A Hugging Face model folder, written as `save_pretrained` writes it, atomically as
a whole, from one process or from every process of a `jax.distributed` run.

The folder holds `model.safetensors` (one shard) or `model-00001-of-0000N.safetensors`
shards with `model.safetensors.index.json` (`metadata.total_size`, `weight_map`),
`{"format": "pt"}` in every shard's metadata, and the `config.json` (and
`generation_config.json`) given. Shards are cut as `huggingface_hub` cuts them (in
order, a new shard when the next tensor would pass `max_shard_size`; a tensor larger
than it alone in its shard).

Every byte's place is known before any is written: the plan (`plan_folder`) needs only
the names, shapes and dtypes. Process 0 creates each shard at its final size with its
header; then every process writes the bytes of the array shards it holds (those with
`replica_id == 0`, so each byte once) with positioned writes, a shard split along a
later axis as one write per contiguous run, never gathered; process 0 then writes the
index and the configuration. All of it goes into a temporary directory next to the
folder, swapped in at the end (`_atomic.atomic_dir`): a save killed at any point
leaves the previous folder as it was, and the next save clears what it left.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from .._families import _experts
from .._families._diffusers import STEMS, weights_stem
from .._families._experts import Place
from .._progress import advance
from .._tree import Tree
from ._atomic import _barrier, _fsync, atomic_dir
from ._config import written_type
from ._reference import Reference, check, config_reference
from ._safetensors import _CODES, _PACKED, _nbytes, _to_bytes
from ._save_checks import check_plain_names
from ._sharded import INDEX_SUFFIX
from ._torch_layout import TorchLayer, torch_layers


_SUFFIX = ".safetensors"
CONFIGS = ("config.json", "generation_config.json")
DEFAULT_SHARD_SIZE = "50GB"  # save_pretrained's default
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # huggingface_hub's

_BAD_SIZE = """\
`max_shard_size` must be a positive number of bytes or a string such as "5GB" (units \
KB, MB, GB, TB, powers of 1000 as in save_pretrained), got {value!r}."""

_NOT_A_FOLDER = """\
{path} exists and is not a Hugging Face model folder (no model.safetensors, index or \
config.json in it, and not empty); bridge.save refuses to replace it. Save to a new \
folder, or remove it yourself first."""

_CONFIG = """\
`{name}` must be a transformers configuration object, a dict, or the folder the \
weights came from (holding {file}), got {value!r}."""

_PACKED_SPREAD = """\
{names}: {dtype} arrays are stored packed (two per byte) and cannot be written by \
several processes; gather them first."""


def shard_size(value: int | str) -> int:
    """`max_shard_size` in bytes: an int, or `"5GB"`-style text (KB, MB, GB, TB in
    powers of 1000, as `save_pretrained` reads it).

    ```python
    >>> shard_size("5MB"), shard_size(1024)
    (5000000, 1024)

    ```
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(_BAD_SIZE.format(value=value))
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str) and value.strip()[-2:].upper() in _UNITS:
        text = value.strip()
        try:
            number = float(text[:-2])
        except ValueError:
            number = -1.0
        if number > 0 and math.isfinite(number):
            return int(number * _UNITS[text[-2:].upper()])
    raise ValueError(_BAD_SIZE.format(value=value))


class Entry(NamedTuple):
    """Where one tensor goes: its shard's file name, safetensors dtype code, shape,
    and byte offset of its data within the file."""

    file: str
    code: str
    shape: tuple[int, ...]
    offset: int


class FolderPlan(NamedTuple):
    """Every file of the folder's weights: each shard's file name with its header
    (the bytes before the data) and size; each tensor's `Entry`; the index (None for
    a single `model.safetensors`)."""

    shards: dict[str, tuple[bytes, int]]
    entries: dict[str, Entry]
    index: dict | None


def _split(sizes: Iterable[tuple[str, int]], limit: int) -> list[list[str]]:
    """Names cut into shards as `huggingface_hub.split_torch_state_dict_into_shards`
    cuts them."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes:
        if size > limit:  # alone in its own shard
            shards.append([name])
            continue
        if current and used + size > limit:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        shards.append(current)
    return shards


def plan_folder(
    tensors: Iterable[tuple[str, tuple[int, ...], Any]],
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    stem: str = STEMS[0],
) -> FolderPlan:
    """The layout of a folder holding `tensors` (`(name, shape, dtype)`, in the order
    they are written), from shapes alone; its files named `stem` (transformers'
    `model`, diffusers' `diffusion_pytorch_model`: `_families._diffusers`).

    ```python
    >>> plan = plan_folder([("a", (4,), "float32"), ("b", (4,), "float32")], 16)
    >>> list(plan.shards), plan.index["weight_map"]["b"]
    (['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'], \
'model-00002-of-00002.safetensors')

    ```
    """
    limit = shard_size(max_shard_size)
    described = {
        name: (_CODES[str(np.dtype(dtype))], tuple(int(d) for d in shape))
        for name, shape, dtype in tensors
    }
    nbytes = {n: _nbytes(code, shape) or 0 for n, (code, shape) in described.items()}
    groups = _split(nbytes.items(), limit)
    count = len(groups)
    meta = {**(metadata or {}), "format": "pt"}
    shards: dict[str, tuple[bytes, int]] = {}
    entries: dict[str, Entry] = {}
    for i, names in enumerate(groups):
        file = (
            stem + _SUFFIX
            if count == 1
            else f"{stem}-{i + 1:05d}-of-{count:05d}{_SUFFIX}"
        )
        header: dict[str, Any] = {"__metadata__": meta}
        begin = 0
        for name in names:
            code, shape = described[name]
            header[name] = {
                "dtype": code,
                "shape": list(shape),
                "data_offsets": [begin, begin + nbytes[name]],
            }
            begin += nbytes[name]
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        head = len(text).to_bytes(8, "little") + text
        shards[file] = (head, len(head) + begin)
        for name in names:
            start = header[name]["data_offsets"][0]
            entries[name] = Entry(file, *described[name], len(head) + start)
    index = None
    if count > 1:
        index = {
            "metadata": {
                "total_parameters": sum(math.prod(s) for _, s in described.values()),
                "total_size": sum(nbytes.values()),
            },
            "weight_map": {name: entries[name].file for name in described},
        }
    return FolderPlan(shards, entries, index)


# --- writing bytes --------------------------------------------------------------------


def _bounds(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """A shard's index (slices) as `(start, stop)` per axis."""
    out = []
    for axis, size in enumerate(shape):
        s = index[axis] if axis < len(index) else slice(None)
        start, stop, _ = s.indices(size)
        out.append((start, stop))
    return out


def runs(
    index: tuple, shape: tuple[int, ...], itemsize: int
) -> Iterator[tuple[int, int]]:
    """The contiguous byte ranges `(offset in the array, length)` that a block
    `array[index]` occupies in the C-order array of `shape`, in the block's own
    C order: one range for a block of leading rows, one per row for a block cut
    along a later axis.

    ```python
    >>> list(runs((slice(0, 2), slice(2, 4)), (2, 4), 1))   # columns 2..3
    [(2, 2), (6, 2)]

    ```
    """
    bounds = _bounds(index, shape)
    cut = [a for a, (lo, hi) in enumerate(bounds) if (lo, hi) != (0, shape[a])]
    last = cut[-1] if cut else -1
    inner = math.prod(shape[last + 1 :])
    if last < 0:
        yield 0, inner * itemsize
        return
    lo, hi = bounds[last]
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    for outer in itertools.product(*(range(*bounds[a]) for a in range(last))):
        start = sum(i * strides[a] for a, i in enumerate(outer)) + lo * strides[last]
        yield start * itemsize, (hi - lo) * inner * itemsize


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def write_block(fd: int, entry: Entry, index: tuple, block: np.ndarray) -> int:
    """Write `block` (the values of `array[index]`) into its place in the open shard
    `fd`; returns the bytes written."""
    data = _to_bytes(np.asarray(block)).data
    if entry.code in _PACKED:  # whole arrays only (checked by the caller)
        _pwrite(fd, data, entry.offset)
        return len(data)
    done = 0
    for start, length in runs(index, entry.shape, np.dtype(block.dtype).itemsize):
        _pwrite(fd, data[done : done + length], entry.offset + start)
        done += length
    return done


def _inside(place: Place, index: tuple, shape: tuple[int, ...]) -> tuple:
    """The index in the packed tensor of block `index` of an expert's weight."""
    (lo, hi), *rest = _bounds(index, shape)
    return (
        slice(place.expert, place.expert + 1),
        slice(place.row + lo, place.row + hi),
        *(slice(a, b) for a, b in rest),
    )


def _own_blocks(array: Any) -> Iterator[tuple[tuple, Any]]:
    """The blocks of `array` this process writes: `(index, values)` for each shard it
    holds with `replica_id == 0`; a host array whole, by process 0."""
    if isinstance(array, jax.Array):
        for shard in array.addressable_shards:
            if shard.replica_id == 0:
                yield shard.index, shard.data
    elif jax.process_index() == 0:
        yield (), array


# --- the folder -----------------------------------------------------------------------


def is_model_folder(path: Path) -> bool:
    """Whether `path` may be replaced by a save: empty, or holding weights (of
    transformers' or diffusers' names) or a `config.json`."""
    names = {p.name for p in path.iterdir()}
    weights = {stem + end for stem in STEMS for end in (_SUFFIX, INDEX_SUFFIX)}
    return not names or bool(names & {*weights, CONFIGS[0]})


def _is_weights(name: str) -> bool:
    """Whether `name` is a weights file of transformers' or diffusers' names (a
    save replaces them all: a folder's weights change library with its config)."""
    return any(
        name in (stem + _SUFFIX, stem + INDEX_SUFFIX)
        or (name.startswith(stem + "-") and name.endswith(_SUFFIX))
        for stem in STEMS
    )


def config_files(config: Any, generation_config: Any = None) -> dict[str, str]:
    """`{file name: JSON text}` for `config.json` and `generation_config.json`, from
    a transformers configuration object, a dict, or a folder holding the files."""
    out: dict[str, str] = {}
    for name, file, value in (
        ("config", CONFIGS[0], config),
        ("generation_config", CONFIGS[1], generation_config),
    ):
        if value is None:
            continue
        if isinstance(value, str | os.PathLike) and Path(value).is_file():
            out[file] = Path(value).read_text()
        elif isinstance(value, str | os.PathLike):
            folder = Path(value)
            found = [f for f in CONFIGS if (folder / f).is_file()]
            if file not in found:
                raise ValueError(_CONFIG.format(name=name, file=file, value=value))
            wanted = found if name == "config" and generation_config is None else [file]
            for f in wanted:
                out[f] = (folder / f).read_text()
        elif isinstance(value, Mapping):
            out[file] = json.dumps(dict(value), indent=2, sort_keys=True) + "\n"
        elif callable(getattr(value, "to_json_string", None)):
            out[file] = value.to_json_string(use_diff=True)
        else:
            raise TypeError(_CONFIG.format(name=name, file=file, value=value))
    return out


class _Shards:
    """The shard files of a folder being written, each opened for writing when a
    block goes to it, at most `limit` open at once (the least recently used flushed
    and closed, opened again later): 1,100 shards under the usual 1,024-descriptor
    limit. Every file is flushed (`fsync`) before it is closed."""

    limit = 64

    def __init__(self, directory: Path):
        self.directory = directory
        self._open: collections.OrderedDict[str, int] = collections.OrderedDict()

    def fd(self, file: str) -> int:
        fd = self._open.pop(file, None)
        if fd is None:
            while len(self._open) >= self.limit:
                self._close(*self._open.popitem(last=False))
            fd = os.open(self.directory / file, os.O_WRONLY | os.O_CLOEXEC)
        self._open[file] = fd  # the most recently used
        return fd

    @staticmethod
    def _close(file: str, fd: int) -> None:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def __enter__(self) -> _Shards:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        error = None
        while self._open:
            try:
                self._close(*self._open.popitem(last=False))
            except OSError as e:  # closed all the same; the first error is raised
                error = error or e
        if error is not None and kind is None:
            raise error


_DISAGREE = """\
{path}: the processes of this jax.distributed run would write different files \
({what} differ between process 0 and process(es) {others}); each process computes the \
folder's headers and byte offsets, and they must agree. Pass the same `metadata=`, \
model and `max_shard_size` in every process."""


def _digest(value: Any) -> np.ndarray:
    text = json.dumps(value, sort_keys=True, default=repr).encode()
    return np.frombuffer(hashlib.sha256(text).digest(), np.uint8)


def _agreed(path: Path, plan: FolderPlan, metadata: Mapping[str, str] | None) -> None:
    """With several processes, refuse (in every process, before anything is written)
    a plan that is not the same in every process: a process whose headers differ
    would write its bytes at other offsets than process 0's headers say."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = np.stack(
        [
            _digest(dict(metadata or {})),
            _digest([(f, h.hex(), n) for f, (h, n) in plan.shards.items()]),
        ]
    )
    every = np.asarray(multihost_utils.process_allgather(mine))
    others = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
    if others:
        meta = any(not np.array_equal(every[i][0], every[0][0]) for i in others)
        what = "their `metadata=`" if meta else "the headers (names, shapes, dtypes)"
        names = ", ".join(map(str, others))
        raise ValueError(_DISAGREE.format(path=path, what=what, others=names))


class Written(NamedTuple):
    """What one process wrote: bytes of array data, and the plan."""

    nbytes: int
    plan: FolderPlan


def write_folder(
    path: Path,
    layers: Iterable[tuple[Any, Any]],
    tensors: list[tuple[str, tuple[int, ...], Any]],
    *,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    configs: Mapping[str, str] | None = None,
    metadata: Mapping[str, str] | None = None,
    places: Mapping[str, Place] | None = None,
) -> Written:
    """Write a Hugging Face model folder at `path`, atomically as a whole.

    `tensors` lists every `(name, shape, dtype)` in order; `layers` yields
    `(encode, leaves)` pairs, `encode(leaves)` giving `{name: array}` for some of
    them (called one at a time, so that only one layer's converted arrays live at
    once). Arrays may be host arrays or `jax.Array`s, sharded over the processes of
    a `jax.distributed` run: every process calls this, and each writes only the
    bytes of the shards it holds. `configs` are written as they are
    (`config_files`); the previous folder's other files are kept. `places` puts
    arrays into part of another tensor of `tensors` (experts into their packed
    tensor, `_experts.packing`).
    """
    places = places or {}
    if os.path.lexists(path) and not (path.is_dir() and is_model_folder(path)):
        raise FileExistsError(_NOT_A_FOLDER.format(path=path))
    check_plain_names(path, (name for name, _, _ in tensors))
    stem = _stem(configs)
    plan = plan_folder(tensors, max_shard_size, metadata, stem)
    primary = jax.process_index() == 0
    written = 0
    _agreed(path, plan, metadata)
    keep = lambda name: not (_is_weights(name) or _STAGED in name)  # noqa: E731
    replace = functools.partial(in_place, stem=stem)
    with atomic_dir(path, is_model_folder, keep, replace) as tmp:
        if primary:
            tmp.mkdir()
            for file, (head, total) in plan.shards.items():
                with open(tmp / file, "wb") as f:
                    f.write(head)
                    f.truncate(total)
        _barrier(f"bridge.save {path}: shards made")
        with _Shards(tmp) as fds:
            for encode, leaves in layers:
                for name, array in encode(leaves).items():
                    place = places.get(name)
                    entry = plan.entries[name if place is None else place.packed]
                    if entry.code in _PACKED and isinstance(array, jax.Array):
                        if not array.is_fully_addressable:
                            raise ValueError(
                                _PACKED_SPREAD.format(names=name, dtype=array.dtype)
                            )
                    for index, block in _own_blocks(array):
                        if place is not None:
                            index = _inside(place, index, np.shape(array))
                        done = write_block(fds.fd(entry.file), entry, index, block)
                        written += done
                        advance(done)
                    del array
        _barrier(f"bridge.save {path}: shards written")
        if primary:
            files = dict(configs or {})
            if plan.index is not None:
                index = stem + INDEX_SUFFIX
                files[index] = json.dumps(plan.index, indent=2, sort_keys=True) + "\n"
            for file, text in files.items():
                (tmp / file).write_text(text)
    return Written(written, plan)


def _stem(configs: Mapping[str, str] | None) -> str:
    """The stem of the weights files of a folder written with `configs`: its
    `config.json`'s library's (`_families._diffusers.weights_stem`)."""
    text = (configs or {}).get(CONFIGS[0])
    try:
        config = None if text is None else json.loads(text)
    except ValueError:
        config = None
    return weights_stem(config)


# --- replaced in place, where the filesystem cannot exchange two directories ---------

_STAGED = "bridge-new"
"""In the names a save stages its files under in the folder (`.config.json.bridge-new`)
before renaming them in: no reader reads them, the next save removes them."""


def _live(folder: Path, stem: str) -> set[str]:
    """The weight files (named `stem`) of `folder` that a reader reads:
    `model.safetensors` where there is one (transformers' order, and bridge's),
    else the index and the shards it names (every weight file where the index
    cannot be read)."""
    weights, index = stem + _SUFFIX, stem + INDEX_SUFFIX
    if (folder / weights).is_file():
        return {weights}
    if not (folder / index).is_file():
        return set()
    try:
        weight_map = json.loads((folder / index).read_text())["weight_map"]
        return {index, *weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {p.name for p in folder.iterdir() if _is_weights(p.name)}


def _same_bytes(a: Path, b: Path) -> bool:
    try:
        return a.read_bytes() == b.read_bytes()
    except FileNotFoundError:
        return False


def _other_name(name: str) -> str:
    """A shard's second name (`m-00001-of-00002.safetensors` <->
    `m-00001-of-00002.b.safetensors`), for a shard whose name the folder uses."""
    if name.endswith(".b" + _SUFFIX):
        return name[: -len(".b" + _SUFFIX)] + _SUFFIX
    return name[: -len(_SUFFIX)] + ".b" + _SUFFIX


def _rename_in(src: Path, folder: Path, name: str) -> None:
    """`src` renamed to `folder / name` through a staged name (flushed), so that the
    last step is one rename over whatever is at `name`."""
    staged = folder / f".{name}.{_STAGED}"
    os.rename(src, staged)
    os.replace(staged, folder / name)


def in_place(new: Path, folder: Path, stem: str = STEMS[0]) -> bool:
    """Move the new folder `new` (written whole) into the old `folder`, a whole model
    in `folder` at every moment, for transformers' `from_pretrained` as for bridge:
    where the filesystem cannot exchange two directories (NFS, some FUSE, gVisor).

    The new weight files come in under names the old ones do not use, unread; then
    one rename switches what a reader reads (the index over the old one, or
    `model.safetensors` over it; from one file to shards, the removal of
    `model.safetensors`, which readers read first); then the old weights go. A save
    killed at any step leaves the old or the new model, and files no reader reads,
    which the next save removes (weights named `stem`). Only where every config
    file the save writes is
    the one already there (the same model saved again): a `config.json` and the
    weights cannot change in one rename, so a save that changes one returns False,
    having changed nothing (the old directory is then moved aside, `atomic_dir`)."""
    for name in CONFIGS:
        if (new / name).is_file() and not _same_bytes(new / name, folder / name):
            return False
    live = _live(folder, stem)
    weights, index_name = stem + _SUFFIX, stem + INDEX_SUFFIX
    for stale in folder.iterdir():  # what a killed save left
        if (_is_weights(stale.name) and stale.name not in live) or (
            _STAGED in stale.name
        ):
            stale.unlink()
    if (new / weights).is_file():
        _rename_in(new / weights, folder, weights)  # the switch
        now = {weights}
    else:
        index = json.loads((new / index_name).read_text())
        names: dict[str, str] = {}
        for shard in sorted(set(index["weight_map"].values())):
            names[shard] = shard if shard not in live else _other_name(shard)
            os.rename(new / shard, folder / names[shard])
        index["weight_map"] = {k: names[v] for k, v in index["weight_map"].items()}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (new / index_name).write_text(text)
        _fsync(new / index_name)
        _fsync(folder)
        _rename_in(new / index_name, folder, index_name)  # the switch from shards
        (folder / weights).unlink(missing_ok=True)  # the switch from one file
        now = {index_name, *names.values()}
    _fsync(folder)
    for old in live - now:
        (folder / old).unlink(missing_ok=True)
    _fsync(folder)
    return True


# --- a model in PyTorch layout --------------------------------------------------------


def _described(layer: TorchLayer) -> list[tuple[str, tuple[int, ...], Any]]:
    """`(name, shape, dtype)` of each array `layer` gives, without computing any (host
    arrays, which JAX would narrow to 32 bits, are described as they are)."""
    order: list[str] = []
    host: dict[str, tuple[tuple[int, ...], Any]] = {}

    def run(leaves: dict[str, Any]) -> dict[str, Any]:
        out = layer.encode(leaves)
        order.extend(out)
        host.update(
            {k: (v.shape, v.dtype) for k, v in out.items() if isinstance(v, np.ndarray)}
        )
        return {k: v for k, v in out.items() if not isinstance(v, np.ndarray)}

    leaves = layer.leaves
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in leaves.items()}
    traced = jax.eval_shape(run, abstract)
    shapes = {**host, **{k: (v.shape, v.dtype) for k, v in traced.items()}}
    return [(name, *shapes[name]) for name in order]


_TWICE = "names: {names} would be written twice"


def save_folder(
    path: Path,
    tree: Tree,
    *,
    rules: Mapping[str, str] | None = None,
    prefix: str = "",
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | str | None = None,
    config: Any = None,
    generation_config: Any = None,
    packed_experts: str | None = None,
    reference: Reference | None = None,
    example: Any = None,
    ported: Mapping[str, Any] | None = None,
    strict: bool = True,
) -> Written:
    """`tree` in PyTorch layout (`torch_layers`) as a Hugging Face model folder
    (`write_folder`), one layer converted at a time; with `packed_experts` (a model
    family, `"qwen2_moe"` or `"mixtral"`), that family's per-expert weights written
    packed (`_experts.packing`); with `reference`, only if the names and shapes are
    its own (`_reference.check`); `example` (a `_port._trace.Example`): the
    model's inputs, whose forward pass decides the layouts its arrays leave open;
    `ported`: the arrays already in PyTorch layout and names (`_ported`: `tree`
    ported into the reference), written instead of `tree`'s layers. Without
    `reference`, a `config` naming a model transformers builds is the reference
    (`_reference.config_reference`), with `strict`."""
    configs = config_files(config, generation_config)
    family = None if packed_experts is None else _experts.family(packed_experts)
    known = None if reference is None else reference.shapes.keys()
    written = written_type(configs, path)
    if ported is not None:
        layers = [TorchLayer({}, lambda _: dict(ported))]
    else:
        layers = torch_layers(
            tree, rules, prefix, family=written, known=known, example=example
        )
    tensors = [t for layer in layers for t in _described(layer)]
    places: dict[str, Place] = {}
    if family is not None:
        tensors, places = _experts.packing(tensors, family)
    counts = Counter(name for name, _, _ in tensors)
    twice = sorted(n for n, c in counts.items() if c > 1)
    if twice:
        raise ValueError(_TWICE.format(names=", ".join(twice)))
    if reference is None and CONFIGS[0] in configs:
        names = [name for name, _, _ in tensors]
        came = config if isinstance(config, str | os.PathLike) else None
        reference = config_reference(configs[CONFIGS[0]], names, path, strict, came)
    if reference is not None:  # and its stored tables the model computes
        checked = check(((n, tuple(shape)) for n, shape, _ in tensors), reference)
        if checked.left_out:
            layers = [_without(layer, checked.left_out) for layer in layers]
            tensors = [t for t in tensors if t[0] not in checked.left_out]
        if checked.tables:
            layers.append(TorchLayer(checked.tables, dict))
            tensors += [
                (k, tuple(np.shape(v)), v.dtype) for k, v in checked.tables.items()
            ]
    return write_folder(
        path,
        ((layer.encode, layer.leaves) for layer in layers),
        tensors,
        max_shard_size=DEFAULT_SHARD_SIZE if max_shard_size is None else max_shard_size,
        configs=configs,
        metadata=metadata,
        places=places,
    )


def _without(layer: TorchLayer, names: frozenset[str]) -> TorchLayer:
    """`layer` writing none of `names`."""

    def encode(leaves: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in layer.encode(leaves).items() if k not in names}

    return layer._replace(encode=encode)


def write_arrays(
    path: Path,
    arrays: Mapping[str, Any],
    *,
    max_shard_size: int | str | None = None,
    config: Any = None,
    generation_config: Any = None,
    metadata: Mapping[str, str] | None = None,
) -> Written:
    """`{name: array}` (PyTorch layout already, in order) as a Hugging Face model
    folder (`write_folder`): what `bridge convert --to-layout torch` writes; its
    names checked against the model a `config` names, as `save_folder` checks
    them. `metadata`: in every file's beside `"format": "pt"` (the order of use a
    converted file records: `Contents.order`)."""
    configs = config_files(config, generation_config)
    tensors = [(k, tuple(np.shape(v)), v.dtype) for k, v in arrays.items()]
    if CONFIGS[0] in configs:
        names = [name for name, _, _ in tensors]
        came = config if isinstance(config, str | os.PathLike) else None
        reference = config_reference(configs[CONFIGS[0]], names, path, True, came)
        if reference is not None:
            check(((n, shape) for n, shape, _ in tensors), reference)
    return write_folder(
        path,
        [(lambda given: given, arrays)],
        tensors,
        max_shard_size=DEFAULT_SHARD_SIZE if max_shard_size is None else max_shard_size,
        configs=configs,
        metadata=metadata,
    )
