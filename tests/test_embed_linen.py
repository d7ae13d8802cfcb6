"""`bridge.as_linen` composes with Linen: init keeps the wrapped weights, apply with
mutable=[...] and rngs=, nn.jit and nn.remat; parity with nnx.bridge.ToLinen."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import bridge

from .embed_models import NNXMLP, inputs, native
from .helpers import requires, tree_equal_bits


class Outer(nn.Module):
    """A Linen model with a wrapped component (given as a field) and its own layer."""

    enc: nn.Module

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(self.enc(x))


@requires("NNX")
def test_init_keeps_the_wrapped_weights_and_from_linen_sees_them():
    nnx_cnn = native("nnx", "cnn")
    model = Outer(bridge.as_linen(nnx_cnn))
    x, _ = inputs("cnn")
    variables = model.init(jax.random.key(5), x)
    ours = variables["params"]["enc"]
    assert tree_equal_bits(ours, nnx.to_pure_dict(nnx.state(nnx_cnn, nnx.Param)))
    assert ours["conv"]["kernel"] is nnx_cnn.conv.kernel[...]
    tree = bridge.from_linen(variables, model)
    assert bridge.roles(tree).enc.bn.mean == "batch_stats"
    spec = bridge.trainable(tree, lambda t: t.Dense_0)  # the wrapped part frozen
    assert not any(jax.tree.leaves(spec.enc))


@requires("NNX")
def test_apply_mutable_writes_batch_stats_and_refuses_without():
    nnx_cnn = native("nnx", "cnn")
    model = Outer(bridge.as_linen(nnx_cnn))
    x, _ = inputs("cnn")
    variables = model.init(jax.random.key(5), x)
    y, updates = model.apply(variables, x, mutable=["batch_stats"])
    nnx_cnn(x)  # the NNX model's own forward updates its statistics
    assert jnp.array_equal(
        updates["batch_stats"]["enc"]["bn"]["mean"], nnx_cnn.bn.mean[...]
    )
    with pytest.raises(
        ValueError,
        match=r"(?s)at enc wrote to collection\(s\) \['batch_stats'\].*mutable=",
    ):
        model.apply(variables, x)
    frozen = Outer(bridge.as_linen(nnx_cnn, inference=True))
    assert frozen.apply(variables, x).shape == y.shape  # eval mode: nothing written


@requires("NNX")
def test_rngs_reach_the_wrapped_model():
    # an Equinox model's key= from make_rng("dropout"); an NNX model's streams reseeded
    for fw in ("equinox", "nnx"):
        layer = bridge.as_linen(native(fw, "attn"))
        x, _ = inputs("attn")
        variables = layer.init(jax.random.key(0), x)
        mutable = [c for c in variables if c != "params"]
        run = lambda k: layer.apply(variables, x, rngs={"dropout": k}, mutable=mutable)  # noqa: E731
        (a, upd), (b, _), (c, _) = (
            run(jax.random.key(1)),
            run(jax.random.key(1)),
            run(jax.random.key(2)),
        )
        assert jnp.array_equal(a, b) and not jnp.array_equal(a, c)
        assert tree_equal_bits(
            upd, {k: variables[k] for k in upd}
        )  # reseeded: not written


def test_nn_jit_and_nn_remat():
    mlp = native("equinox", "mlp")
    x, _ = inputs("mlp")
    plain = bridge.as_linen(mlp)
    variables = plain.init(jax.random.key(0), x)
    want = plain.apply(variables, x)
    for transform in (nn.jit, nn.remat):
        layer = transform(type(plain))(plain.inner, plain.initial)
        got = layer.apply(variables, x)
        assert jnp.allclose(got, want, atol=1e-6)
        grads = jax.grad(lambda v: layer.apply(v, x).sum())(variables)
        assert grads["params"]["mlp"]["layers"][0]["weight"].shape == (5, 3)


@requires("NNX")
def test_parity_with_flax_to_linen():
    # nnx.bridge.ToLinen builds the module from its class; with the same variables
    # both give the same outputs
    x, _ = inputs("mlp")
    theirs = nnx.bridge.ToLinen(NNXMLP, kwargs={}, metadata_fn=None)
    theirs_vars = theirs.init(jax.random.key(0), x)
    module = NNXMLP(nnx.Rngs(1))
    ours = bridge.as_linen(module)
    our_vars = ours.init(jax.random.key(0), x)
    assert jax.tree.structure(theirs_vars) == jax.tree.structure(our_vars)
    assert jnp.array_equal(theirs.apply(our_vars, x), ours.apply(our_vars, x))
    assert jnp.array_equal(ours.apply(our_vars, x), module(x))


@requires("NNX")
def test_port_an_nnx_module_inside_linen():
    # inside Linen, an NNX module's layers have Linen's layout: found by their arrays
    nnx_mlp = NNXMLP(nnx.Rngs(0))
    x, _ = inputs("mlp")
    model = Outer(bridge.as_linen(nnx_mlp))
    variables = model.init(jax.random.key(1), x)

    class AllLinen(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(2)(jax.nn.relu(nn.Dense(5)(x)))
            return nn.Dense(3)(h)

    target = AllLinen()
    source = bridge.from_linen(variables, model)
    _, ported = bridge.port(source, (target, target.init(jax.random.key(2), x)))
    assert jnp.allclose(target.apply(ported, x), model.apply(variables, x), atol=1e-6)


def test_port_needs_the_module_of_a_linen_model_holding_an_equinox_model():
    # inside Linen variables alone, an Equinox model's layers have no class and
    # Equinox layouts: refused, naming them and the fix; with the module, ported
    mlp = native("equinox", "mlp")
    x, _ = inputs("mlp")
    model = Outer(bridge.as_linen(mlp))
    variables = model.init(jax.random.key(1), x)

    class AllLinen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.Dense(2)(jax.nn.relu(nn.Dense(5)(x))))

    target = AllLinen()
    target_vars = target.init(jax.random.key(2), x)
    with pytest.raises(
        bridge.PortError,
        match=r"(?s)unexpected: source layer \.enc\.mlp\.layers\[0\]\.weight \(Array"
        r".*the source's arrays .* are in no layer bridge knows.*"
        r"pass the Linen model as `\(module, variables\)`",
    ):
        bridge.port(variables, (target, target_vars))
    _, ported = bridge.port((model, variables), (target, target_vars))
    assert jnp.allclose(target.apply(ported, x), model.apply(variables, x), atol=1e-6)
