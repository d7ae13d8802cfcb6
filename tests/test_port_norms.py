"""Norms read by what they compute, on either side (`bridge/_port/_norms.py`, the
JAX reading in `_jaxpr_norms.py`): a norm written by hand is a norm whatever its
class or its arrays' names; `x * (1 + w)` (Gemma's, Griffin's) and `x * w` pair,
the offset moved; a norm read by a codec as another computation than the traced
one is read as what it computes (a Linen class named `RMSNorm` that computes
`x * (1 + scale)` was paired with `nnx.RMSNorm` and ported off by one: silently
wrong); a differing `eps` is a warning naming both values."""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge


X = jax.random.normal(jax.random.key(0), (2, 8))


class RMSNorm(nn.Module):  # Griffin's Linen norm, trimmed: x * (1 + scale)
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.normal(0.5), (x.shape[-1],))
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        scale = jnp.expand_dims(scale, range(x.ndim - 1))
        return x * jax.lax.rsqrt(var + self.eps) * (scale + 1)


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="down")(RMSNorm(name="norm")(nn.Dense(8, name="up")(x)))


class NNXNet(nnx.Module):  # x * scale: nnx.RMSNorm
    def __init__(self, rngs, eps=1e-6):
        self.up = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.RMSNorm(8, epsilon=eps, rngs=rngs)
        self.down = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(self.norm(self.up(x)))


class Offset(eqx.Module):  # written by hand: x * (1 + gain), any name
    gain: jax.Array

    def __call__(self, x):
        var = jnp.mean(x * x, axis=-1, keepdims=True)
        return x / jnp.sqrt(var + 1e-6) * (1.0 + self.gain)


class EqxNet(eqx.Module):
    up: eqx.nn.Linear
    norm: eqx.Module
    down: eqx.nn.Linear

    def __init__(self, norm, key):
        k1, k2 = jax.random.split(key)
        self.up, self.norm = eqx.nn.Linear(8, 8, key=k1), norm
        self.down = eqx.nn.Linear(8, 4, key=k2)

    def __call__(self, x):
        return self.down(self.norm(self.up(x)))


def _linen():
    module = LinenNet()
    return module, module.init(jax.random.key(1), X)


def _randomised(model, seed):
    """Every float array random, so that an unported layer cannot agree."""
    leaves, tree = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [
        jax.random.normal(k, x.shape, x.dtype) * 0.5
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
        else x
        for k, x in zip(keys, leaves)
    ]
    return jax.tree.unflatten(tree, leaves)


def _eqx_out(model):
    return jax.vmap(model)(X)


def test_offset_norm_into_a_plain_one_moves_the_offset():
    """Linen `x * (1 + scale)` into NNX's `nnx.RMSNorm` (`x * scale`) and back:
    the outputs agree (the ported scale is `1 + scale`); it was paired by name and
    copied as is, off by one."""
    module, variables = _linen()
    want = module.apply(variables, X)
    target = NNXNet(nnx.Rngs(2))
    ported = bridge.port((module, variables), target, example=(X,))
    np.testing.assert_allclose(ported(X), want, atol=1e-5)
    scale = variables["params"]["norm"]["scale"]
    np.testing.assert_allclose(ported.norm.scale[...], 1 + scale, rtol=1e-6)
    back = bridge.port(ported, (module, variables), example=(X,))
    np.testing.assert_allclose(module.apply(back[1], X), want, atol=1e-5)


def test_a_norm_written_by_hand_pairs_by_what_it_computes():
    """An Equinox norm whose one array is `gain` (no codec knows it) against the
    Linen one: both compute `x * (1 + w)`, copied as they are (bit-exact)."""
    module, variables = _linen()
    source = _randomised(EqxNet(Offset(jnp.zeros(8)), jax.random.key(3)), 4)
    _, filled = bridge.port(source, (module, variables), example=(X,))
    np.testing.assert_array_equal(filled["params"]["norm"]["scale"], source.norm.gain)
    np.testing.assert_allclose(module.apply(filled, X), _eqx_out(source), atol=1e-5)


def test_a_plain_equinox_norm_into_the_offset_form():
    source = _randomised(
        EqxNet(eqx.nn.RMSNorm(8, eps=1e-6, use_bias=False), jax.random.key(5)), 6
    )
    module, variables = _linen()
    _, filled = bridge.port(source, (module, variables), example=(X,))
    np.testing.assert_allclose(module.apply(filled, X), _eqx_out(source), atol=1e-5)


def test_different_eps_is_a_warning_naming_both():
    module, variables = _linen()
    target = NNXNet(nnx.Rngs(2), eps=1e-5)
    with pytest.warns(
        bridge.PortWarning, match=r"eps is 1e-05 in the source and 1e-06 in the target"
    ):
        bridge.port(target, (module, variables), example=(X,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bridge.port(NNXNet(nnx.Rngs(2)), (module, variables), example=(X,))


def test_no_trace_no_offset():
    """Without example inputs nothing tells whether a norm adds one: the offset is
    not moved by a guess (the two kinds stay apart, as before)."""
    module, variables = _linen()
    plan = bridge.port_plan(NNXNet(nnx.Rngs(2)), (module, variables))
    assert not any("1 + weight" in s.transform for s in plan.steps)
