"""`nnx.WeightNorm` read as the weight-normed layer it is (kinds `WeightNormDense`,
`WeightNormConv`, `WeightNormConvTranspose`), between NNX and Equinox and into plain
layers; every port checked against the frameworks' own forward passes (PyTorch's
in `test_torch_weight_norm.py`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires


pytestmark = requires("NNX")
IN, OUT = 3, 5


def _wrapped(seed=0, **kwargs):
    """`nnx.WeightNorm` around an `nnx.Linear`, its scale random."""
    inner = nnx.Linear(IN, OUT, rngs=nnx.Rngs(seed))
    module = nnx.WeightNorm(inner, rngs=nnx.Rngs(seed + 1), **kwargs)
    if module.scales:
        scale = jax.random.normal(jax.random.key(seed + 2), (OUT,))
        if isinstance(module.scales[("kernel",)], nnx.Variable):  # flax >= 0.12.9
            module.scales[("kernel",)][...] = scale
        else:
            module.scales[("kernel",)] = scale
    return module


def _out(module, x):
    """`module(x)` on a copy: `nnx.WeightNorm`'s call writes the normalised kernel
    into `layer_instance.kernel`."""
    return np.asarray(nnx.clone(module)(x))


X = jax.random.normal(jax.random.key(9), (4, IN))


def test_nnx_weight_norm_into_equinox_weight_norm_and_back():
    """`g` and `v` carried as they are (Equinox stores `v` `(out, in)` and `g`
    `(out, 1)`), both ways bit-exact, and the outputs are each framework's own."""
    source = _wrapped()
    layer = eqx.nn.Linear(IN, OUT, key=jax.random.key(4))
    plan = bridge.port_plan(source, eqx.nn.WeightNorm(layer))
    assert [s.kind for s in plan.steps] == ["WeightNormDense"]
    ported = bridge.port(source, eqx.nn.WeightNorm(layer))
    v = np.asarray(source.layer_instance.kernel[...])
    g = np.asarray(source.scales[("kernel",)][...])
    assert np.array_equal(np.asarray(ported.layer.weight), v.T)
    assert np.array_equal(np.asarray(ported.g), g[:, None])
    np.testing.assert_allclose(jax.vmap(ported)(X), _out(source, X), atol=1e-6)
    back = bridge.port(ported, _wrapped(seed=7))
    assert np.array_equal(np.asarray(back.layer_instance.kernel[...]), v)
    assert np.array_equal(np.asarray(back.scales[("kernel",)][...]), g)


def test_nnx_weight_norm_into_a_plain_layer_and_from_one():
    """Into a plain `nnx.Linear`: `kernel = g * v / ||v||`, the outputs
    `nnx.WeightNorm`'s. From a plain `eqx.nn.Linear`: `v = w`, `g = ||w||` per output
    (the documented re-parametrisation), the outputs the plain layer's."""
    source = _wrapped()
    plain = bridge.port(source, nnx.Linear(IN, OUT, rngs=nnx.Rngs(5)))
    np.testing.assert_allclose(plain(X), _out(source, X), atol=1e-6)
    layer = eqx.nn.Linear(IN, OUT, key=jax.random.key(6))
    ported = bridge.port(layer, _wrapped(seed=3))
    w = np.asarray(layer.weight)
    assert np.array_equal(np.asarray(ported.layer_instance.kernel[...]), w.T)
    np.testing.assert_allclose(
        ported.scales[("kernel",)][...], np.linalg.norm(w, axis=1), rtol=1e-6
    )
    np.testing.assert_allclose(_out(ported, X), jax.vmap(layer)(X), atol=1e-6)


def test_nnx_weight_norm_of_a_conv_transpose_into_equinox():
    """`nnx.WeightNorm(nnx.ConvTranspose)` (kind `WeightNormConvTranspose`) into
    `eqx.nn.WeightNorm(eqx.nn.ConvTranspose1d)`: norms per output on both sides,
    the outputs are each framework's own."""
    inner = nnx.ConvTranspose(IN, OUT, (3,), padding="VALID", rngs=nnx.Rngs(0))
    source = nnx.WeightNorm(inner, rngs=nnx.Rngs(1))
    layer = eqx.nn.ConvTranspose1d(IN, OUT, 3, key=jax.random.key(2))
    ported = bridge.port(source, eqx.nn.WeightNorm(layer))
    x = jax.random.normal(jax.random.key(3), (2, 7, IN))
    want = np.moveaxis(_out(source, x), -1, 1)
    np.testing.assert_allclose(
        jax.vmap(ported)(jnp.moveaxis(x, -1, 1)), want, atol=1e-5
    )
    with pytest.raises(bridge.PortError, match="no source layer"):  # not a Conv
        bridge.port(
            source, eqx.nn.WeightNorm(eqx.nn.Conv1d(IN, OUT, 3, key=jax.random.key(2)))
        )


@pytest.mark.parametrize(
    "kwargs", [dict(use_scale=False), dict(variable_filter=nnx.PathContains(""))]
)
def test_an_nnx_weight_norm_that_is_no_g_v_pair_is_refused(kwargs):
    """Without `scales` (`use_scale=False`), or normalising the bias too (a filter
    matching every array), `nnx.WeightNorm` is not a `g`, `v` weight norm: refused,
    naming what it holds; never read as a plain layer it would normalise."""
    source = _wrapped(**kwargs)
    target = eqx.nn.WeightNorm(eqx.nn.Linear(IN, OUT, key=jax.random.key(4)))
    with pytest.raises(bridge.PortError, match="only a weight norm of the wrapped"):
        bridge.port(source, target)
    with pytest.raises(bridge.PortError, match="only a weight norm of the wrapped"):
        bridge.port(nnx.Linear(IN, OUT, rngs=nnx.Rngs(0)), source)
