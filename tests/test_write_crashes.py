"""No lost checkpoint: a save killed at any step of its writing leaves the old or the
new checkpoint at its path, loadable, and the next save clears what it left.

Every surface of `tests/corpus/writes.py` (one safetensors file, a sharded index, an
orbax directory, a Hugging Face folder, a PEFT adapter, an FP8 file with its
config.json) is saved once over an older version while `Steps` copies the directory
before each change the save makes: each copy is what a `kill -9` at that moment
leaves. A slow test kills real processes at random moments.
"""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from .corpus import writes


# orbax's saves take 0.3 s each, 40 of them a test: `nox -s tests_slow` runs those
SLOW = pytest.mark.slow
SURFACES = [
    pytest.param(s, id=s.name, marks=[SLOW] if s.name == "orbax" else [])
    for s in writes.SURFACES
]


def _names(directory):
    """The names in `directory`, with a shard's name (`m-00001-of-00001.safetensors`
    or, every other save, `m-00001-of-00001.b.safetensors`) as one name; failing on
    a temporary left behind."""
    names = sorted(
        n.replace(".b.safetensors", ".safetensors") for n in os.listdir(directory)
    )
    assert not [n for n in names if "bridge-" in n], names
    return names


def _kill_at_every_step(tmp_path, surface):
    """A save killed at each of its steps (a copy of the directory before every
    change): each copy loads as the old or the new version, and a save after it
    works. Returns the versions the copies held, in order."""
    root, store = tmp_path / "root", tmp_path / "copies"
    root.mkdir()
    store.mkdir()
    path = root / surface.target
    surface.save(path, 1.0)
    clean = _names(root)
    with writes.recorded(root, store) as steps:
        surface.save(path, 2.0)
    assert surface.version(path) == 2.0
    assert _names(root) == clean
    assert len(steps.copies) > 2
    seen = []
    for copy, call in zip(steps.copies, steps.names, strict=True):
        where = copy / surface.target
        try:
            seen.append(surface.version(where))
        except Exception as e:  # noqa: BLE001  (the test names the step)
            raise AssertionError(f"killed before {call}: {e!r}") from e
        surface.save(where, 3.0)  # the next save clears what the killed one left
        assert surface.version(where) == 3.0, call
        assert _names(copy) == clean, call
    assert seen[0] == 1.0 and seen[-1] == 2.0
    assert set(seen) == {1.0, 2.0}
    return seen


_SAVER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from corpus import writes
surface = next(s for s in writes.SURFACES if s.name == sys.argv[1])
path = Path(sys.argv[2])
print("ready", flush=True)
value = 2.0
while True:
    surface.save(path, value)
    value = 5.0 - value   # 2, 3, 2, 3...
"""


@pytest.mark.slow
@pytest.mark.parametrize("surface", SURFACES)
def test_kill_9_at_random_moments_leaves_a_loadable_checkpoint(tmp_path, surface):
    path = tmp_path / surface.target
    surface.save(path, 1.0)
    tests = os.path.dirname(os.path.abspath(__file__))
    rng = random.Random(0)
    for _ in range(8):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(_SAVER.format(tests=tests)),
                surface.name,
                str(path),
            ],
            stdout=subprocess.PIPE,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.0, 1.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.stdout.close()
        proc.wait()
        assert surface.version(path) in (1.0, 2.0, 3.0)
    surface.save(path, 1.0)
    assert surface.version(path) == 1.0


DIRECTORIES = [
    p for p in SURFACES if p.id in ("orbax", "Hugging Face folder", "PEFT adapter")
]


@pytest.mark.parametrize("surface", SURFACES)
def test_a_kill_at_every_step_leaves_the_old_or_the_new_checkpoint(tmp_path, surface):
    """Every kill point of a save leaves the old or the new checkpoint, loadable."""
    assert set(_kill_at_every_step(tmp_path, surface)) == {1.0, 2.0}


@pytest.mark.parametrize("surface", DIRECTORIES)
def test_without_an_atomic_exchange_a_killed_swap_leaves_the_old_directory_reachable(
    tmp_path, surface, monkeypatch
):
    """Where the filesystem cannot exchange two directories, the old one is renamed
    aside, then the new one in: killed between the two, the path is empty, and
    `load` reads the old one aside; the next save puts it back first."""
    monkeypatch.setattr(writes._atomic, "_exchange", lambda a, b: False)
    seen = _kill_at_every_step(tmp_path, surface)
    assert set(seen) == {1.0, 2.0}  # each kill left the old or the new version


@pytest.mark.parametrize("surface", SURFACES)
def test_a_failure_at_every_step_keeps_the_old_checkpoint(tmp_path, surface):
    """Each step of the save fails in turn (`OSError`, as a full or failing disk
    raises): the save raises it, the old checkpoint is intact (or, for a failure
    after the commit, the new one is whole), nothing is left behind, and the next
    save works and leaves the directory as clean as before (a failure after the
    commit may leave an old shard that no index names: the next save removes it)."""
    root = tmp_path / "root"
    root.mkdir()
    path = root / surface.target
    surface.save(path, 1.0)
    clean = _names(root)
    with writes.Steps(root, None, fail_at=-1) as counter:
        surface.save(path, 2.0)
    surface.save(path, 1.0)
    outcomes = []
    for step in range(counter.count):
        try:
            with writes.failing(root, step):
                surface.save(path, 2.0)
        except OSError as e:
            assert "injected" in str(e) or "injected" in str(e.__cause__), e
            outcomes.append("raised")
        else:
            outcomes.append("saved")  # a step whose failure the save may ignore
        value = surface.version(path)
        assert value in (1.0, 2.0), step
        _names(root)  # no temporary left behind
        surface.save(path, 3.0 - value)  # and the next save clears what is left
        assert surface.version(path) == 3.0 - value, step
        assert _names(root) == clean, step
        if value == 1.0:
            surface.save(path, 1.0)
    assert "raised" in outcomes


_FULL_DISK = """
import hashlib, json, os, resource, signal, sys, threading
sys.path.insert(0, {tests!r})
from pathlib import Path
from corpus import writes

def files(root):
    out = {{}}
    for where, _, names in os.walk(root):
        out[os.path.relpath(where, root)] = None
        for name in names:
            with open(os.path.join(where, name), "rb") as f:
                out[os.path.relpath(os.path.join(where, name), root)] = (
                    hashlib.sha256(f.read()).hexdigest()
                )
    return out

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
for surface in writes.SURFACES:
    root = Path(sys.argv[1]) / surface.name
    (root / "sizes").mkdir(parents=True)
    surface.save(root / "sizes" / surface.target, 2.0)
    largest = max(
        os.path.getsize(os.path.join(w, n))
        for w, _, ns in os.walk(root / "sizes") for n in ns
    )
    root = root / "root"
    root.mkdir()
    path = root / surface.target
    surface.save(path, 1.0)
    for limit in [0, largest // 4, largest // 2, largest - 1]:
        before = files(root)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            surface.save(path, 2.0)
            error = None
        except BaseException as e:
            error = [type(e).__module__, type(e).__name__, str(e)]
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        for thread in threading.enumerate():  # a writer still running writes on
            if thread is not threading.main_thread():
                thread.join(30)
        same = before == files(root)
        print(json.dumps([surface.name, str(path), limit, error, same,
                          surface.version(path)]))
"""


def test_a_full_disk_leaves_the_old_checkpoint_exactly_as_it_was(tmp_path):
    """A save of each surface whose writes fail for lack of space (`RLIMIT_FSIZE`
    in a child process: every write past the limit fails with `EFBIG`, as a full
    disk fails with `ENOSPC`), at four limits from nothing to one byte short of
    the largest file: the save raises an `OSError` naming the checkpoint's path,
    and every file and directory under its parent is as it was, bit for bit (the
    message names the directory of a directory checkpoint, else the file that
    failed). Was: orbax's writer threads went on writing after the save raised,
    and made its temporary directory again after the save had removed it;
    `save_peft` raised safetensors' `SafetensorError: Error while serializing:
    I/O error`."""
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK.format(tests=tests), tmp_path],
        capture_output=True,  # pipes: the limit applies to files only
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert [n for n, *_ in lines] == [s.name for s in writes.SURFACES for _ in "four"]
    for name, path, limit, error, same, version in lines:
        assert error is not None, f"{name}: saved under a limit of {limit} bytes"
        module, kind, message = error
        assert (module, kind) == ("builtins", "OSError"), (name, limit, error)
        named = message.rpartition(": ")[2].strip("'")
        if name in ("orbax", "Hugging Face folder", "PEFT adapter"):
            assert named == path, (name, limit, message)
        else:  # the file (of several: a shard, the config.json) that failed
            assert os.path.dirname(named) == os.path.dirname(path), (name, message)
        assert same and version == 1.0, (name, limit, error)
