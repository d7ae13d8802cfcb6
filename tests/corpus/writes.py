"""The kinds of checkpoint a save writes, for the crash and concurrency tests
(`tests/test_write_crashes.py`): each a `Surface` that saves version `v` (every array
filled with `v`) to a path under a directory and reads back which version the path
holds, refusing a mix.

`Steps` records the moment before every change a save makes to the filesystem under a
directory (a file or directory created, written, renamed, linked, removed, its mode
changed), copying the directory as it is then: each copy is what a `kill -9` at that
moment leaves on disk (a killed process's writes stay in the page cache; its lock
goes with it). A save's steps are found by running it once. The checkpoints are read
as bridge reads them (`_atomic.reachable`: a directory swap killed between its two
renames, where the filesystem cannot exchange, is read from the old directory
aside).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import bridge
from bridge._io import _atomic


class Surface(NamedTuple):
    name: str
    target: str
    """The path saved to, under the directory."""
    save: Callable[[Path, float], None]
    version: Callable[[Path], float]
    """The one value every array of the checkpoint at the path holds (AssertionError
    for a mix); raises what `bridge.load` raises for an unloadable one."""


def _layers(value: float, width: int = 8) -> dict:
    """Dense layers whose every array is `value`, one more layer in each version (so
    that versions differ in names, not only in values; several shards in a small
    `max_shard_size`)."""
    n = int(value) + 1
    return {
        "params": {
            f"Dense_{i}": {
                "kernel": np.full((width, width), value, np.float32),
                "bias": np.full((width,), value, np.float32),
            }
            for i in range(n)
        }
    }


def one_value(arrays: Any) -> float:
    """The value all `arrays` hold; AssertionError if they hold several (a mix)."""
    values = {float(v) for a in arrays for v in np.unique(np.asarray(a, np.float32))}
    assert len(values) == 1, f"a mix of versions: {sorted(values)}"
    return values.pop()


def _reachable(path: Path) -> Path:
    """Where bridge reads a directory checkpoint at `path` (`_atomic.reachable`;
    `path` itself for a bridge without it)."""
    return getattr(_atomic, "reachable", lambda p: p)(path)


def _tree_value(path: Path) -> float:
    import jax

    return one_value(jax.tree.leaves(bridge.load(path)))


def _save_tree(path: Path, value: float) -> None:
    bridge.save(path, _layers(value))


def _save_folder(path: Path, value: float) -> None:
    config = {"model_type": "toy", "version": value}
    bridge.save_pretrained(path, _layers(value), max_shard_size=400, config=config)


def _folder_value(path: Path) -> float:
    """The version of the weights, checked against the config.json's, both read from
    one directory (held open, so that its inode is not reused: read again if a save
    swapped it between the two reads)."""
    while True:
        fd = os.open(_reachable(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            config_fd = os.open("config.json", os.O_RDONLY, dir_fd=fd)
            with open(config_fd) as f:
                config = json.load(f)
            value = _tree_value(path)
            if os.fstat(fd).st_ino == os.stat(_reachable(path)).st_ino:
                break
        finally:
            os.close(fd)
    assert config["version"] == value, "weights and config.json of two versions"
    return value


def _lora_model(value: float):
    import jax
    from flax import nnx

    model = nnx.Sequential(
        nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 4, rngs=nnx.Rngs(1))
    )
    model = bridge.lora(  # a rank of its own in each version
        model,
        ["layers.0", "layers.1"],
        rank=int(value) + 1,
        alpha=value,
        key=jax.random.key(0),
    )
    for layer in model.layers:
        layer.lora_a[...] = np.full(layer.lora_a.shape, value, np.float32)
        layer.lora_b[...] = np.full(layer.lora_b.shape, value, np.float32)
    return model


def _save_peft(path: Path, value: float) -> None:
    bridge.save_peft(path, _lora_model(value))


def _peft_value(path: Path) -> float:
    from safetensors.numpy import load_file

    path = _reachable(path)  # as `bridge.load_peft` reads it
    config = json.loads((path / "adapter_config.json").read_text())
    arrays = load_file(path / "adapter_model.safetensors")
    value = one_value(arrays.values())
    ranks = {min(a.shape) for a in arrays.values()}
    assert config["lora_alpha"] == value and ranks == {config["r"]}, (
        "adapter and config of two versions"
    )
    return value


def _save_fp8(path: Path, value: float) -> None:
    """Version 1: a dense file beside a config.json without quantization; any other:
    the FP8 file, whose `quantization_config` the config.json must then hold."""
    tree = {"params": {"Dense_0": {"kernel": np.full((8, 8), value, np.float32)}}}
    if value == 1:
        (path.parent / "config.json").write_text('{"model_type": "toy"}')
        bridge.save_state_dict(path, tree)
    else:
        bridge.save_quantized(path, tree, "fp8-block")


def _fp8_value(path: Path) -> float:
    from bridge._io._read import open_checkpoint, read

    with open_checkpoint(path) as contents:
        arrays = {k: np.asarray(v) for k, v in read(contents).items()}
    config = json.loads((path.parent / "config.json").read_text())
    weight = arrays["Dense_0.weight"].astype(np.float32)
    quantized = "Dense_0.weight_scale_inv" in arrays
    assert quantized == ("quantization_config" in config), (
        "weights and config.json of two versions"
    )
    if quantized:
        weight = weight * arrays["Dense_0.weight_scale_inv"][0, 0]
    return one_value([weight])


SURFACES = [
    Surface("safetensors", "m.safetensors", _save_tree, _tree_value),
    Surface("sharded index", "m.safetensors.index.json", _save_tree, _tree_value),
    Surface("orbax", "ckpt", _save_tree, _tree_value),
    Surface("Hugging Face folder", "hf", _save_folder, _folder_value),
    Surface("PEFT adapter", "adapter", _save_peft, _peft_value),
    Surface("FP8 file and config.json", "model.safetensors", _save_fp8, _fp8_value),
]


# --- every step of a save -------------------------------------------------------------

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class Steps:
    """While active (`with Steps(root) as steps:`), copies `root` into
    `steps.copies[i]` before each change to the filesystem under it; `steps.names[i]`
    is the call about to run."""

    _PATH_OPS = (
        "rename",
        "replace",
        "unlink",
        "remove",
        "rmdir",
        "mkdir",
        "link",
        "symlink",
        "chmod",
        "truncate",
    )
    _FD_OPS = ("write", "pwrite", "ftruncate")

    def __init__(self, root: Path, store: Path | None, fail_at: int | None = None):
        """`store`: where the copies go (None: no copies); `fail_at`: the step that
        raises `OSError(EIO)` instead of running (a failing disk), counting the
        steps of the main thread only (a failure in orbax's writer threads makes
        orbax wait for signals that never come, minutes: orbax's own matter)."""
        self.root, self.store, self.fail_at = str(root), store, fail_at
        self.count = 0
        self.copies: list[Path] = []
        self.names: list[str] = []
        self._busy = threading.local()
        self._lock = threading.RLock()
        self._undo: list[Callable[[], None]] = []

    def _under(self, name: Any, dir_fd: int | None = None) -> bool:
        if isinstance(name, int):
            return _fd_path(name).startswith(self.root)
        text = os.fsdecode(name)
        if dir_fd is not None and not os.path.isabs(text):
            text = os.path.join(_fd_path(dir_fd), text)
        return os.path.abspath(text).startswith(self.root)

    def _copy(self, call: str) -> None:
        if getattr(self._busy, "on", False):
            return
        with self._lock:
            if self.fail_at is not None and threading.current_thread() is not (
                threading.main_thread()
            ):
                return  # orbax's writer threads: their failures are orbax's
            self.count += 1
            if self.count - 1 == self.fail_at:
                raise OSError(errno.EIO, f"injected before {call}")
            if self.store is None:
                return
            self._busy.on = True
            try:
                to = self.store / f"{len(self.copies):04d}"
                _snapshot(Path(self.root), to)
                self.copies.append(to)
                self.names.append(call)
            finally:
                self._busy.on = False

    def _wrap(self, module: Any, attr: str, check: Callable[..., bool]) -> None:
        original = getattr(module, attr)

        def hooked(*args, **kwargs):
            if not getattr(self._busy, "on", False) and check(*args, **kwargs):
                self._copy(f"{attr}({', '.join(map(_short, args[:2]))})")
            return original(*args, **kwargs)

        setattr(module, attr, hooked)
        self._undo.append(lambda: setattr(module, attr, original))

    def __enter__(self) -> Steps:
        for op in self._PATH_OPS:
            self._wrap(os, op, lambda p, *a, dir_fd=None, **k: self._under(p, dir_fd))
        for op in self._FD_OPS:
            self._wrap(os, op, lambda fd, *a, **k: self._under(fd))
        self._wrap(
            os,
            "open",
            lambda p, flags, *a, dir_fd=None, **k: (
                bool(flags & _WRITES) and self._under(p, dir_fd)
            ),
        )
        self._wrap(
            builtins,
            "open",
            lambda p, mode="r", *a, **k: (
                isinstance(p, str | os.PathLike | int)
                and any(c in mode for c in "wax+")
                and self._under(p)
            ),
        )
        self._wrap(_atomic, "_exchange", lambda a, b: True)
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in reversed(self._undo):
            undo()


def _snapshot(root: Path, to: Path, tries: int = 5) -> None:
    """Copy `root` to `to`. Orbax's writer (tensorstore, below Python's hooks) may
    remove a file of its own while it is copied (`manifest.ocdbt.__lock`): copy
    again, a few times, where every error is a file that vanished."""
    for _ in range(tries - 1):
        try:
            shutil.copytree(root, to, symlinks=True)
            return
        except shutil.Error as e:
            if not all("No such file" in str(why) for _, _, why in e.args[0]):
                raise
            shutil.rmtree(to, ignore_errors=True)
    shutil.copytree(root, to, symlinks=True)


def _short(value: Any) -> str:
    text = os.path.basename(os.fsdecode(value)) if isinstance(value, str | Path) else ""
    return text or type(value).__name__


@contextlib.contextmanager
def recorded(root: Path, store: Path) -> Iterator[Steps]:
    """Copies of `root` before every step of what runs inside, and after the last."""
    steps = Steps(root, store)
    with steps:
        yield steps
    steps._copy("done")


@contextlib.contextmanager
def failing(root: Path, step: int) -> Iterator[Steps]:
    """What runs inside, with its step `step` failing (`OSError(EIO)`)."""
    with Steps(root, None, fail_at=step) as steps:
        yield steps
