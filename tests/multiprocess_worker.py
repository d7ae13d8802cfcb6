"""One process of the 2-process test (tests/test_multiprocess.py): trains a small NNX
MLP sharded over the 8 devices of 2 processes x 4 CPU devices with `make_step`, saves
and loads it with orbax, and process 0 writes what it saw to an .npz file.

    python tests/multiprocess_worker.py PORT PROCESS_ID DIRECTORY
"""

import os
import sys


os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402


jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import bridge  # noqa: E402


STEPS, BATCH, WIDTH = 3, 16, 8


def model():
    return nnx.Sequential(
        nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0)),
        nnx.relu,
        nnx.Linear(WIDTH, 1, rngs=nnx.Rngs(1)),
    )


def data():
    x = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))
    return np.asarray(x), np.asarray(jnp.sin(x.sum(axis=1, keepdims=True)))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def train(tree, x, y):
    """The run both sides make: the head trained with adam for STEPS steps."""
    step = bridge.make_step(loss_fn, optax.adam(1e-2), bridge.trainable(tree, r"\[2\]"))
    opt_state, losses = step.init(tree), []
    for _ in range(STEPS):
        tree, opt_state, loss = step(tree, opt_state, x, y)
        losses.append(loss)
    return tree, losses


def main(port, process_id, directory):
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def spread(x, spec):
        host = np.asarray(x)
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    def spec(x):
        return P("data", "model") if x.ndim == 2 and x.shape[1] % 2 == 0 else P()

    tree = jax.tree_util.tree_map(
        lambda a: spread(a, spec(a)), bridge.from_nnx(model())
    )
    x, y = data()
    tree, losses = train(tree, spread(x, P("data")), spread(y, P("data")))
    say = lambda what: print(f"process {process_id}: {what}", flush=True)  # noqa: E731
    say("trained")
    path = os.path.join(directory, "ckpt")
    bridge.save(path, tree)
    say("saved")
    loaded = bridge.load(path, like=tree)
    say("loaded like the tree")
    plain = bridge.load(path)
    say("loaded")
    gather = multihost_utils.process_allgather
    same = all(
        a.sharding == b.sharding and bool(jnp.array_equal(a, b))
        for a, b in zip(
            jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(tree)
        )
    )
    try:  # one file cannot hold the shards of other processes
        bridge.save(os.path.join(directory, "model.safetensors"), tree)
        refused = ""
    except ValueError as error:
        refused = str(error)
    out = {  # (a collective: every process gathers)
        jax.tree_util.keystr(p): gather(a, tiled=True)
        for p, a in jax.tree_util.tree_leaves_with_path(tree)
    }
    kernel = gather(plain.layers[2].kernel, tiled=True)
    if process_id == 0:
        np.savez(
            os.path.join(directory, "result.npz"),
            losses=np.array([float(v) for v in losses]),
            same=same,
            refused=refused,
            plain=np.asarray(kernel),
            names=np.array(sorted(os.listdir(directory))),
            **out,
        )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
