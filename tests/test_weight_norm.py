"""`nnx.WeightNorm` read as the weight-normed layer it is (kinds `WeightNormDense`,
`WeightNormConv`, `WeightNormConvTranspose`), between NNX and Equinox and into plain
layers; every port checked against the frameworks' own forward passes (PyTorch's
in `test_torch_weight_norm.py`)."""

import equinox as eqx
import flax.linen as nn
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


class LinenNormed(nn.Module):
    """A Linen `nn.WeightNorm` around a `Dense`: the `Dense`'s kernel and bias where
    it is (`Dense_0`), its scale in the wrapper's scope
    (`WeightNorm_0/'Dense_0/kernel/scale'`)."""

    features: int = OUT
    feature_axes: int = -1
    variable_filter: tuple = ("kernel",)

    @nn.compact
    def __call__(self, x):
        wrapper = nn.WeightNorm(
            nn.Dense(self.features),
            feature_axes=self.feature_axes,
            variable_filter=set(self.variable_filter),
        )
        return wrapper(x)


def _linen(seed=0, **kwargs):
    module = LinenNormed(**kwargs)
    variables = module.init(jax.random.key(seed), X)
    noise = jax.random.normal(jax.random.key(seed + 1), (OUT,))
    scale = variables["params"]["WeightNorm_0"]["Dense_0/kernel/scale"]
    variables["params"]["WeightNorm_0"]["Dense_0/kernel/scale"] = scale + noise
    return module, variables


def test_linen_weight_norm_into_nnx_and_equinox_and_back():
    """Linen's `nn.WeightNorm(nn.Dense)` is one `WeightNormDense` layer (its scale
    read from the wrapper's scope): into `nnx.WeightNorm` and
    `eqx.nn.WeightNorm` `g`, `v` are carried bit-exact and the outputs are Linen's
    own; and back from NNX into Linen, the scale written where Linen keeps it."""
    module, variables = _linen()
    want = module.apply(variables, X)
    params = variables["params"]
    ported = bridge.port((module, variables), _wrapped(seed=4))
    assert np.array_equal(
        ported.layer_instance.kernel[...], params["Dense_0"]["kernel"]
    )
    scale = params["WeightNorm_0"]["Dense_0/kernel/scale"]
    assert np.array_equal(ported.scales[("kernel",)][...], scale)
    np.testing.assert_allclose(_out(ported, X), want, atol=1e-6)
    layer = eqx.nn.Linear(IN, OUT, key=jax.random.key(4))
    normed = bridge.port((module, variables), eqx.nn.WeightNorm(layer))
    np.testing.assert_allclose(jax.vmap(normed)(X), want, atol=1e-6)
    _, back = bridge.port(_wrapped(seed=8), _linen(seed=6))
    source = _wrapped(seed=8)
    got = back["params"]["WeightNorm_0"]["Dense_0/kernel/scale"]
    assert np.array_equal(got, source.scales[("kernel",)][...])
    np.testing.assert_allclose(module.apply(back, X), _out(source, X), atol=1e-6)


def test_linen_weight_norm_into_a_plain_dense():
    """Into a plain `nnx.Linear`: `kernel = g * v / ||v||`, Linen's outputs."""
    module, variables = _linen()
    plain = bridge.port((module, variables), nnx.Linear(IN, OUT, rngs=nnx.Rngs(5)))
    np.testing.assert_allclose(plain(X), module.apply(variables, X), atol=1e-6)


def test_linen_weight_norm_feature_axes_from_the_forward_pass():
    """A square kernel: the scale's length fits both axes, so its `feature_axes`
    is unknown from the arrays (refused, naming it); the forward pass on example
    inputs shows the axis it is reshaped to (0 here): `nnx.WeightNorm` with the
    same `feature_axes` gets it, and computes Linen's outputs; one with the default
    (per output) has another `scale` shape: refused."""
    x = jax.random.normal(jax.random.key(3), (2, OUT))
    module = LinenNormed(feature_axes=0)
    variables = module.init(jax.random.key(0), x)
    inner = nnx.Linear(OUT, OUT, rngs=nnx.Rngs(0))
    with pytest.raises(bridge.PortError, match="nothing tells which it scales"):
        bridge.port((module, variables), nnx.WeightNorm(inner, rngs=nnx.Rngs(1)))
    target = nnx.WeightNorm(inner, feature_axes=0, rngs=nnx.Rngs(1))
    ported = bridge.port((module, variables), target, example=(x,))
    np.testing.assert_allclose(_out(ported, x), module.apply(variables, x), atol=1e-6)
    with pytest.raises(bridge.PortError, match=r"`scale` is \(5, 1\)"):
        default = nnx.WeightNorm(inner, rngs=nnx.Rngs(1))
        bridge.port((module, variables), default, example=(x,))


def test_a_linen_weight_norm_of_the_bias_too_is_refused():
    """`variable_filter={'kernel', 'bias'}` normalises the bias too: not a `g`, `v`
    weight norm of the kernel; refused, never ported as a plain `Dense`."""
    module = LinenNormed(variable_filter=("kernel", "bias"))
    variables = module.init(jax.random.key(0), X)
    with pytest.raises(bridge.PortError, match=r"normalises its \['bias', 'kernel'\]"):
        bridge.port((module, variables), nnx.Linear(IN, OUT, rngs=nnx.Rngs(0)))


def test_an_nnx_weight_norm_around_another_layer_is_refused():
    """`nnx.WeightNorm(nnx.LinearGeneral)`: no weight-normed kind reads it; refused,
    naming the wrapped class (was a raw KeyError from the scales' tuple keys)."""
    inner = nnx.LinearGeneral(IN, (2, OUT), rngs=nnx.Rngs(0))
    source = nnx.WeightNorm(inner, rngs=nnx.Rngs(1))
    with pytest.raises(bridge.PortError, match="nnx.WeightNorm wrapping LinearGeneral"):
        bridge.port(source, nnx.Linear(IN, 2 * OUT, rngs=nnx.Rngs(2)))
