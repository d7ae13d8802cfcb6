"""The same model gives Trees of the same structure whatever its native order (NNX
after `nnx.jit`, `nnx.eval_shape`, `nnx.clone`; Linen params after an optax step;
Equinox after `eqx.filter_eval_shape`), and each Tree still rebuilds its own native
order exactly, without copying."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import bridge
from bridge._tree import native_order

from .helpers import same_objects, skip_unless, tree_equal_bits


KEY = jax.random.key
D = 3
structure = jax.tree_util.tree_structure


class Block(nnx.Module):
    """Attributes defined out of sorted order, and a list of 12 (`10` sorts before
    `2` in NNX's own order)."""

    def __init__(self, rngs):
        self.pre_norm = nnx.LayerNorm(D, rngs=rngs)
        self.value = nnx.Linear(D, D, rngs=rngs)
        self.key = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(D, D, rngs=rngs) for _ in range(12)])
        self.post_norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x):
        x = self.key(self.value(self.pre_norm(x)))
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.post_norm(x)


def _nnx_variants():
    skip_unless("NNX")
    model = Block(nnx.Rngs(0))
    jitted = Block(nnx.Rngs(1))
    nnx.jit(lambda m, x: m(x))(jitted, jnp.ones((1, D)))
    abstract = nnx.eval_shape(lambda: Block(nnx.Rngs(0)))
    return model, jitted, abstract, nnx.clone(model)


def test_nnx_after_jit_eval_shape_and_clone_has_one_structure():
    model, jitted, abstract, cloned = _nnx_variants()
    assert list(vars(jitted)) != list(vars(model))  # the test can fail
    trees = [bridge.from_nnx(m) for m in (model, jitted, abstract, cloned)]
    assert all(structure(t) == structure(trees[0]) for t in trees)
    diff = jax.tree_util.tree_map(lambda a, b: a - b, trees[0], trees[1])
    assert diff.layers[10].kernel.shape == (D, D)
    # each Tree rebuilds its own attribute order, with the very same arrays
    for module, tree in zip((model, jitted, cloned), trees[:2] + trees[3:]):
        back = bridge.to_nnx(tree)
        assert list(vars(back)) == list(vars(module))
        assert same_objects(
            jax.tree_util.tree_leaves(nnx.state(back)),
            jax.tree_util.tree_leaves(nnx.state(module)),
        )
        x = jnp.linspace(-1, 1, 2 * D).reshape(2, D)
        assert tree_equal_bits(back(x), module(x))
    assert native_order(trees[0])[()][:3] == ("pre_norm", "value", "key")


class TwelveDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(12):
            x = jnp.tanh(nn.Dense(D)(x))
        return nn.LayerNorm()(x)


def test_linen_after_an_optax_step_has_one_structure():
    module = TwelveDense()
    x = jnp.ones((1, D))
    variables = module.init(KEY(0), x)
    tx = optax.adam(0.1)
    params = variables["params"]
    updates, _ = tx.update(params, tx.init(params), params)
    stepped = {"params": optax.apply_updates(params, updates)}
    assert list(stepped["params"]) != list(params)  # sorted: the test can fail
    one, two = bridge.from_linen(variables, module), bridge.from_linen(stepped, module)
    assert structure(one) == structure(two)
    assert list(one)[:3] == ["Dense_0", "Dense_1", "Dense_2"]  # natural order
    for given, tree in ((variables, one), (stepped, two)):
        back = bridge.to_linen(tree)
        assert list(back["params"]) == list(given["params"])  # the dict order again
        assert same_objects(
            jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(given)
        )


class Pair(eqx.Module):
    second: eqx.nn.Linear
    first: eqx.nn.Linear

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.second, self.first = eqx.nn.Linear(D, D, key=a), eqx.nn.Linear(D, D, key=b)


def test_equinox_after_filter_eval_shape_has_one_structure():
    model = Pair(KEY(0))
    abstract = eqx.filter_eval_shape(Pair, KEY(0))
    one, two = bridge.from_equinox(model), bridge.from_equinox(abstract)
    assert structure(one) == structure(two) and list(one) == ["second", "first"]
    assert same_objects(
        jax.tree_util.tree_leaves(bridge.to_equinox(one)),
        jax.tree_util.tree_leaves(model),
    )


def test_a_step_compiled_for_one_native_order_serves_the_other():
    model, jitted, _, _ = _nnx_variants()
    traces = []

    def loss_fn(module, x):
        traces.append(1)  # runs once per trace
        return jnp.mean(module(x) ** 2)

    a, b = bridge.from_nnx(model), bridge.from_nnx(jitted)
    step = bridge.make_step(loss_fn, optax.sgd(0.1), bridge.trainable(a, ".*"))
    x = jnp.ones((2, D))
    a2, state, _ = step(a, step.init(a), x)
    assert len(traces) == 1
    b2, _, _ = step(b, state, x)  # the optimizer state made for the other order
    assert len(traces) == 1  # not traced (nor compiled) again
    # each result rebuilds the attribute order of its own input
    assert list(vars(bridge.to_nnx(b2))) == list(vars(jitted))
    assert list(vars(bridge.to_nnx(a2))) == list(vars(model))
