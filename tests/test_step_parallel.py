"""Data parallelism: `make_step(..., axis_name=...)` under `jax.pmap` and `shard_map`,
the pattern of Flax's ImageNet example (`pmap`, `BatchNorm(axis_name="batch")`)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import bridge

from .helpers import needs_devices, requires, tree_allclose


DEVICES, STEPS = 4, 3


class Net(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(8, use_bias=False)(x)  # as ResNet convs: BatchNorm follows
        x = nn.BatchNorm(
            use_running_average=not train, momentum=0.9, axis_name=self.axis_name
        )(x)
        return nn.Dense(1)(nn.relu(x))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def data():
    x = jax.random.normal(jax.random.key(1), (4 * DEVICES, 3))
    return x, jnp.sin(x.sum(axis=1, keepdims=True))


def setup(axis_name):
    """The Tree (BatchNorm synchronised over `axis_name`) and a step training it all."""
    variables = Net().init(jax.random.key(0), data()[0])
    tree = bridge.from_linen(variables, Net(axis_name))
    spec = bridge.trainable(tree, ".")
    return tree, bridge.make_step(loss_fn, optax.adam(1e-2), spec, axis_name=axis_name)


def single_device():
    """The oracle: one device, the whole batch, no axis."""
    tree, step = setup(None)
    opt_state, losses = step.init(tree), []
    for _ in range(STEPS):
        tree, opt_state, loss = step(tree, opt_state, *data())
        losses.append(loss)
    return tree, losses


leaves = jax.tree_util.tree_leaves


def replicate(tree):
    return jax.tree_util.tree_map(lambda x: jnp.stack([x] * DEVICES), tree)


# slow (pmap compiles the step for every device: about a minute on 2 shared cores);
# test_shard_map_agrees_with_the_single_device_step runs the same data-parallel step
# against the same single-device oracle by default
@needs_devices(DEVICES)
@pytest.mark.slow
def test_pmap_replicas_agree_with_the_single_device_step():
    tree, step = setup("batch")
    opt_state = replicate(step.init(tree))
    tree = replicate(tree)
    p_step = jax.pmap(step, axis_name="batch", devices=jax.devices()[:DEVICES])
    x, y = (a.reshape(DEVICES, -1, a.shape[-1]) for a in data())
    losses = []
    for _ in range(STEPS):
        tree, opt_state, loss = p_step(tree, opt_state, x, y)
        losses.append(loss)
    for leaf in jax.tree_util.tree_leaves(tree):
        leaf = np.asarray(leaf)
        assert all(np.array_equal(leaf[0], replica) for replica in leaf[1:])
    oracle, oracle_losses = single_device()
    first = jax.tree_util.tree_map(lambda a: a[0], tree)
    # (the modules differ by their axis_name: compare the leaves)
    assert tree_allclose(leaves(first), leaves(oracle))
    assert tree_allclose([a[0] for a in losses], oracle_losses)
    # without the averaging the replicas drift apart: the test can fail
    tree, step = setup("batch")
    unsynced = bridge.make_step(loss_fn, optax.adam(1e-2), bridge.trainable(tree, "."))
    p_unsynced = jax.pmap(unsynced, axis_name="batch", devices=jax.devices()[:DEVICES])
    after, _, _ = p_unsynced(replicate(tree), replicate(unsynced.init(tree)), x, y)
    kernel = np.asarray(after.Dense_1.kernel)
    assert not np.array_equal(kernel[0], kernel[1])


@needs_devices(DEVICES)
@requires("jax.shard_map")
def test_shard_map_agrees_with_the_single_device_step():
    tree, step = setup("batch")
    mesh = jax.make_mesh(
        (DEVICES,),
        ("batch",),
        axis_types=(AxisType.Auto,),
        devices=jax.devices()[:DEVICES],
    )
    sharded = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("batch"), P("batch")),
            out_specs=(P(), P(), P()),
        )
    )
    opt_state = step.init(tree)
    for _ in range(STEPS):
        tree, opt_state, loss = sharded(tree, opt_state, *data())
    oracle, oracle_losses = single_device()
    assert tree_allclose(leaves(tree), leaves(oracle))
    assert np.allclose(loss, oracle_losses[-1])
