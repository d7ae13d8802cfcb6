"""Per-head kernels (`nnx.LinearGeneral(D, (H, hd))`, Linen `DenseGeneral`) pair
with fused ones (`nnx.Linear(D, H * hd)`, Equinox `Linear`): the kernel reshaped to
`(prod(in axes), prod(out axes))` computes the same product. Outputs compared."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import bridge

from .helpers import requires


pytestmark = requires("NNX")
D, H, HD = 8, 2, 4
X = jax.random.normal(jax.random.key(5), (2, 3, D))


def _attend(q, k, v):
    """`q, k, v`: `(B, T, H, hd)`."""
    w = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", w, v)


class PerHead(nnx.Module):
    def __init__(self, rngs):
        def split():
            return nnx.LinearGeneral(D, (H, HD), use_bias=False, rngs=rngs)

        self.q_proj, self.k_proj, self.v_proj = split(), split(), split()
        self.o_proj = nnx.LinearGeneral(
            (H, HD), D, axis=(-2, -1), use_bias=False, rngs=rngs
        )

    def __call__(self, x):
        return self.o_proj(_attend(self.q_proj(x), self.k_proj(x), self.v_proj(x)))


class Fused(nnx.Module):
    def __init__(self, rngs):
        fused = lambda: nnx.Linear(D, H * HD, use_bias=False, rngs=rngs)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = fused(), fused(), fused()
        self.o_proj = nnx.Linear(H * HD, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        heads = lambda y: y.reshape(b, t, H, HD)  # noqa: E731
        out = _attend(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.o_proj(out.reshape(b, t, H * HD))


class EqxFused(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.q_proj, self.k_proj, self.v_proj = (
            eqx.nn.Linear(D, H * HD, use_bias=False, key=k[i]) for i in range(3)
        )
        self.o_proj = eqx.nn.Linear(H * HD, D, use_bias=False, key=k[3])

    def __call__(self, x):
        """`x`: one example `(T, D)`."""
        t = x.shape[0]
        heads = lambda f: jax.vmap(f)(x).reshape(1, t, H, HD)  # noqa: E731
        out = _attend(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj))
        return jax.vmap(self.o_proj)(out.reshape(t, H * HD))


class LinenPerHead(nn.Module):
    """MaxText's query, key and value: `DenseGeneral` kernels `(D, H, hd)`, no bias
    (the output projection as a Dense of the fused heads)."""

    @nn.compact
    def __call__(self, x):
        def split(name):
            return nn.DenseGeneral((H, HD), use_bias=False, name=name)

        q, k, v = split("q_proj")(x), split("k_proj")(x), split("v_proj")(x)
        out = _attend(q, k, v)
        fused = out.reshape(*out.shape[:-2], H * HD)
        return nn.Dense(D, use_bias=False, name="o_proj")(fused)


def test_per_head_nnx_into_fused_nnx_and_equinox_and_back():
    source = PerHead(nnx.Rngs(0))
    for target in (Fused(nnx.Rngs(1)), EqxFused(jax.random.key(1))):
        ported = bridge.port(source, target, check=X)
        assert bridge.compare(source, ported, X) < 1e-5
        back = bridge.port(ported, PerHead(nnx.Rngs(2)), check=X)
        assert bridge.compare(source, back, X) < 1e-5


def test_linen_dense_general_without_bias_into_fused_nnx():
    """Without a module or a bias, a Linen kernel `(D, H, hd)` has Flax's default
    one input axis."""
    module = LinenPerHead()
    source = (module, module.init(jax.random.key(0), X))
    ported = bridge.port(source, Fused(nnx.Rngs(1)), check=X)
    assert bridge.compare(source, ported, X) < 1e-5


class EinsumQuery(nn.Module):
    """An Einsum kernel `(H, D, hd)` (heads first, Gemma's einsum order): its input
    axis is 1, not the first."""

    @nn.compact
    def __call__(self, x):
        y = nn.Einsum((H2, H2, HD), "btd,ndh->btnh", use_bias=False)(x)
        return y.reshape(*y.shape[:2], H2 * HD)


H2 = 4  # heads = features: the per-head reading's shapes fit the fused kernel's


class FusedQuery(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(H2, H2 * HD, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.q_proj(x)


def test_a_per_head_kernel_whose_trace_contracts_another_axis_is_refused():
    """The trace says which kernel axes meet the input: axis 1 here, so reading
    the kernel with its first axis as the input (a reshape to `(H, D * hd)`, shapes
    that fit) would port a wrong model; with example inputs it is refused."""
    x = jax.random.normal(jax.random.key(0), (2, 3, H2))
    module = EinsumQuery()
    source = (module, module.init(jax.random.key(1), x))
    with pytest.raises(bridge.PortError, match=r"layout: \.Einsum_0 .* axes \(1,\)"):
        bridge.port(source, FusedQuery(nnx.Rngs(0)), example=x)
