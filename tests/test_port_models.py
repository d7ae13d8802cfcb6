"""Whole models ported in all six directions: outputs equal the source's after, and
differed before."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import bridge

from . import models
from .helpers import needs_devices, requires


FRAMEWORKS = ("linen", "nnx", "equinox")
DIRECTIONS = [(a, b) for a, b in itertools.permutations(FRAMEWORKS, 2)]


def _trained_cnn(framework, seed, mode="batch"):
    """A CNN whose BatchNorm running statistics moved: three train-mode batches."""
    batches = [models.cnn_input(4) * (i + 1) + i for i in range(3)]
    if framework == "linen":
        module, variables = models.linen_cnn(seed)
        for x in batches:
            _, update = module.apply(variables, x, train=True, mutable=["batch_stats"])
            variables = {**variables, **update}
        return module, variables
    if framework == "nnx":
        model = models.nnx_cnn(seed)
        for x in batches:
            model(x)
        return model
    model, state = models.equinox_cnn(seed, mode=mode)
    train = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    for x in batches:
        _, state = train(x, state)
    return model, state


def _make(name, framework, seed, mode="batch"):
    if name == "cnn":
        return _trained_cnn(framework, seed, mode)
    return getattr(models, f"{framework}_{name}")(seed)


INPUTS = {
    "mlp": models.mlp_input,
    "cnn": models.cnn_input,
    "block": models.tokens,
}


@pytest.mark.parametrize("name", ["mlp", "cnn", "block"])
@pytest.mark.parametrize("source_fw,target_fw", DIRECTIONS)
def test_port_model(name, source_fw, target_fw):
    source = _make(name, source_fw, seed=1)
    target = _make(name, target_fw, seed=2)
    x = INPUTS[name]()
    assert bridge.compare(source, target, x) > 1e-3
    ported = bridge.port(source, target)
    assert bridge.compare(source, ported, x) < 1e-5
    assert type(ported) is type(target)


@pytest.mark.parametrize(
    "source_fw,target_fw", [("linen", "equinox"), ("equinox", "nnx")]
)
def test_cnn_equinox_ema_mode(source_fw, target_fw):
    source = _make("cnn", source_fw, seed=1, mode="ema")
    target = _make("cnn", target_fw, seed=2, mode="ema")
    x = models.cnn_input()
    assert bridge.compare(source, target, x) > 1e-3
    ported = bridge.port(source, target)
    assert bridge.compare(source, ported, x) < 1e-5


def test_target_is_not_modified():
    source, target = models.nnx_mlp(1), models.nnx_mlp(2)
    before = bridge.from_nnx(target)
    kernels = [layer.kernel[...] for layer in target.layers]
    ported = bridge.port(source, target)
    assert ported is not target
    assert all(layer.kernel[...] is k for layer, k in zip(target.layers, kernels))
    assert eqx.tree_equal(bridge.from_nnx(target), before)


def test_tree_in_tree_out():
    source = bridge.to_neutral(models.equinox_mlp(1))
    target = bridge.to_neutral(models.linen_mlp(2))
    ported = bridge.port(source, target)
    assert isinstance(ported, bridge.Tree)
    assert bridge.compare(source, ported, models.mlp_input()) < 1e-5


def test_abstract_targets_cost_no_memory():
    """Targets made under eval_shape hold no arrays; the port fills them."""
    from flax import nnx

    x = models.cnn_input()
    source = _trained_cnn("linen", seed=1)
    model_state = eqx.filter_eval_shape(models.equinox_cnn, 2)
    nnx_model = nnx.eval_shape(lambda: models.nnx_cnn(2))
    module = models.LinenCNN()
    variables = jax.eval_shape(module.init, jax.random.key(0), x)
    for target in (model_state, nnx_model, (module, variables)):
        assert bridge.compare(source, bridge.port(source, target), x) < 1e-5


@pytest.mark.parametrize("mode", ["batch", "ema"])
def test_training_continues_in_equinox_as_in_flax(mode):
    """After the port, one Equinox training step moves the running statistics as
    one Linen training step does (the counter and first-time flag are set so)."""
    module, variables = _trained_cnn("linen", seed=1)
    model, state = bridge.port((module, variables), _make("cnn", "equinox", 2, mode))
    x = models.cnn_input()
    train = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    _, state = train(x, state)
    _, linen = module.apply(variables, x, train=True, mutable=["batch_stats"])
    back = bridge.port((model, state), models.nnx_cnn())
    want = linen["batch_stats"]["BatchNorm_0"]
    assert jnp.allclose(back.bn.mean[...], want["mean"], rtol=1e-5, atol=1e-6)
    assert jnp.allclose(back.bn.var[...], want["var"], rtol=1e-5, atol=1e-6)
    assert not jnp.allclose(
        want["mean"], variables["batch_stats"]["BatchNorm_0"]["mean"]
    )


@needs_devices(8)
@requires("NNX")
def test_ported_arrays_take_the_target_sharding():
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(jax.devices()[:8], ("x",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "x"))
    source = eqx.nn.Linear(4, 16, key=jax.random.key(0))
    target = nnx.Linear(4, 16, rngs=nnx.Rngs(1))
    target.kernel[...] = jax.device_put(target.kernel[...], sharding)
    ported = bridge.port(source, target)
    assert ported.kernel[...].sharding.is_equivalent_to(sharding, 2)
    assert jnp.array_equal(ported.kernel[...], source.weight.T)
