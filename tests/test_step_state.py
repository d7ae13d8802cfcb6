"""State the forward pass writes comes back in the Tree, as the native step gives."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import bridge

from . import models
from .helpers import fresh, requires, tree_equal_bits
from .test_step import STEPS, assert_frozen_and_trained, by_path, mse


TARGET = jnp.ones((2, models.D_OUT))


def nnx_native_steps(model, loss_fn, wrt, optim, *batch):
    """`nnx.jit` + `nnx.Optimizer(wrt=...)` + `nnx.DiffState`: NNX's own freezing."""
    optimizer = nnx.Optimizer(model, optim, wrt=wrt)

    @nnx.jit
    def native_step(model, optimizer, *batch):
        diff = nnx.DiffState(0, wrt)
        loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model, *batch)
        optimizer.update(model, grads)
        return loss

    return [native_step(model, optimizer, *batch) for _ in range(STEPS)]


def bridge_steps(tree, loss_fn, where, optim, *batch):
    step = bridge.make_step(loss_fn, optim, bridge.trainable(tree, where))
    tree = fresh(tree)
    opt_state, losses = step.init(tree), []
    for _ in range(STEPS):
        tree, opt_state, loss = step(tree, opt_state, *batch)
        losses.append(loss)
    return tree, losses


def test_nnx_batchnorm_statistics_match_nnx_jit():
    model, x = models.nnx_cnn(), models.cnn_input()
    tree = bridge.from_nnx(model)
    after, _ = bridge_steps(tree, mse, lambda t: t.head, optax.adam(1e-2), x, TARGET)
    head = nnx.All(nnx.Param, nnx.PathContains("head"))
    nnx_native_steps(model, mse, head, optax.adam(1e-2), x, TARGET)
    oracle = by_path(bridge.from_nnx(model))
    assert tree_equal_bits(by_path(after), oracle)
    assert not tree_equal_bits(after.bn.mean, tree.bn.mean)
    assert tree_equal_bits(after.conv.kernel, tree.conv.kernel)


class DropoutMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(models.D_IN, models.D_HID, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(models.D_HID, models.D_OUT, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(jax.nn.relu(self.hidden(x))))


@requires("NNX")
def test_nnx_dropout_draws_a_new_mask_each_step_like_nnx_jit():
    model, x = DropoutMLP(nnx.Rngs(0, dropout=1)), models.mlp_input()
    y = jnp.ones((4, models.D_OUT))
    tree = bridge.from_nnx(model)
    # learning rate 0: the loss changes from step to step only through the mask
    sgd = optax.sgd(0.0)
    after, losses = bridge_steps(tree, mse, lambda t: t.head, sgd, x, y)
    head = nnx.All(nnx.Param, nnx.PathContains("head"))
    native_losses = nnx_native_steps(model, mse, head, sgd, x, y)
    assert len({float(loss) for loss in losses}) == STEPS
    assert [float(a) for a in losses] == [float(b) for b in native_losses]
    assert tree_equal_bits(by_path(after), by_path(bridge.from_nnx(model)))


@requires("NNX")
def test_nnx_tied_weights_stay_tied():
    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(models.D_IN, models.D_IN, rngs=rngs)
            self.second = self.first
            self.head = nnx.Linear(models.D_IN, models.D_OUT, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.relu(self.second(jax.nn.relu(self.first(x)))))

    model, x = Tied(nnx.Rngs(0)), models.mlp_input()
    y = jnp.ones((4, models.D_OUT))
    tree = bridge.from_nnx(model)
    after, _ = bridge_steps(tree, mse, lambda t: t.first, optax.adam(1e-2), x, y)
    native = bridge.to_nnx(after)
    assert native.first.kernel is native.second.kernel
    first = nnx.All(nnx.Param, nnx.PathContains("first"))
    nnx_native_steps(model, mse, first, optax.adam(1e-2), x, y)
    assert_frozen_and_trained(tree, after, bridge.from_nnx(model), ".first.")


def test_linen_batch_stats_match_apply_with_mutable():
    module, variables = models.linen_cnn()
    x = models.cnn_input()
    tree = bridge.from_linen(variables, module)

    def loss_fn(model, x, y):
        return mse(lambda x: model(x, train=True), x, y)

    optim = optax.adam(1e-2)
    after, _ = bridge_steps(tree, loss_fn, r"^\.Dense_0\.", optim, x, TARGET)

    params, stats = variables["params"], variables["batch_stats"]
    labels = {k: "train" if k == "Dense_0" else "frozen" for k in params}
    native_optim = optax.multi_transform(
        {"train": optim, "frozen": optax.set_to_zero()}, labels
    )

    @jax.jit
    def native_step(params, stats, opt_state, x, y):
        def loss(params):
            out, new = module.apply(
                {"params": params, "batch_stats": stats},
                x,
                train=True,
                mutable=["batch_stats"],
            )
            return jnp.mean((out - y) ** 2), new["batch_stats"]

        (_, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = native_optim.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state

    opt_state = native_optim.init(params)
    for _ in range(STEPS):
        params, stats, opt_state = native_step(params, stats, opt_state, x, TARGET)
    oracle = bridge.from_linen({"params": params, "batch_stats": stats}, module)
    assert tree_equal_bits(by_path(after), by_path(oracle))
    assert not tree_equal_bits(after.BatchNorm_0.mean, tree.BatchNorm_0.mean)
    assert tree_equal_bits(after.Conv_0.kernel, tree.Conv_0.kernel)


def eqx_loss(model, state, x, y):
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    out, state = batched(x, state)
    return jnp.mean((out - y) ** 2), state


def test_equinox_state_matches_the_equinox_recipe():
    model, state = models.equinox_cnn()
    x = models.cnn_input()
    tree = bridge.from_equinox(model, state)
    optim = optax.adam(1e-2)
    after, _ = bridge_steps(tree, eqx_loss, lambda t: t.head, optim, x, TARGET)

    spec = jax.tree_util.tree_map(lambda _: False, model)
    spec = eqx.tree_at(
        lambda m: (m.head.weight, m.head.bias), spec, replace=(True, True)
    )

    @eqx.filter_jit
    def native_step(model, state, opt_state, x, y):
        diff, static = eqx.partition(model, spec)
        loss = lambda d, s: eqx_loss(eqx.combine(d, static), s, x, y)  # noqa: E731
        (_, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(diff, state)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), state, opt_state

    opt_state = optim.init(eqx.filter(model, spec))
    for _ in range(STEPS):
        model, state, opt_state = native_step(model, state, opt_state, x, TARGET)
    oracle = by_path(bridge.from_equinox(model, state))
    assert tree_equal_bits(by_path(after), oracle)
    assert not tree_equal_bits(
        after.bn.batch_state_index[0], tree.bn.batch_state_index[0]
    )


def test_equinox_loss_must_return_the_new_state():
    tree = bridge.from_equinox(*models.equinox_cnn())

    def forgets_state(model, state, x, y):
        return eqx_loss(model, state, x, y)[0]

    step = bridge.make_step(forgets_state, optax.sgd(0.1), bridge.trainable(tree, "."))
    with pytest.raises(TypeError, match=r"must return `\(loss, new_state\)`"):
        step(tree, step.init(tree), models.cnn_input(), TARGET)


def test_equinox_state_with_aux():
    tree = bridge.from_equinox(*models.equinox_cnn())

    def loss_fn(model, state, x, y):
        loss, state = eqx_loss(model, state, x, y)
        return (loss, {"twice": 2 * loss}), state

    spec = bridge.trainable(tree, lambda t: t.head)
    step = bridge.make_step(loss_fn, optax.sgd(0.1), spec, has_aux=True)
    plain = bridge.make_step(eqx_loss, optax.sgd(0.1), spec)
    x = models.cnn_input()
    new, _, loss, aux = step(fresh(tree), step.init(tree), x, TARGET)
    oracle, _, _ = plain(tree, plain.init(tree), x, TARGET)
    assert tree_equal_bits(aux["twice"], 2 * loss)
    assert tree_equal_bits(by_path(new), by_path(oracle))
