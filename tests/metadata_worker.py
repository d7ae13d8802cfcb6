"""One process of the 2-process test of `save(folder, layout="torch", metadata=)`
(tests/test_write_concurrency.py): an array sharded over the 8 devices of 2 processes
x 4 CPU devices, saved first with a `metadata=` that differs per process (a host
name: process 0's longer), then with the same. Writes what happened to
`result-PROCESS_ID.json`.

    python tests/metadata_worker.py PORT PROCESS_ID DIRECTORY
"""

import json
import os
import sys
from pathlib import Path


os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402


jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import bridge  # noqa: E402


def main(port, process_id, directory):
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    rows = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    kernel = jax.make_array_from_callback(
        rows.shape, NamedSharding(mesh, P("fsdp")), lambda index: rows[index]
    )
    tree = {"params": {"Dense_0": {"kernel": kernel}}}
    out = Path(directory) / "out"
    host = "node-0-with-a-long-name" if process_id == 0 else "n1"
    result = {}
    try:
        bridge.save_pretrained(out, tree, metadata={"host": host})
        result["different"] = "saved"
    except ValueError as e:
        result["different"] = str(e)
    result["after_refusal"] = sorted(os.listdir(directory))
    bridge.save_pretrained(out, tree, metadata={"host": "same"})
    if process_id == 0:
        back = np.asarray(bridge.load(out).Dense_0.weight)
        result["same"] = bool((back == rows.T).all())
    result["left"] = sorted(os.listdir(directory))
    (Path(directory) / f"result-{process_id}.json").write_text(json.dumps(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
