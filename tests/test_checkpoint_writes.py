"""Writes that never lose the old checkpoint: disk full, kill -9 mid-save, concurrent
saves, permissions, stale temporaries, models without arrays."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import bridge
from bridge._io import _atomic

from .helpers import in_threads


FORMATS = ["m.safetensors", "m.msgpack", "ckpt"]


def params(value: float, n: int = 4) -> dict:
    return {"params": {"Dense_0": {"kernel": np.full((n, n), value, np.float32)}}}


def value_of(path) -> float:
    kernel = np.asarray(bridge.load(path).Dense_0.kernel)
    assert (kernel == kernel.flat[0]).all()  # one version, never a mix
    return float(kernel.flat[0])


def only(directory, name):
    """The directory holds exactly `name`: no temporary is left."""
    assert sorted(os.listdir(directory)) == [name]


@pytest.mark.parametrize("name", FORMATS)
def test_overwrite_keeps_the_permission_bits(tmp_path, name):
    path = tmp_path / name
    bridge.save(path, params(1.0))
    os.chmod(path, 0o700 if path.is_dir() else 0o600)
    bridge.save(path, params(2.0))
    assert path.stat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600)
    assert value_of(path) == 2.0


@pytest.mark.parametrize("name", FORMATS)
def test_stale_temporaries_are_cleaned_by_the_next_save(tmp_path, name):
    path = tmp_path / name
    bridge.save(path, params(1.0))
    stale = [
        _atomic.temporary(path),
        tmp_path / f".{name}.0123456789ab.tmp",  # named by an older bridge
        tmp_path / f".{name}.bridge-tmp.orbax-checkpoint-tmp-1234",
    ]
    for p in stale:
        p.mkdir()
        (p / "junk").write_bytes(b"x" * 100)
    keep = tmp_path / f".{name}.mine"  # not a temporary of bridge's
    keep.write_text("mine")
    bridge.save(path, params(2.0))
    assert sorted(os.listdir(tmp_path)) == sorted([name, keep.name])
    assert value_of(path) == 2.0


def test_an_interrupted_directory_swap_is_undone(tmp_path, monkeypatch):
    """A save killed between moving the old directory aside and renaming the new one
    in (where the system cannot swap atomically) leaves the old one aside: the next
    save puts it back before anything else."""
    path = tmp_path / "ckpt"
    bridge.save(path, params(1.0))
    os.rename(path, _atomic.temporary(path, "bridge-old"))
    _atomic.temporary(path).mkdir()  # the new, unfinished

    def failing(*args, **kwargs):
        raise OSError("injected")

    with monkeypatch.context() as patch:
        patch.setattr(ocp.Checkpointer, "save", failing)
        with pytest.raises(OSError, match="injected"):
            bridge.save(path, params(2.0))
    assert value_of(path) == 1.0
    only(tmp_path, "ckpt")
    bridge.save(path, params(2.0))
    assert value_of(path) == 2.0
    only(tmp_path, "ckpt")


@pytest.mark.parametrize("name", FORMATS)
def test_concurrent_saves_to_one_path_end_with_one_whole_checkpoint(tmp_path, name):
    path = tmp_path / name
    in_threads(lambda v: bridge.save(path, params(v)), 6)  # raises what a save raised
    assert value_of(path) in range(6)
    only(tmp_path, name)


def test_orbax_saves_to_several_paths_from_threads(tmp_path):
    in_threads(lambda i: bridge.save(tmp_path / f"c{i}", params(i)), 4)
    assert [value_of(tmp_path / f"c{i}") for i in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    "variables",
    [
        {"params": {}},
        {"params": {"a": jnp.zeros((0, 3)), "b": jnp.ones(2)}},
        {"params": {"a": np.zeros((2, 0), np.int8)}},
    ],
    ids=["no arrays", "zero-size and other", "only zero-size"],
)
def test_models_without_arrays_or_with_zero_size_arrays(tmp_path, name, variables):
    path = tmp_path / name
    bridge.save(path, variables)
    tree = bridge.load(path)
    back = bridge.load(path, like=variables)
    for key, leaf in variables["params"].items():
        assert back["params"][key].shape == leaf.shape
        assert back["params"][key].dtype == leaf.dtype
        assert getattr(tree, key).shape == leaf.shape
    only(tmp_path, name)


# --- a full disk ----------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only); skipped where it cannot be mounted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _convert(capsys, *command: str, own_process: bool) -> tuple[int, str]:
    """`bridge convert`'s exit code and whole stderr. In a process of its own, orbax's
    writer threads' logs are seen too (absl writes past pytest's capture), and the
    process must exit."""
    if not own_process:
        from bridge import _cli

        return _cli.main(["convert", *command]), capsys.readouterr().err
    done = subprocess.run(
        [sys.executable, "-m", "bridge", "convert", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return done.returncode, done.stderr


def _big(tmp_path):
    """A 2.6 MB file of noise (orbax compresses) that does not fit a small disk."""
    big = params(2.0, n=800)
    big["params"]["Dense_0"]["kernel"] += np.random.default_rng(0).random((800, 800))
    bridge.save(tmp_path / "big.safetensors", big)
    return tmp_path / "big.safetensors"


@pytest.mark.parametrize("name", FORMATS)
def test_disk_full_keeps_the_old_checkpoint(small_disk, name, capsys):
    path = small_disk / name
    bridge.save(path, params(1.0))
    source = _big(small_disk.parent)
    with pytest.raises(OSError, match="No space left on device"):
        bridge.save(path, bridge.load(source))
    assert value_of(path) == 1.0
    only(small_disk, name)
    code, err = _convert(
        capsys, str(source), str(path), "--overwrite", own_process=name == "ckpt"
    )
    assert (code, err) == (
        1,
        f"bridge convert: error: {path}: No space left on device\n",
    )
    assert value_of(path) == 1.0
    only(small_disk, name)


def test_disk_full_keeps_the_old_hugging_face_folder(small_disk, capsys):
    path = small_disk / "hf"
    bridge.save_pretrained(path, params(1.0))
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    source = _big(small_disk.parent)
    command = [
        str(source),
        str(path),
        "--to-layout",
        "torch",
        "--max-shard-size",
        "1MB",
        "--overwrite",
    ]
    code, err = _convert(capsys, *command, own_process=False)
    assert (code, err) == (
        1,
        f"bridge convert: error: {path}: No space left on device\n",
    )
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    only(small_disk, "hf")


# --- kill -9 in the middle of a save --------------------------------------------------

_SAVER = """
import sys, numpy as np, bridge
path, value, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
print("ready", flush=True)
kernel = np.full((n, n), value, np.float32)
bridge.save(path, {"params": {"Dense_0": {"kernel": kernel}}})
"""


def _kill_mid_save(path, n):
    """Start a process saving `n * n * 4` bytes to `path`, kill -9 it once its
    temporary exists; returns whether it was killed mid-save."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_SAVER), str(path), "2.0", str(n)],
        stdout=subprocess.PIPE,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name.startswith(f".{path.name}.") for p in path.parent.iterdir()):
            time.sleep(0.05)  # some bytes are written
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.stdout.close()
    return proc.wait() == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
def test_kill_9_mid_save_keeps_the_old_checkpoint(tmp_path, name):
    path = tmp_path / name
    bridge.save(path, params(1.0))
    killed = _kill_mid_save(path, n=8000)  # 256 MB
    assert killed, "the save finished before it could be killed"
    assert value_of(path) == 1.0
    assert len(os.listdir(tmp_path)) > 1  # the dead save's temporary is still there
    bridge.save(path, params(3.0))  # the next save to that path cleans it
    assert value_of(path) == 3.0
    only(tmp_path, name)


@pytest.mark.parametrize("name", ["m.safetensors", "m.msgpack"])
def test_loading_while_the_file_is_replaced_never_mixes_versions(tmp_path, name):
    """A writer replaces the file over and over (values 1 and 2, then another
    shape); every load gives one whole version or refuses the other shape."""
    path = tmp_path / name
    like = params(0.0)
    bridge.save(path, params(1.0))
    stop = threading.Event()

    def writer():
        versions = [params(1.0), params(2.0), params(3.0, n=5)]
        i = 0
        while not stop.is_set():
            bridge.save(path, versions[i % 3])
            i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    seen = set()
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                kernel = np.asarray(
                    bridge.load(path, like=like)["params"]["Dense_0"]["kernel"]
                )
            except ValueError as e:  # the 5x5 version: refused as not fitting `like`
                # (msgpack records no framework: its file is ported, and refused so)
                assert isinstance(e, bridge.PortError) or "does not fit" in str(e)
                seen.add("refused")
                continue
            assert kernel.shape == (4, 4)
            assert (kernel == kernel.flat[0]).all() and kernel.flat[0] in (1.0, 2.0)
            seen.add(float(kernel.flat[0]))
    finally:
        stop.set()
        thread.join()
    assert seen & {1.0, 2.0}


@pytest.mark.parametrize(
    "name, layout",
    [
        ("m.safetensors", None),
        ("m.msgpack", None),
        ("m.safetensors.index.json", None),
        ("t.safetensors", "torch"),
    ],
)
def test_a_read_only_file_is_refused_up_front_and_left_as_it_was(
    tmp_path, name, layout
):
    """A file made read-only (`chmod 444`) at the destination: refused before
    anything is written, naming it and the fix, the file (and the directory)
    as they were; made writable, it is replaced. Was: replaced silently (a rename
    needs only the directory's permission), its mode kept at 444."""
    path = tmp_path / name
    save = bridge.save_state_dict if layout else bridge.save
    save(path, params(1.0))
    os.chmod(path, 0o444)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(
        PermissionError,
        match=rf"read-only file \(mode 444\).*chmod u\+w.*'{path}'",
    ):
        save(path, params(2.0))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    os.chmod(path, 0o644)
    save(path, params(2.0))
    tree = bridge.load(path)
    assert tree.Dense_0["weight" if layout else "kernel"][0, 0] == 2.0
