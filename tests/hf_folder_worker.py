"""One process of the 2-process Hugging Face folder test
(tests/test_hf_folder_processes.py): an MLP whose arrays are sharded (FSDP) over the 8
devices of 2 processes x 4 CPU devices is saved as a sharded Hugging Face folder, each
process writing only the bytes of its own shards; the host memory it took while
saving is sampled. Then it is read back into the sharded abstract model (NNX's
layout: kernels transposed), the bytes each process reads from the files counted.
Each process writes what it measured to `result-PROCESS_ID.json`.

    python tests/hf_folder_worker.py PORT PROCESS_ID DIRECTORY
"""

import json
import os
import sys
import threading
import time
from pathlib import Path


os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402


jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import bridge  # noqa: E402
from bridge._io import _hf_folder, _safetensors  # noqa: E402


WIDTH, DEPTH, SHARD = 1024, 4, "3MB"  # 4 MiB kernels: 4 MiB shards, 8 files
PAGE = os.sysconf("SC_PAGE_SIZE")


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(DEPTH)]
        )


def values(shape, seed, index):
    """The block `index` of a deterministic array of `shape`, computed alone."""
    grids = np.meshgrid(
        *[np.arange(n)[s] for n, s in zip(shape, index)], indexing="ij", sparse=True
    )
    flat = sum(g * (i + 3) for i, g in enumerate(grids)) + seed
    return np.sin(np.asarray(flat, np.float32) * np.float32(0.001))


def spec(path, shape):
    """FSDP: kernels cut along their input axis (after PyTorch's transpose, a later
    axis: strided writes), one along its output axis, biases along theirs."""
    if len(shape) == 1:
        return P("fsdp")
    return P(None, "fsdp") if "[1]" in path else P("fsdp", None)


def tree_on(mesh):
    abstract = bridge.from_nnx(nnx.eval_shape(lambda: MLP(nnx.Rngs(0))))

    def make(path, leaf):
        where = jax.tree_util.keystr(path)
        seed = len(where) * 7 + sum(map(ord, where)) % 97
        sharding = NamedSharding(mesh, spec(where, leaf.shape))
        return jax.make_array_from_callback(
            leaf.shape, sharding, lambda i: values(leaf.shape, seed, i)
        )

    return jax.tree_util.tree_map_with_path(make, abstract)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """The highest resident set size while the block runs, sampled every 1 ms."""

    def __enter__(self):
        self.start = self.peak = rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss())


class Reads:
    """The bytes read from safetensors files while the block runs."""

    def __enter__(self):
        self.bytes, self.read_at = 0, _safetensors.read_at

        def counted(fd, offset, count, into=None):
            self.bytes += count
            return self.read_at(fd, offset, count, into)

        _safetensors.read_at = counted
        return self

    def __exit__(self, *exc):
        _safetensors.read_at = self.read_at


def same_shards(a, b):
    return all(
        x.index == y.index and np.array_equal(x.data, y.data)
        for x, y in zip(a.addressable_shards, b.addressable_shards, strict=True)
    )


def main(port, process_id, directory):
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    tree = tree_on(mesh)
    held = sum(
        s.data.nbytes
        for leaf in jax.tree_util.tree_leaves(tree)
        for s in leaf.addressable_shards
    )
    out = Path(directory) / "out"
    # once to compile the layout's transposes, then measured
    _hf_folder.save_folder(out, tree, max_shard_size=SHARD)
    with Peak() as peak:
        written = _hf_folder.save_folder(out, tree, max_shard_size=SHARD)
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    with Reads() as reads, jax.set_mesh(mesh):
        loaded = bridge.load(out, like=like)
    read_same = all(
        same_shards(a, b)
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(tree), strict=True)
    )
    result = {
        "read": reads.bytes,
        "read_same": read_same,
        "held": held,
        "written": written.nbytes,
        "rise": peak.peak - peak.start,
        "peak": peak.peak,
        "files": sorted(os.listdir(out)),
        "left": sorted(os.listdir(directory)),
    }
    (Path(directory) / f"result-{process_id}.json").write_text(json.dumps(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
