"""A Hugging Face folder written by two processes x 4 CPU devices (`jax.distributed`
on 127.0.0.1, gloo): an FSDP-sharded MLP (tests/hf_folder_worker.py), each process
writing only its own shards' bytes, never gathering; the folder is bit-identical to
a single-process save, and each process's memory rose by about its own shards."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import AxisType

import bridge
from bridge._io import _hf_folder

from . import hf_folder_worker as worker
from .helpers import requires


pytestmark = [pytest.mark.slow, requires("NNX")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_write_one_folder_without_gathering(tmp_path):
    port, script = free_port(), Path(worker.__file__)
    root = Path(bridge.__file__).parent.parent
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(port), str(i), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)[-3000:]
    results = [
        json.loads((tmp_path / f"result-{i}.json").read_text()) for i in range(2)
    ]
    total = sum(r["held"] for r in results)
    for r in results:
        # each wrote exactly the bytes of the shards it holds: half the model
        assert r["written"] == r["held"] == total // 2
        assert "out" in r["left"] and not any("bridge-tmp" in n for n in r["left"])
        # host memory while saving: the converted layer and its host copy, at most
        assert r["rise"] <= 1.2 * r["held"], (r["rise"], r["held"])
    print("rise / own shards:", [round(r["rise"] / r["held"], 3) for r in results])

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    single = tmp_path / "single"
    _hf_folder.save_folder(single, worker.tree_on(mesh), max_shard_size=worker.SHARD)
    files = sorted(p.name for p in single.iterdir())
    assert files == results[0]["files"] and len(files) == 6  # 5 shards, the index
    for name in files:
        assert (tmp_path / "out" / name).read_bytes() == (single / name).read_bytes()
