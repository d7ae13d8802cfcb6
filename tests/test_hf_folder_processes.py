"""A Hugging Face folder written and read by two processes x 4 CPU devices
(`jax.distributed` on 127.0.0.1, gloo): an FSDP-sharded MLP
(tests/hf_folder_worker.py), each process writing only its own shards' bytes, never
gathering; the folder is bit-identical to a single-process save, and each process's
memory rose by about its own shards. Read back into the sharded abstract model (in
NNX's layout: the file's weights transposed), each process reads only the byte
ranges its devices hold, and gets the very shards it wrote."""

import json

import jax
import pytest
from jax.sharding import AxisType

from bridge._io import _hf_folder

from . import hf_folder_worker as worker
from .helpers import requires
from .processes import run_two


pytestmark = [pytest.mark.slow, requires("NNX")]


def test_two_processes_write_one_folder_without_gathering(tmp_path):
    run_two(worker.__file__, tmp_path, timeout=400)
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
        # read back: only its own shards' bytes (plus the index and the headers),
        # where reading whole arrays reads the whole model
        assert r["held"] <= r["read"] <= r["held"] + 64 * 1024, (r["read"], r["held"])
        assert r["read_same"]
    print("rise / own shards:", [round(r["rise"] / r["held"], 3) for r in results])
    print("bytes read / own shards:", [r["read"] / r["held"] for r in results])

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    single = tmp_path / "single"
    _hf_folder.save_folder(single, worker.tree_on(mesh), max_shard_size=worker.SHARD)
    files = sorted(p.name for p in single.iterdir())
    assert files == results[0]["files"] and len(files) == 6  # 5 shards, the index
    for name in files:
        assert (tmp_path / "out" / name).read_bytes() == (single / name).read_bytes()
