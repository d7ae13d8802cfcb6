"""Train one model made of three frameworks' parts, in each framework's own idiom.

An NNX model holds a pretrained Equinox encoder (`bridge.as_nnx`); an Equinox model
holds an NNX CNN with BatchNorm (`bridge.as_equinox`, the State convention); a Linen
model holds an Equinox MLP (`bridge.as_linen`). Each is trained a few steps; the
script checks that the frozen encoder kept its weights, that the batch statistics
moved, and that the wrapped Equinox MLP trained inside Linen matches the same MLP
trained by Equinox alone.

    python examples/mix_frameworks.py
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training.train_state import TrainState

import bridge


x = jax.random.normal(jax.random.key(0), (16, 3))
y = jnp.sin(x.sum(axis=1, keepdims=True))


class Encoder(eqx.Module):
    """A pretrained Equinox MLP, on a batch."""

    mlp: eqx.nn.MLP

    def __call__(self, x):
        return jax.vmap(self.mlp)(x)


def encoder():
    return Encoder(eqx.nn.MLP(3, 8, 16, depth=2, key=jax.random.key(1)))


# 1. Equinox inside NNX, the encoder frozen with nnx.Optimizer(wrt=...)
class Model(nnx.Module):
    def __init__(self, rngs):
        self.enc = bridge.as_nnx(encoder())
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.enc(x)))


model = Model(nnx.Rngs(0))
frozen_before = model.enc.mlp.layers[0].weight[...]
head = nnx.All(nnx.Param, nnx.PathContains("head"))
optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=head)


@nnx.jit
def nnx_step(model, optimizer):
    loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, head))(model)
    optimizer.update(model, grads)
    return loss


losses = [float(nnx_step(model, optimizer)) for _ in range(50)]
assert np.array_equal(model.enc.mlp.layers[0].weight[...], frozen_before)
assert losses[-1] < losses[0]
print(f"Equinox in NNX:  loss {losses[0]:.4f} -> {losses[-1]:.4f}, encoder frozen")


# 2. NNX (with BatchNorm) inside Equinox: the state comes back through eqx.nn.State
class Features(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.bn(self.linear(x)))


class EqxModel(eqx.Module):
    features: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x, state):
        h, state = self.features(x, state)
        return jax.vmap(self.head)(h), state


eqx_model, state = eqx.nn.make_with_state(EqxModel)(
    bridge.as_equinox(Features(nnx.Rngs(2))), eqx.nn.Linear(8, 1, key=jax.random.key(3))
)
mean_before = state.get(eqx_model.features.model.bn.mean)
opt = optax.adam(1e-2)
opt_state = opt.init(eqx.filter(eqx_model, eqx.is_array))


@eqx.filter_jit
def eqx_step(model, state, opt_state):
    def loss_fn(model, state):
        out, state = model(x, state)
        return jnp.mean((out - y) ** 2), state

    (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
        model, state
    )
    updates, opt_state = opt.update(grads, opt_state)
    return eqx.apply_updates(model, updates), state, opt_state, loss


for _ in range(50):
    eqx_model, state, opt_state, loss = eqx_step(eqx_model, state, opt_state)
mean_after = state.get(eqx_model.features.model.bn.mean)
assert not np.allclose(mean_before, mean_after)
print(f"NNX in Equinox:  loss {float(loss):.4f}, batch statistics updated")


# 3. Equinox inside Linen, trained with TrainState; the same as Equinox alone
class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return bridge.as_linen(encoder(), name="enc")(x)


linen_model = LinenModel()
params = linen_model.init(jax.random.key(4), x)["params"]
train_state = TrainState.create(
    apply_fn=linen_model.apply, params=params, tx=optax.sgd(0.1)
)


@jax.jit
def linen_step(train_state):
    def loss_fn(params):
        return jnp.mean((train_state.apply_fn({"params": params}, x) - y[:, :1]) ** 2)

    return train_state.apply_gradients(grads=jax.grad(loss_fn)(train_state.params))


for _ in range(20):
    train_state = linen_step(train_state)

alone = encoder()  # the same MLP, trained by Equinox alone
sgd = optax.sgd(0.1)
sgd_state = sgd.init(eqx.filter(alone, eqx.is_array))


@eqx.filter_jit
def alone_step(model, opt_state):
    loss_fn = lambda m: jnp.mean((m(x) - y[:, :1]) ** 2)  # noqa: E731
    grads = eqx.filter_grad(loss_fn)(model)
    updates, opt_state = sgd.update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state


for _ in range(20):
    alone, sgd_state = alone_step(alone, sgd_state)
trained = train_state.params["enc"]["mlp"]["layers"][0]["weight"]
assert np.allclose(trained, alone.mlp.layers[0].weight, atol=1e-6)
print("Equinox in Linen: trained weights equal the same MLP trained by Equinox")
