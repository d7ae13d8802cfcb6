"""Layers read by what the traced computation does with them, whatever their
framework, class or names (issue 54): loose arrays equal up to leading axes of length
one (a cls token `(1, 1, D)` against `(1, D)`), arrays a model computes from its
config stored by the other (rotary inverse frequencies), a stack of Equinox blocks
run under `lax.scan` (its LayerNorms `(L, D)` read per block), and layers the
example's forward pass never runs (left out of pairing by order, said so)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge


D, N, L = 8, 4, 3
X = jax.random.normal(jax.random.key(0), (2, N, D))


class NNXTokens(nnx.Module):  # transformers' layout: (1, 1, D), (1, N + 1, D)
    def __init__(self, rngs):
        self.cls_token = nnx.Param(jax.random.normal(rngs.params(), (1, 1, D)))
        self.position = nnx.Param(jax.random.normal(rngs.params(), (1, N + 1, D)))

    def __call__(self, x):
        cls = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, D))
        return jnp.concatenate([cls, x], axis=1) + self.position[...]


class EqxTokens(eqx.Module):  # equimo's: (1, D), (N + 1, D)
    cls_token: jax.Array
    pos_embed: jax.Array

    def __call__(self, x):  # one example (N, D)
        return jnp.concatenate([self.cls_token, x]) + self.pos_embed


def test_arrays_equal_up_to_leading_ones_are_one_array():
    source = NNXTokens(nnx.Rngs(0))
    target = EqxTokens(jnp.zeros((1, D)), jnp.zeros((N + 1, D)))
    ported = bridge.port(source, target, example=(X,))
    np.testing.assert_array_equal(jax.vmap(ported)(X), source(X))
    back = bridge.port(ported, NNXTokens(nnx.Rngs(1)), example=(X,))
    np.testing.assert_array_equal(back(X), source(X))


class Rotary(nnx.Module):  # stores the inverse frequencies as an array
    def __init__(self, rngs):
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.inv_freq = nnx.Variable(1.0 / 10000 ** (jnp.arange(0, D, 2) / D))

    def __call__(self, x):
        angle = jnp.arange(x.shape[-2])[:, None] * self.inv_freq[...][None]
        return self.proj(x) * jnp.cos(jnp.concatenate([angle, angle], -1))[None]


class EqxRotary(eqx.Module):  # computes them
    proj: eqx.nn.Linear

    def __call__(self, x):
        inv = 1.0 / 10000 ** (jnp.arange(0, D, 2) / D)
        angle = jnp.arange(x.shape[-2])[:, None] * inv[None]
        return jax.vmap(self.proj)(x) * jnp.cos(jnp.concatenate([angle, angle], -1))


def test_stored_inverse_frequencies_are_computed_by_the_other_side():
    """Never a pairing problem: the plan lists them as computed, and the port
    runs with strict=True (a learned array would be unexpected)."""
    source = Rotary(nnx.Rngs(0))
    target = EqxRotary(eqx.nn.Linear(D, D, key=jax.random.key(1)))
    plan = bridge.port_plan(source, target, example=(X,))
    assert plan.computed_by_target == (".inv_freq",), plan
    assert "rotary inverse frequencies (base 10000)" not in " ".join(plan.problems)
    ported = bridge.port(source, target, example=(X,))
    np.testing.assert_allclose(jax.vmap(ported)(X), source(X), atol=1e-6)
    learned = Rotary(nnx.Rngs(0))
    learned.inv_freq[...] = learned.inv_freq[...] * 1.01
    with pytest.raises(bridge.PortError, match=r"unexpected: source layer \.inv_freq"):
        bridge.port(learned, target, example=(X,))


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    linear: eqx.nn.Linear

    def __call__(self, x):  # one sequence (N, D)
        h = jax.vmap(self.norm)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.linear)(x)


class Scanned(eqx.Module):  # esm2quinox's way: filter_vmap to build, scan to run
    blocks: Block

    def __init__(self, key):
        def make(k):
            k1, k2 = jax.random.split(k)
            return Block(
                eqx.nn.LayerNorm(D),
                eqx.nn.MultiheadAttention(2, D, key=k1),
                eqx.nn.Linear(D, D, key=k2),
            )

        self.blocks = eqx.filter_vmap(make)(jax.random.split(key, L))

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, p):
            return eqx.combine(p, static)(h), None

        return jax.lax.scan(step, x, params)[0]


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
        self.mha = nnx.MultiHeadAttention(2, D, use_bias=False, decode=False, rngs=rngs)
        self.fc = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.mha(self.ln(x))
        return x + self.fc(x)


class NNXStack(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([NNXBlock(rngs) for _ in range(L)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _randomised(model, seed):
    leaves, tree = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [
        jax.random.normal(k, x.shape, x.dtype) if eqx.is_inexact_array(x) else x
        for k, x in zip(keys, leaves)
    ]
    return jax.tree.unflatten(tree, leaves)


def test_an_equinox_scan_stack_is_read_per_block():
    """Its LayerNorms `(L, D)` were read as one LayerNorm of that shape (the
    class recognised whatever the shapes) and paired with nothing."""
    x = X
    source = _randomised(Scanned(jax.random.key(0)), 1)
    ported = bridge.port(source, NNXStack(nnx.Rngs(2)), example=(x,))
    want = jax.vmap(source)(x)
    np.testing.assert_allclose(ported(x), want, rtol=1e-5, atol=1e-4)
    back = bridge.port(ported, Scanned(jax.random.key(3)), example=(x,))
    np.testing.assert_allclose(jax.vmap(back)(x), want, rtol=1e-5, atol=1e-4)


class WithHead(nnx.Module):  # a head the forward pass never runs
    def __init__(self, rngs):
        self.body = nnx.Linear(D, D, rngs=rngs)
        self.contact = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return self.body(x)


class Body(eqx.Module):
    layer: eqx.nn.Linear

    def __call__(self, x):
        return self.layer(x)


def test_a_layer_the_forward_pass_never_runs_is_said_so():
    """The head has the body's shapes: paired by order it would have taken the
    body's place; the trace says the pass never reads it."""
    x = X[:, 0]
    source = WithHead(nnx.Rngs(0))
    target = Body(eqx.nn.Linear(D, D, key=jax.random.key(1)))
    with pytest.raises(
        bridge.PortError,
        match=r"unexpected: source layer \.contact .* It is not used by the "
        r"example's forward pass",
    ):
        bridge.port(source, target, example=(x,))
    ported = bridge.port(source, target, example=(x,), strict=False)
    # the body's arrays moved bit for bit; the outputs agree to float32 rounding
    # (a vmapped matrix-vector product against a matrix product)
    np.testing.assert_array_equal(ported.layer.weight, source.body.kernel[...].T)
    np.testing.assert_array_equal(ported.layer.bias, source.body.bias[...])
    np.testing.assert_allclose(jax.vmap(ported)(x), source(x), rtol=1e-5, atol=1e-6)
