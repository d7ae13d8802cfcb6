"""`bridge.as_nnx` composes with NNX: split/merge/state, nnx.jit, nnx.grad,
nnx.Optimizer(wrt=...), nnx.DiffState, nnx.eval_shape; parity with nnx.bridge.ToNNX."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import bridge

from .embed_models import EquinoxBatchCNN, inputs, native
from .helpers import requires, tree_equal_bits
from .models import EquinoxCNN


# NNX wrappers need bridge's NNX adapter (flax >= 0.12.1)
pytestmark = requires("NNX")


class Outer(nnx.Module):
    """An NNX model with a wrapped component and a layer of its own."""

    def __init__(self, enc, rngs):
        self.enc = enc
        self.head = nnx.Linear(2, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.enc(x))


def _outer(kind="mlp"):
    return Outer(bridge.as_nnx(native("equinox", kind)), nnx.Rngs(0))


def test_split_merge_state_see_the_wrapped_arrays():
    mlp = native("equinox", "mlp")
    model = Outer(bridge.as_nnx(mlp), nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    w = params["enc"]["mlp"]["layers"][0]["weight"]
    assert isinstance(w, nnx.Param) and w[...] is mlp.mlp.layers[0].weight
    x, _ = inputs("mlp")
    assert jnp.array_equal(nnx.merge(graphdef, params, rest)(x), model(x))
    paths = {
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(bridge.from_nnx(model))
    }
    assert ".enc.mlp.layers[0].weight" in paths


@requires("eqx.nn.BatchNorm(mode=...)")  # its batch_state_index
def test_batch_stats_written_back_under_nnx_jit():
    cnn, state = eqx.nn.make_with_state(EquinoxCNN)(jax.random.key(0))
    wrapped = bridge.as_nnx((EquinoxBatchCNN(cnn), state))
    x, _ = inputs("cnn")
    y = nnx.jit(lambda m, x: m(x))(wrapped, x)
    want, new_state = eqx.filter_jit(EquinoxBatchCNN(cnn))(x, state)
    assert jnp.array_equal(y, want)
    stats = nnx.state(wrapped, nnx.BatchStat)
    assert isinstance(wrapped.cnn.bn.batch_state_index[0], nnx.BatchStat)
    mean = stats["cnn"]["bn"]["batch_state_index"][0][...]
    assert jnp.array_equal(mean, new_state.get(cnn.bn.batch_state_index)[0])
    wrapped.eval()  # inference mode: running averages, no write
    before = jax.tree.leaves(nnx.state(wrapped, nnx.BatchStat))
    wrapped(x)
    assert tree_equal_bits(before, jax.tree.leaves(nnx.state(wrapped, nnx.BatchStat)))
    infer = eqx.nn.inference_mode(EquinoxBatchCNN(cnn))
    assert jnp.array_equal(wrapped(x), infer(x, new_state)[0])


def test_optimizer_wrt_and_diffstate_freeze_the_wrapped_part():
    model = _outer()
    x, _ = inputs("mlp")
    head_only = nnx.All(nnx.Param, nnx.PathContains("head"))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=head_only)
    before = jax.tree.leaves(nnx.state(model.enc))

    @nnx.jit
    def step(model, opt):
        loss = lambda m: jnp.sum(m(x) ** 2)  # noqa: E731
        grads = nnx.grad(loss, argnums=nnx.DiffState(0, head_only))(model)
        opt.update(model, grads)

    step(model, opt)
    assert tree_equal_bits(before, jax.tree.leaves(nnx.state(model.enc)))
    assert not np.array_equal(model.head.kernel[...], _outer().head.kernel[...])


def test_eval_shape_and_trainable_through_the_wrapper():
    abstract = nnx.eval_shape(_outer)
    leaf = abstract.enc.mlp.layers[1].weight
    assert isinstance(leaf.get_raw_value(), jax.ShapeDtypeStruct)
    assert leaf.shape == (2, 5)
    tree = bridge.from_nnx(_outer())
    spec = bridge.trainable(tree, lambda t: t.enc.mlp.layers[1])
    chosen = [
        jax.tree_util.keystr(p)
        for p, f in jax.tree_util.tree_leaves_with_path(spec)
        if f
    ]
    assert chosen == [".enc.mlp.layers[1].bias", ".enc.mlp.layers[1].weight"]
    x, y = inputs("mlp")
    step = bridge.make_step(lambda m, x: jnp.sum(m(x) ** 2), optax.sgd(0.1), spec)
    before = _outer()  # the same weights (the step consumes `tree`)
    new, _, _ = step(tree, step.init(tree), x)
    assert jnp.array_equal(
        new.enc.mlp.layers[0].weight, before.enc.mlp.layers[0].weight[...]
    )
    assert not jnp.array_equal(
        new.enc.mlp.layers[1].weight, before.enc.mlp.layers[1].weight[...]
    )


def test_parity_with_flax_to_nnx():
    # same Linen module, same variables, same rngs at call: same outputs and state
    module, variables = native("linen", "attn")
    x, _ = inputs("attn")
    theirs = nnx.bridge.ToNNX(module, rngs=nnx.Rngs(0)).lazy_init(x)
    nnx.update(theirs, nnx.state(bridge.as_nnx((module, variables))))
    ours = bridge.as_nnx((module, variables))
    for make in (lambda: nnx.Rngs(dropout=3), lambda: jax.random.key(4)):
        a = theirs(x, train=True, rngs=make())
        assert jnp.array_equal(a, ours(x, train=True, rngs=make()))
    assert not jnp.array_equal(a, ours(x, train=True, rngs=jax.random.key(5)))
    assert tree_equal_bits(nnx.state(theirs, nnx.Param), nnx.state(ours, nnx.Param))


def test_a_key_as_the_wrapper_s_rngs_is_nnx_rngs_of_it():
    """`as_nnx(..., rngs=key)`: a typed key (`jax.random.key`) or a raw one
    (`jax.random.PRNGKey`) is the wrapper's `nnx.Rngs(key)`, draw for draw (both
    were refused: 'must be an nnx.Rngs or a JAX key, got PRNGKeyArray'); anything
    else is refused naming what it is."""
    module, variables = native("linen", "attn")
    x, _ = inputs("attn")
    reference = bridge.as_nnx((module, variables), rngs=nnx.Rngs(7))
    expected = [reference(x, train=True) for _ in range(2)]
    assert not jnp.array_equal(*expected)  # the stream advances between calls
    for key in (jax.random.key(7), jax.random.PRNGKey(7)):
        ours = bridge.as_nnx((module, variables), rngs=key)
        for want in expected:
            assert jnp.array_equal(ours(x, train=True), want)
    for bad, kind in [
        (jnp.ones(3), r"an array of float32 and shape \(3,\)"),
        (7, "a int"),
    ]:
        with pytest.raises(
            TypeError,
            match=rf"(?s)`rngs` must be an nnx.Rngs or a JAX key .*got {kind}\.",
        ):
            bridge.as_nnx((module, variables), rngs=bad)


class AllNNX(nnx.Module):
    """`Outer` written in NNX only."""

    def __init__(self, rngs):
        self.enc = nnx.Sequential(
            nnx.Linear(3, 5, rngs=rngs), jax.nn.relu, nnx.Linear(5, 2, rngs=rngs)
        )
        self.head = nnx.Linear(2, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.enc(x))


def test_port_through_the_wrapper():
    model = _outer()
    x, _ = inputs("mlp")
    plan = bridge.port_plan(model, AllNNX(nnx.Rngs(3)))
    assert ".enc.mlp.layers[0]" in str(plan)
    ported = bridge.port(model, AllNNX(nnx.Rngs(3)))
    assert jnp.allclose(ported(x), model(x), atol=1e-6)
    back = bridge.port(
        ported, Outer(bridge.as_nnx(native("equinox", "mlp", seed=4)), nnx.Rngs(5))
    )
    assert jnp.allclose(back(x), model(x), atol=1e-6)
