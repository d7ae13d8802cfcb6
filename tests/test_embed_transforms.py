"""Wrappers under the frameworks' vectorising transforms: `nnx.vmap` / `nnx.scan`
over `as_nnx` wrappers (an ensemble, a stack of layers) and `jax.vmap` /
`eqx.filter_vmap` / `lax.scan` over `as_equinox` wrappers, each against the same
computation on native models."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires


N = 3  # ensemble members / stacked layers
X = jax.random.normal(jax.random.key(0), (4, 3))
KEYS = jax.random.split(jax.random.key(1), N)


class EquinoxEncoder(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, x):
        return jax.vmap(self.mlp)(x)


def equinox_encoder(key):
    return EquinoxEncoder(eqx.nn.MLP(3, 2, 5, depth=1, key=key))


def linen_encoder(key):
    module = nn.Dense(2)
    return module, module.init(key, X)


def each(model, x=X):
    """`model(x)` for every member of an ensemble made with `eqx.filter_vmap`."""
    call = eqx.filter_vmap(lambda m, x: m(x), in_axes=(eqx.if_array(0), None))
    return call(model, x)


@requires("NNX")
@pytest.mark.parametrize("make", [equinox_encoder, linen_encoder])
def test_nnx_vmap_ensemble_of_wrappers(make):
    # an ensemble built with nnx.vmap, called and differentiated with nnx.vmap
    ensemble = nnx.vmap(lambda k: bridge.as_nnx(make(k)))(KEYS)
    call = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))
    got = call(ensemble, X)
    if make is equinox_encoder:
        native = eqx.filter_vmap(make)(KEYS)
        want = each(native)
        grads = eqx.filter_grad(lambda m: each(m).sum())(native)
        want_grad = grads.mlp.layers[0].weight
    else:
        module, variables = nn.Dense(2), jax.vmap(lambda k: make(k)[1])(KEYS)
        apply = jax.vmap(module.apply, in_axes=(0, None))
        want = apply(variables, X)
        grads = jax.grad(lambda v: apply(v, X).sum())(variables)
        want_grad = grads["params"]["kernel"]
    assert got.shape == (N, 4, 2)
    np.testing.assert_array_equal(got, want)
    grad = nnx.jit(nnx.grad(lambda m: call(m, X).sum()))(ensemble)
    first = grad["mlp"]["layers"][0]["weight"] if "mlp" in grad else grad["kernel"]
    np.testing.assert_allclose(first[...], want_grad, rtol=1e-6, atol=1e-6)


class BatchNormEncoder(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __call__(self, x, state):
        h = jax.vmap(self.linear)(x)
        norm = jax.vmap(
            self.norm, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )
        return norm(h, state)


def batch_norm_encoder(key):
    linear = eqx.nn.Linear(3, 2, key=key)
    return eqx.nn.make_with_state(BatchNormEncoder)(
        linear, eqx.nn.BatchNorm(2, "batch", mode="batch")
    )


@requires("NNX", "eqx.nn.BatchNorm(mode=...)")
def test_nnx_vmap_ensemble_writes_each_members_state():
    ensemble = nnx.vmap(lambda k: bridge.as_nnx(batch_norm_encoder(k)))(KEYS)
    got = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(ensemble, X)
    models, states = eqx.filter_vmap(batch_norm_encoder)(KEYS)
    call = eqx.filter_vmap(
        lambda m, s, x: m(x, s), in_axes=(eqx.if_array(0), eqx.if_array(0), None)
    )
    want, new_states = call(models, states, X)
    np.testing.assert_array_equal(got, want)
    ours = by_path(bridge.from_nnx(ensemble))
    theirs = by_path(bridge.from_equinox(models, new_states))
    assert ours.keys() == theirs.keys()
    for path in ours:  # the batch statistics each member wrote
        np.testing.assert_array_equal(ours[path], theirs[path], err_msg=path)
    before = by_path(bridge.from_equinox(*eqx.filter_vmap(batch_norm_encoder)(KEYS)))
    assert not all(jnp.array_equal(before[p], theirs[p]) for p in theirs)


def by_path(tree):
    return {
        jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


@requires("NNX")
def test_nnx_scan_over_a_stack_of_wrapped_layers():
    make = lambda k: eqx.nn.Linear(3, 3, key=k)  # noqa: E731
    stack = nnx.vmap(lambda k: bridge.as_nnx(make(k)))(KEYS)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def forward(layer, h):
        return jnp.tanh(jax.vmap(layer)(h))

    params, static = eqx.partition(eqx.filter_vmap(make)(KEYS), eqx.is_array)

    def native(h, p):
        return jnp.tanh(jax.vmap(eqx.combine(p, static))(h)), None

    np.testing.assert_allclose(
        forward(stack, X), jax.lax.scan(native, X, params)[0], rtol=1e-6, atol=1e-6
    )


class Noisy(eqx.Module):
    dropout: eqx.nn.Dropout

    def __call__(self, x, key=None):
        return self.dropout(x, key=key)


class NNXNoisy(nnx.Module):
    def __init__(self, rngs):
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(x)


@requires("NNX")
def test_nnx_vmap_ensemble_with_random_streams():
    # each member forks its streams from the split ones, as nnx.Dropout does: the
    # same masks as an ensemble of native NNX dropout layers
    @nnx.split_rngs(splits=N)
    @nnx.vmap
    def make(rngs):
        return bridge.as_nnx(Noisy(eqx.nn.Dropout(0.5)), rngs=rngs.fork())

    @nnx.split_rngs(splits=N)
    @nnx.vmap
    def make_native(rngs):
        return NNXNoisy(rngs)

    ones = jnp.ones((4, 3))
    call = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))
    got = call(make(nnx.Rngs(dropout=3)), ones)
    np.testing.assert_array_equal(got, call(make_native(nnx.Rngs(dropout=3)), ones))
    assert not jnp.array_equal(got[0], got[1])


class NNXEncoder(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(3, 5, rngs=rngs)
        self.second = nnx.Linear(5, 2, rngs=rngs)

    def __call__(self, x):
        return self.second(jax.nn.relu(self.first(x)))


@requires("NNX")
def test_vmap_over_equinox_wrappers():
    ensemble = eqx.filter_vmap(lambda k: bridge.as_equinox(NNXEncoder(nnx.Rngs(k))))(
        KEYS
    )
    native = nnx.vmap(lambda k: NNXEncoder(nnx.Rngs(k)))(KEYS)
    want = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(native, X)
    np.testing.assert_array_equal(each(ensemble), want)
    # the wrapper's leaves are all arrays: plain jax.vmap maps over it too
    got = jax.vmap(lambda m, x: m(x), in_axes=(0, None))(ensemble, X)
    np.testing.assert_array_equal(got, want)


@requires("NNX")
def test_lax_scan_over_a_stack_of_equinox_wrappers():
    make = lambda k: nnx.Linear(3, 3, rngs=nnx.Rngs(k))  # noqa: E731
    params, static = eqx.partition(
        eqx.filter_vmap(lambda k: bridge.as_equinox(make(k)))(KEYS), eqx.is_array
    )

    def forward(h, p):
        return jnp.tanh(eqx.combine(p, static)(h)), None

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def native(layer, h):
        return jnp.tanh(layer(h))

    np.testing.assert_allclose(
        jax.lax.scan(forward, X, params)[0],
        native(nnx.vmap(make)(KEYS), X),
        rtol=1e-6,
        atol=1e-6,
    )


class NNXBatchNorm(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)
        self.norm = nnx.BatchNorm(2, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


@requires("NNX")
def test_filter_vmap_over_stateful_equinox_wrappers():
    # the Equinox ensemble idiom: models and states made with filter_vmap
    def make(key):
        return eqx.nn.make_with_state(bridge.as_equinox)(NNXBatchNorm(nnx.Rngs(key)))

    models, states = eqx.filter_vmap(make)(KEYS)
    call = eqx.filter_vmap(
        lambda m, s, x: m(x, s), in_axes=(eqx.if_array(0), eqx.if_array(0), None)
    )
    got, new_states = call(models, states, X)
    native = nnx.vmap(lambda k: NNXBatchNorm(nnx.Rngs(k)))(KEYS)
    want = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(native, X)
    np.testing.assert_array_equal(got, want)
    after = bridge.from_equinox(models, new_states)
    np.testing.assert_array_equal(after.model.norm.mean, native.norm.mean[...])
