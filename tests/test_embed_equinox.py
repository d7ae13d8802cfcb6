"""`bridge.as_equinox` composes with Equinox: filter_jit, filter_grad, partition,
tree_at, jax.vmap, the State convention, inference_mode; freezing and porting an
outer model through the wrapper."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import bridge

from .embed_models import NNXMLP, inputs, native
from .helpers import requires, tree_equal_bits


class Outer(eqx.Module):
    """An Equinox model with a wrapped component and a layer of its own."""

    enc: eqx.Module
    head: eqx.nn.Linear

    def __init__(self, enc, key):
        self.enc = enc
        self.head = eqx.nn.Linear(2, 3, key=key)

    def __call__(self, x, state):
        h, state = self.enc(x, state)
        return jax.vmap(self.head)(h), state


def _outer():
    return eqx.nn.make_with_state(Outer)(
        bridge.as_equinox(native("nnx", "cnn")), jax.random.key(1)
    )


@requires("NNX")
def test_state_convention_filter_jit_and_inference_mode():
    nnx_cnn = native("nnx", "cnn")
    model, state = eqx.nn.make_with_state(Outer)(
        bridge.as_equinox(nnx_cnn), jax.random.key(1)
    )
    x, _ = inputs("cnn")
    y, state = eqx.filter_jit(lambda m, x, s: m(x, s))(model, x, state)
    want = jax.vmap(model.head)(nnx.jit(lambda m, x: m(x))(nnx_cnn, x))
    assert jnp.allclose(y, want, atol=1e-6)
    tree = bridge.from_equinox(model, state)
    assert jnp.array_equal(tree.enc.model.bn.mean, nnx_cnn.bn.mean[...])
    assert bridge.roles(tree).enc.model.bn.mean == "state"
    infer = eqx.nn.inference_mode(model)
    assert infer.enc.inference is True
    _, after = infer(x, state)
    assert tree_equal_bits(jax.tree.leaves(after), jax.tree.leaves(state))


@requires("NNX")
def test_filter_grad_partition_tree_at_vmap():
    mlp = NNXMLP(nnx.Rngs(0))
    layer = bridge.as_equinox(mlp)
    x, _ = inputs("mlp")
    assert jnp.array_equal(jax.vmap(layer)(x), layer(x))  # one example at a time
    grads = eqx.filter_grad(lambda m: m(x).sum())(layer)
    want = nnx.grad(lambda m: m(x).sum())(mlp)
    assert jnp.array_equal(
        grads.model.layers[0].kernel, want["layers"][0]["kernel"][...]
    )
    params, static = eqx.partition(layer, eqx.is_array)
    assert jnp.array_equal(eqx.combine(params, static)(x), layer(x))
    zero = eqx.tree_at(lambda m: m.model.layers[1].bias, layer, jnp.zeros(2))
    mlp.layers[1].bias[...] = jnp.zeros(2)
    assert jnp.array_equal(zero(x), mlp(x))


@requires("NNX")
def test_trainable_freezes_the_wrapped_part_with_make_step():
    model, state = _outer()
    tree = bridge.from_equinox(model, state)
    spec = bridge.trainable(tree, lambda t: (t.head, t.enc.model.head))
    x, _ = inputs("cnn")

    def loss_fn(model, state, x):
        y, state = model(x, state)
        return jnp.sum(y**2), state

    step = bridge.make_step(loss_fn, optax.sgd(0.1), spec)
    before = bridge.from_equinox(*_outer())  # the same values (`tree` is consumed)
    new, _, _ = step(tree, step.init(tree), x)
    assert jnp.array_equal(new.enc.model.conv.kernel, before.enc.model.conv.kernel)
    assert not jnp.array_equal(new.enc.model.head.kernel, before.enc.model.head.kernel)
    assert not jnp.array_equal(new.enc.model.bn.mean, before.enc.model.bn.mean)


@requires("NNX")
def test_port_through_wrappers():
    # an Equinox model holding a wrapped NNX MLP <-> the same model all in Equinox
    class Native(eqx.Module):
        enc: eqx.nn.MLP
        head: eqx.nn.Linear

        def __call__(self, x):
            return self.head(self.enc(x))

    class Mixed(eqx.Module):
        enc: eqx.Module
        head: eqx.nn.Linear

        def __call__(self, x):
            return self.head(self.enc(x))

    mixed = Mixed(
        bridge.as_equinox(NNXMLP(nnx.Rngs(0))),
        eqx.nn.Linear(2, 3, key=jax.random.key(1)),
    )
    target = Native(
        eqx.nn.MLP(3, 2, 5, depth=1, activation=jax.nn.relu, key=jax.random.key(2)),
        eqx.nn.Linear(2, 3, key=jax.random.key(3)),
    )
    x, _ = inputs("mlp")
    ported = bridge.port(mixed, target)
    assert jnp.allclose(jax.vmap(ported)(x), jax.vmap(mixed)(x), atol=1e-6)
    back = bridge.port(
        ported, Mixed(bridge.as_equinox(NNXMLP(nnx.Rngs(5))), target.head)
    )
    assert jnp.allclose(jax.vmap(back)(x), jax.vmap(mixed)(x), atol=1e-6)
