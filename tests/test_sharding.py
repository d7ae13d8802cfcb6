"""Sharded arrays keep their NamedSharding through every adapter (8 CPU devices)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import bridge

from . import models
from .helpers import requires


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets 8 CPU devices)")
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(auto, auto))


def _shard(tree, mesh):
    """Each array onto the mesh: the last axis over `model` when 4 divides it."""

    def put(x):
        if not eqx.is_array(x):
            return x
        spec = (
            P(*([None] * (x.ndim - 1)), "model")
            if x.ndim and x.shape[-1] % 4 == 0
            else P()
        )
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map(put, tree)


def _check(tree, native_leaves, mesh):
    leaves = jax.tree_util.tree_leaves(tree)
    assert {id(x) for x in leaves} <= {id(x) for x in native_leaves}
    assert all(x.sharding.mesh == mesh for x in leaves)
    assert any(x.sharding.spec == P(None, "model") for x in leaves)


def test_linen(mesh):
    module, variables = models.linen_block()
    variables = _shard(variables, mesh)
    t = bridge.from_linen(variables, module)
    _check(t, jax.tree_util.tree_leaves(variables), mesh)
    back = bridge.to_linen(t)
    for x, y in zip(
        jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(variables)
    ):
        assert x is y and x.sharding == y.sharding
    doubled = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: 2 * x, s))(t)
    assert doubled.Dense_0.kernel.sharding.is_equivalent_to(
        t.Dense_0.kernel.sharding, 2
    )


def test_nnx(mesh):
    module = models.nnx_block()
    graphdef, state = nnx.split(module)
    module = nnx.merge(graphdef, _shard(state, mesh))
    t = bridge.from_nnx(module)
    raw = [v.get_raw_value() for v in nnx.graph.flatten(module)[1].leaves]
    _check(t, raw, mesh)
    back = bridge.to_nnx(t)
    assert back.dense.kernel.get_raw_value() is module.dense.kernel.get_raw_value()
    assert back.dense.kernel[...].sharding == NamedSharding(mesh, P(None, "model"))


@requires("NNX", "jax.set_mesh")
def test_nnx_partitioning_annotations_survive(mesh):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(mesh):
        module = nnx.Linear(2, 8, kernel_init=init, rngs=nnx.Rngs(0))
    t = bridge.from_nnx(module)
    assert t.kernel.sharding.spec == P(None, "model")
    back = bridge.to_nnx(t)
    # `out_sharding` since flax 0.12.4, `sharding_names` before
    assert (None, "model") in back.kernel.get_metadata().values()
    assert back.kernel.get_metadata() == module.kernel.get_metadata()
    assert back.kernel.get_raw_value() is t.kernel


def test_equinox(mesh):
    model = _shard(models.equinox_block(), mesh)
    t = bridge.from_equinox(model)
    _check(t, jax.tree_util.tree_leaves(model), mesh)
    back = bridge.to_equinox(t)
    assert back.dense.weight is model.dense.weight
    assert back.dense.weight.sharding == NamedSharding(mesh, P(None, "model"))
    assert eqx.tree_equal(back, model)
    assert jnp.array_equal(
        jax.vmap(back)(models.tokens()), jax.vmap(model)(models.tokens())
    )
