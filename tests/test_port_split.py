"""One layer on one side is several on the other (`bridge/_port/_split.py`): a fused
`qkv` projection (one Dense `D -> 3D`, its output split into the query, the key and
the value) against three Dense `D -> D`. The fused layer is read as its parts; which
part is which layer the order of use cannot say (the query and the key are side by
side), so the port runs both models on the example inputs and keeps the one
assignment whose outputs agree. It was refused as ambiguous, offering wrong
candidates (`value` with the output projection)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge


D, H, N = 8, 2, 5
X = jax.random.normal(jax.random.key(0), (2, N, D))


def _attend(q, k, v):
    """`q, k, v`: `(..., N, D)`, `H` heads."""
    split = lambda t: t.reshape(*t.shape[:-1], H, D // H)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.sqrt(D // H)
    out = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(scores, -1), v)
    return out.reshape(*out.shape[:-2], D)


class Fused(nnx.Module):  # a ViT's attention as timm writes it: one qkv
    def __init__(self, rngs):
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.proj = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        return self.proj(_attend(q, k, v))


class Separate(eqx.Module):  # transformers' way: three projections
    v_proj: eqx.nn.Linear  # created in another order than used
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.v_proj, self.q_proj, self.k_proj, self.o_proj = (
            eqx.nn.Linear(D, D, key=k) for k in keys
        )

    def __call__(self, x):  # one example (N, D)
        lin = lambda layer: jax.vmap(layer)(x)  # noqa: E731
        return jax.vmap(self.o_proj)(
            _attend(lin(self.q_proj), lin(self.k_proj), lin(self.v_proj))
        )


def test_fused_into_separate_and_back():
    source = Fused(nnx.Rngs(0))
    plan = bridge.port_plan(source, Separate(jax.random.key(1)), example=(X,))
    assert sorted(s.by for s in plan.steps) == ["split"] * 3 + ["trace"], plan
    ported = bridge.port(source, Separate(jax.random.key(1)), example=(X,))
    np.testing.assert_allclose(jax.vmap(ported)(X), source(X), atol=1e-5)
    back = bridge.port(ported, Fused(nnx.Rngs(2)), example=(X,))
    np.testing.assert_allclose(back(X), source(X), atol=1e-5)
    q = source.qkv.kernel[...][:, :D]
    np.testing.assert_array_equal(ported.q_proj.weight, q.T)


def test_without_values_which_part_is_which_is_not_guessed():
    abstract = jax.ShapeDtypeStruct(X.shape, X.dtype)
    with pytest.raises(
        bridge.PortError,
        match=r"split: .* read as parts of a fused layer .*the example inputs hold "
        r"no values",
    ):
        bridge.port(
            Fused(nnx.Rngs(0)), Separate(jax.random.key(1)), example=(abstract,)
        )
