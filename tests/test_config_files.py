"""A hostile `config.json` beside a checkpoint (round 3 of the hostile-input audit):
a FIFO (`load` and `bridge inspect` waited forever), a symbolic link to `/dev/zero`
(read until MemoryError), JSON nested 100,000 deep (a raw RecursionError), a file
of 17 MB, a directory. `load(folder)`, `load(file)` and `bridge inspect` refuse each
with one `CheckpointError` naming `config.json`, quickly; a valid one still loads."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import safetensors.numpy

import bridge
from bridge import _cli

from .test_hostile_files import deadline


def _fifo(path):
    os.mkfifo(path)


def _zero(path):
    os.symlink("/dev/zero", path)


def _nested(path):
    path.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")


def _big(path):
    with open(path, "wb") as f:
        f.write(b'{"model_type": "llama", "x": "')
        f.truncate(17 << 20)  # sparse: 17 MB claimed, nothing written


def _directory(path):
    path.mkdir()


def _not_utf8(path):
    path.write_bytes(b'{"model_type": "\xff"}')


def _a_list(path):
    path.write_text("[1, 2]")


@pytest.mark.parametrize(
    "make, reason",
    [
        (_zero, "character device"),
        (_nested, "nested too deeply"),
        (_big, "more than the 16777216"),
        (_directory, "a directory"),
        (_not_utf8, "not JSON"),
        (_a_list, "JSON list, not an object"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_a_hostile_config_json_is_refused_quickly(tmp_path, make, reason, capsys):
    weights = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"fc.weight": np.ones((2, 3), np.float32)}, weights)
    make(tmp_path / "config.json")
    with deadline(60):
        for path in (tmp_path, weights):
            with pytest.raises(bridge.CheckpointError, match=reason) as info:
                bridge.load(path)
            assert "config.json" in str(info.value)
            assert len(str(info.value)) < 1_000
        assert _cli.main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json" in err and reason in err


def test_a_valid_config_json_still_loads(tmp_path):
    weights = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"fc.weight": np.ones((2, 3), np.float32)}, weights)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert bridge.load(tmp_path)["fc"]["weight"].shape == (2, 3)


_FIFO = """
import sys
import bridge
from bridge import _cli
for path in (sys.argv[1], sys.argv[1] + "/model.safetensors"):
    try:
        bridge.load(path)
    except bridge.CheckpointError as e:
        print("refused:", e)
sys.exit(_cli.main(["inspect", sys.argv[1]]))
"""


def test_a_fifo_config_json_is_refused_not_waited_on(tmp_path):
    """In a process of its own: the FIFO blocked `open` forever (no writer)."""
    weights = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"fc.weight": np.ones((2, 3), np.float32)}, weights)
    _fifo(tmp_path / "config.json")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FIFO), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 1, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all("config.json" in x and "FIFO" in x for x in lines)
    assert done.stderr.count("\n") == 1 and "FIFO" in done.stderr
