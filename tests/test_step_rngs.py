"""Linen random streams: `to_native(tree, rngs=...)` and `step(..., rngs=...)`
against `module.apply(..., rngs=...)` + optax, the Linen oracle."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import bridge

from . import models
from .helpers import fresh, tree_equal_bits
from .test_step import STEPS, TARGET, assert_frozen_and_trained


class DropoutMLP(nn.Module):
    batch_norm: bool = False

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(models.D_HID)(x)
        if self.batch_norm:
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.5, deterministic=not train)(jax.nn.relu(x))
        x = nn.Dropout(0.5, deterministic=not train)(jax.nn.relu(nn.Dense(6)(x)))
        return nn.Dense(models.D_OUT)(x)


def train_mse(model, x, y):
    return jnp.mean((model(x, train=True) - y) ** 2)


def keys(seed=0):
    return [jax.random.fold_in(jax.random.key(seed), i) for i in range(STEPS)]


def make(batch_norm=False):
    module = DropoutMLP(batch_norm)
    x = models.mlp_input()
    return module, module.init(jax.random.key(0), x), x


def bridge_steps(module, variables, x, stream_keys):
    tree = bridge.from_linen(variables, module)
    spec = bridge.trainable(tree, r"^\.Dense_2\.")
    step = bridge.make_step(train_mse, optax.adam(1e-2), spec)
    after, opt_state, losses = fresh(tree), step.init(tree), []
    for key in stream_keys:
        after, opt_state, loss = step(after, opt_state, x, TARGET, rngs=key)
        losses.append(loss)
    return tree, after, losses


def linen_steps(module, variables, x, stream_keys):
    """Linen's own step: `apply` with `rngs` and `mutable`, frozen by
    `optax.multi_transform` with `set_to_zero`."""
    params = variables["params"]
    stats = {k: v for k, v in variables.items() if k != "params"}
    labels = {k: "train" if k == "Dense_2" else "frozen" for k in params}
    optim = optax.multi_transform(
        {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels
    )

    @jax.jit
    def native_step(params, stats, opt_state, x, y, key):
        def loss(p):
            out, new_stats = module.apply(
                {"params": p, **stats},
                x,
                train=True,
                rngs={"dropout": key},
                mutable=list(stats),
            )
            return jnp.mean((out - y) ** 2), new_stats

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = optim.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, value

    opt_state, losses = optim.init(params), []
    for key in stream_keys:
        params, stats, opt_state, loss = native_step(
            params, stats, opt_state, x, TARGET, key
        )
        losses.append(loss)
    return {"params": params, **stats}, losses


def test_dropout_step_matches_linen_apply_with_rngs():
    module, variables, x = make()
    stream_keys = keys()
    tree, after, losses = bridge_steps(
        module, variables, x, [{"dropout": k} for k in stream_keys]
    )
    oracle, oracle_losses = linen_steps(module, variables, x, stream_keys)
    assert_frozen_and_trained(
        tree, after, bridge.from_linen(oracle, module), ".Dense_2."
    )
    assert tree_equal_bits(losses, oracle_losses)


def test_dropout_and_batchnorm_statistics_come_back():
    module, variables, x = make(batch_norm=True)
    stream_keys = keys()
    tree, after, losses = bridge_steps(
        module, variables, x, [{"dropout": k} for k in stream_keys]
    )
    oracle, oracle_losses = linen_steps(module, variables, x, stream_keys)
    oracle = bridge.from_linen(oracle, module)
    assert tree_equal_bits(after.BatchNorm_0.mean, oracle.BatchNorm_0.mean)
    assert tree_equal_bits(after.BatchNorm_0.var, oracle.BatchNorm_0.var)
    assert not tree_equal_bits(after.BatchNorm_0.mean, tree.BatchNorm_0.mean)
    assert tree_equal_bits(after.Dense_2.kernel, oracle.Dense_2.kernel)
    assert tree_equal_bits(after.Dense_0.kernel, tree.Dense_0.kernel)
    assert tree_equal_bits(losses, oracle_losses)


def test_new_keys_give_new_losses_without_retracing():
    module, variables, x = make()
    traces = []

    def counting_mse(model, x, y):
        traces.append(1)
        return train_mse(model, x, y)

    tree = bridge.from_linen(variables, module)
    step = bridge.make_step(
        counting_mse,
        optax.sgd(0.0),
        bridge.trainable(tree, r"^\.Dense_2\."),
        donate=False,  # the same Tree and state, step after step
    )
    opt_state = step.init(tree)
    losses = [step(tree, opt_state, x, TARGET, rngs={"dropout": k})[2] for k in keys()]
    assert len(traces) == 1
    assert len({float(v) for v in losses}) == STEPS
    same = step(tree, opt_state, x, TARGET, rngs={"dropout": keys()[0]})[2]
    assert tree_equal_bits(same, losses[0])


def test_to_native_rngs_means_what_apply_rngs_means():
    module, variables, x = make()
    tree = bridge.from_linen(variables, module)
    key = jax.random.key(7)
    for rngs in ({"dropout": key}, key):  # one key feeds "params", the fallback
        bound = bridge.to_native(tree, rngs=rngs)
        want = module.apply(variables, x, train=True, rngs=rngs)
        assert tree_equal_bits(bound(x, train=True), want)
    dropped = bridge.to_native(tree, rngs=key)(x, train=True)
    assert not tree_equal_bits(dropped, module.apply(variables, x))


def test_a_step_without_rngs_says_how_to_give_them():
    module, variables, x = make()
    tree = bridge.from_linen(variables, module)
    step = bridge.make_step(
        train_mse, optax.adam(1e-2), bridge.trainable(tree, r"^\.Dense_2\.")
    )
    with pytest.raises(ValueError, match=r"needs PRNG for \"dropout\"(.|\n)*rngs="):
        step(tree, step.init(tree), x, TARGET)


def test_rngs_for_another_framework_is_an_error():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="Flax NNX model(.|\n)*drop `rngs`"):
        bridge.to_native(bridge.from_nnx(models.nnx_mlp()), rngs=key)
    with pytest.raises(ValueError, match="Equinox model(.|\n)*key="):
        bridge.to_native(bridge.from_equinox(models.equinox_mlp()), rngs=key)
    _, variables, _ = make()
    with pytest.raises(ValueError, match="made without its module"):
        bridge.to_native(bridge.from_linen(variables), rngs=key)


def test_rngs_for_an_nnx_step_is_an_error():
    model, x = models.nnx_mlp(), models.mlp_input()
    tree = bridge.from_nnx(model)
    spec = bridge.trainable(tree, lambda t: t.layers[-1])
    step = bridge.make_step(
        lambda m, x, y: jnp.mean((m(x) - y) ** 2), optax.adam(1e-2), spec
    )
    with pytest.raises(ValueError, match="`rngs` is for Flax Linen models"):
        step(tree, step.init(tree), x, TARGET, rngs=jax.random.key(0))
