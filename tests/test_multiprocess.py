"""Two processes x 4 CPU devices (`jax.distributed` on 127.0.0.1, gloo collectives):
`make_step` on a sharded Tree, `bridge.save`/`load` with orbax; the results equal the
single-process run."""

import jax
import numpy as np
import pytest

import bridge

from . import multiprocess_worker as worker
from .processes import run_two


@pytest.mark.slow
def test_two_processes_train_save_and_load_like_one(tmp_path):
    run_two(worker.__file__, tmp_path, timeout=240)
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
