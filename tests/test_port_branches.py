"""Layers used side by side (one input, neither computed from the other) pair by what
their outputs flow into, never by the order each forward pass happens to compute them;
where that does not tell them apart, the port is refused (issue 37)."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires
from .test_port_silent import _GatedSource as _GatedNNX  # gate computed first


class _GatedLinen(nn.Module):
    """The same computation, other names, the linear branch computed first and on
    the left of the product."""

    @nn.compact
    def __call__(self, x):
        lin = nn.Dense(8, use_bias=False, name="fc_lin")(x)
        act = nn.Dense(8, use_bias=False, name="fc_act")(x)
        return nn.Dense(4, use_bias=False, name="fc_out")(lin * jax.nn.silu(act))


class _GatedEqx(eqx.Module):
    """The same computation in Equinox (one example a call), the linear branch
    first, silu written out."""

    w_a: eqx.nn.Linear
    w_b: eqx.nn.Linear
    w_c: eqx.nn.Linear

    def __init__(self, key):
        a, b, c = jax.random.split(key, 3)
        self.w_a = eqx.nn.Linear(4, 8, use_bias=False, key=a)
        self.w_b = eqx.nn.Linear(4, 8, use_bias=False, key=b)
        self.w_c = eqx.nn.Linear(8, 4, use_bias=False, key=c)

    def __call__(self, x):
        lin = self.w_a(x)
        act = self.w_b(x)
        return self.w_c(lin * (act * jax.nn.sigmoid(act)))


def _linen(module, x):
    return module, module.init(jax.random.key(3), x)


def _run(model, x):
    if isinstance(model, tuple):
        return model[0].apply(model[1], x)
    if isinstance(model, eqx.Module):
        return jax.vmap(model)(x)
    return model(x)


@requires("NNX")
def test_gated_mlp_nnx_linen_both_ways():
    """gate/up into a rewrite that names them otherwise and computes the linear
    branch first: the silu decides, exact both ways."""
    x = jax.random.normal(jax.random.key(2), (2, 4))
    source = _GatedNNX(nnx.Rngs(0))
    target = _linen(_GatedLinen(), x)
    plan = bridge.port_plan(source, target, example=(x,))
    assert {(r.source, r.target) for r in plan.steps} >= {
        (".gate", ".fc_act"),
        (".up", ".fc_lin"),
    }
    ported = bridge.port(source, target, example=(x,))
    np.testing.assert_allclose(_run(ported, x), source(x), atol=1e-6)
    back = bridge.port(ported, _GatedNNX(nnx.Rngs(5)), example=(x,))
    np.testing.assert_allclose(back(x), source(x), atol=1e-6)


@requires("NNX")
def test_gated_mlp_nnx_equinox_both_ways():
    x = jax.random.normal(jax.random.key(2), (2, 4))
    source = _GatedNNX(nnx.Rngs(0))
    target = _GatedEqx(jax.random.key(1))
    ported = bridge.port(source, target, example=(x,))
    assert ported.w_b.weight.shape == (8, 4)
    np.testing.assert_allclose(_run(ported, x), source(x), atol=1e-6)
    np.testing.assert_array_equal(ported.w_b.weight, source.gate.kernel[...].T)
    back = bridge.port(ported, _GatedNNX(nnx.Rngs(5)), example=(x,))
    np.testing.assert_allclose(back(x), source(x), atol=1e-6)


class _Two(nnx.Module):
    """Two same-shape layers, named `names`, and what the call does with them."""

    def __init__(self, names, call, rngs):
        self.names, self.call = names, call
        for name in names:
            setattr(self, name, nnx.Linear(4, 8, use_bias=False, rngs=rngs))

    def __call__(self, x):
        return self.call(*(getattr(self, n) for n in self.names), x)


@requires("NNX")
def test_side_by_side_alike_with_unrelated_names_is_refused():
    x = jax.random.normal(jax.random.key(2), (2, 4))
    alike = lambda a, b, x: jnp.tanh(a(x)) * jnp.tanh(b(x))  # noqa: E731
    source = _Two(("left", "right"), alike, nnx.Rngs(0))
    target = _Two(("beta", "alpha"), alike, nnx.Rngs(1))
    with pytest.raises(bridge.PortError, match="side by side") as refused:
        bridge.port(source, target, example=(x,))
    message = str(refused.value)
    for name in (".left", ".right", ".alpha", ".beta"):
        assert name in message
    assert "tanh, then mul" in message
    assert "rules=" in message
    # the rule it asks for decides
    ported = bridge.port(
        source, target, example=(x,), rules={r"\.left": ".beta", r"\.right": ".alpha"}
    )
    np.testing.assert_allclose(ported(x), source(x), atol=1e-6)


def _second_first(a, b, x):
    """Two heads returned as `(a(x), b(x))`, `b` computed first."""
    second = b(x)
    return a(x), second


@requires("NNX")
def test_heads_side_by_side_pair_by_the_output_they_are():
    """Two heads on one input, returned apart: the output's place tells them."""
    x = jax.random.normal(jax.random.key(2), (2, 4))
    source = _Two(("sentiment", "topic"), lambda a, b, x: (a(x), b(x)), nnx.Rngs(0))
    target = _Two(("zeta", "eta"), _second_first, nnx.Rngs(1))
    ported = bridge.port(source, target, example=(x,))
    for got, want in zip(ported(x), source(x)):
        np.testing.assert_allclose(got, want, atol=1e-6)


def _attention(q, k, v, heads, *, k_first=False, scale_query=False):
    """Multi-head attention on `(batch, seq, heads * dim)` projections."""
    b, s, d = q.shape
    q, k, v = (t.reshape(b, s, heads, d // heads) for t in (q, k, v))
    scale = (d // heads) ** -0.5
    if scale_query:
        q = q * scale
    if k_first:  # the same scores, the operands the other way round
        scores = jnp.einsum("bkhd,bqhd->bhqk", k, q)
    else:
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if not scale_query:
        scores = scores * scale
    weights = jax.nn.softmax(scores, axis=-1)
    if k_first:
        out = jnp.einsum("bkhd,bhqk->bqhd", v, weights)
    else:
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.reshape(b, s, d)


class _AttentionNNX(nnx.Module):
    """Llama/BERT style: q, k, v, o projections with biases, computed q, k, v."""

    def __init__(self, rngs):
        self.q_proj = nnx.Linear(8, 8, rngs=rngs)
        self.k_proj = nnx.Linear(8, 8, rngs=rngs)
        self.v_proj = nnx.Linear(8, 8, rngs=rngs)
        self.o_proj = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(_attention(q, k, v, 2))


class _AttentionLinen(nn.Module):
    """Unrelated names, the value computed first and the query last, the query
    scaled before the scores, and the einsums written the other way round."""

    @nn.compact
    def __call__(self, x):
        v = nn.Dense(8, name="p1")(x)
        k = nn.Dense(8, name="p2")(x)
        q = nn.Dense(8, name="p3")(x)
        out = _attention(q, k, v, 2, k_first=True, scale_query=True)
        return nn.Dense(8, name="p0")(out)


@requires("NNX")
def test_attention_projections_with_unrelated_names_are_exact():
    x = jax.random.normal(jax.random.key(2), (2, 3, 8))
    source = _AttentionNNX(nnx.Rngs(0))
    target = _linen(_AttentionLinen(), x)
    plan = bridge.port_plan(source, target, example=(x,))
    assert {(r.source, r.target) for r in plan.steps} == {
        (".q_proj", ".p3"),
        (".k_proj", ".p2"),
        (".v_proj", ".p1"),
        (".o_proj", ".p0"),
    }
    ported = bridge.port(source, target, example=(x,))
    np.testing.assert_allclose(_run(ported, x), source(x), atol=1e-5)
    back = bridge.port(ported, _AttentionNNX(nnx.Rngs(4)), example=(x,))
    np.testing.assert_allclose(back(x), source(x), atol=1e-5)


class _AttentionEqx(eqx.Module):
    """Equinox's own `MultiheadAttention` (query scaled first, heads vmapped)."""

    attention: eqx.nn.MultiheadAttention

    def __init__(self, key):
        self.attention = eqx.nn.MultiheadAttention(2, 8, key=key)

    def __call__(self, x):
        return self.attention(x, x, x)


class _AttentionRenamed(nnx.Module):
    """Equinox's attention rewritten in NNX with other names: the value and key
    computed first."""

    def __init__(self, rngs):
        self.a = nnx.Linear(8, 8, use_bias=False, rngs=rngs)
        self.b = nnx.Linear(8, 8, use_bias=False, rngs=rngs)
        self.c = nnx.Linear(8, 8, use_bias=False, rngs=rngs)
        self.d = nnx.Linear(8, 8, use_bias=False, rngs=rngs)

    def __call__(self, x):
        v, k, q = self.c(x), self.b(x), self.a(x)
        return self.d(_attention(q, k, v, 2, scale_query=True))


@requires("NNX")
def test_equinox_attention_into_renamed_projections_is_exact():
    x = jax.random.normal(jax.random.key(2), (2, 3, 8))
    source = _AttentionEqx(jax.random.key(0))
    target = _AttentionRenamed(nnx.Rngs(1))
    ported = bridge.port(source, target, example=(x,))
    np.testing.assert_allclose(ported(x), _run(source, x), atol=1e-5)
    back = bridge.port(ported, _AttentionEqx(jax.random.key(7)), example=(x,))
    np.testing.assert_allclose(_run(back, x), _run(source, x), atol=1e-5)


class _NormedNNX(_AttentionNNX):
    """Qwen3 style: a norm on the query's and on the key's heads."""

    def __init__(self, rngs):
        super().__init__(rngs)
        self.q_norm = nnx.RMSNorm(4, rngs=rngs)
        self.k_norm = nnx.RMSNorm(4, rngs=rngs)
        self.q_norm.scale[...] = jnp.arange(1.0, 5.0)  # the two norms differ
        self.k_norm.scale[...] = jnp.arange(4.0, 0.0, -1.0)

    def __call__(self, x):
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, s, 2, 4)).reshape(b, s, 8)
        k = self.k_norm(self.k_proj(x).reshape(b, s, 2, 4)).reshape(b, s, 8)
        return self.o_proj(_attention(q + 1.0, k, self.v_proj(x), 2))


class _NormedLinen(nn.Module):
    """The same computation, other names, the key and its norm computed first."""

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        k = nn.Dense(8, name="p2")(x).reshape(b, s, 2, 4)
        k = nn.RMSNorm(name="n2")(k).reshape(b, s, 8)
        q = nn.Dense(8, name="p1")(x).reshape(b, s, 2, 4)
        q = nn.RMSNorm(name="n1")(q).reshape(b, s, 8)
        v = nn.Dense(8, name="p3")(x)
        return nn.Dense(8, name="p0")(_attention(q + 1.0, k, v, 2, k_first=True))


@requires("NNX")
def test_norms_after_side_by_side_layers_pair_by_what_they_are_computed_from():
    """The query's and the key's norms are used in either order too: each pairs
    with the norm of its projection's partner (was 1.6 off, no error)."""
    x = jax.random.normal(jax.random.key(2), (2, 3, 8))
    source = _NormedNNX(nnx.Rngs(0))
    target = _linen(_NormedLinen(), x)
    plan = bridge.port_plan(source, target, example=(x,))
    rows = {(r.source, r.target) for r in plan.steps}
    assert {(".q_norm", ".n1"), (".k_norm", ".n2"), (".q_proj", ".p1")} <= rows
    ported = bridge.port(source, target, example=(x,))
    np.testing.assert_allclose(_run(ported, x), source(x), atol=1e-5)


@requires("NNX")
@pytest.mark.parametrize(
    "call, why",
    [
        (  # another computation after each: no signature of the one fits the other
            lambda a, b, x: jnp.sin(b(x)) * jnp.exp(a(x)),
            r"differs between the two forward passes \(source \[\.a: tanh",
        ),
        (  # the target reads them from two inputs (one computed by a layer:
            # `x * 2.0` would be one input, computed from `x` with no weight)
            lambda a, b, x: jnp.tanh(b(x)) * a(b(x)[:, :4]),
            r"Only the source reads them from one input",
        ),
    ],
)
def test_side_by_side_that_the_computation_cannot_pair_is_refused(call, why):
    x = jax.random.normal(jax.random.key(2), (2, 4))
    source = _Two(("a", "b"), lambda a, b, x: jnp.tanh(a(x)) * b(x), nnx.Rngs(0))
    target = _Two(("c", "d"), call, nnx.Rngs(1))
    with pytest.raises(bridge.PortError, match=why) as refused:
        bridge.port(source, target, example=(x,))
    message = str(refused.value)
    for name in (".a", ".b", ".c", ".d"):
        assert name in message
