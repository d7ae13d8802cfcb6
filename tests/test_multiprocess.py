"""Two processes x 4 CPU devices (`jax.distributed` on 127.0.0.1, gloo collectives):
`make_step` on a sharded Tree, `bridge.save`/`load` with orbax; the results equal the
single-process run."""

import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import bridge

from . import multiprocess_worker as worker


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_save_and_load_like_one(tmp_path):
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
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)[-3000:]

    result = np.load(tmp_path / "result.npz")
    # one checkpoint, no temporary left behind by either process
    assert list(result["names"]) == ["ckpt"]
    refused = str(result["refused"])
    assert "sharded over the devices of 2 processes" in refused
    assert "Save to an orbax checkpoint directory" in refused
    assert bool(result["same"])  # loaded like=tree: same values, same shardings
    x, y = worker.data()
    tree, losses = worker.train(bridge.from_nnx(worker.model()), x, y)
    assert np.allclose(result["losses"], [float(v) for v in losses], atol=1e-6)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        assert np.allclose(result[jax.tree_util.keystr(path)], leaf, atol=1e-6), path
    assert np.allclose(result["plain"], tree.layers[2].kernel, atol=1e-6)
