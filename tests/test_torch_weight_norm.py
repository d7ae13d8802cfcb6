"""Weight-normed layers (`weight = g * v / ||v||`) between PyTorch (its
`parametrizations.weight_norm` and the old `weight_g`/`weight_v` hook), a Flax module
holding `weight_v`/`weight_g` (as transformers' `FlaxConvWithWeightNorm`),
`eqx.nn.WeightNorm`, and plain layers (issue 37). Every port is checked against
PyTorch's own forward pass."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires


torch = pytest.importorskip("torch")
pytestmark = requires("NNX")

weight_norm = torch.nn.utils.parametrizations.weight_norm
IN, OUT, K, L = 4, 6, 3, 9


def _conv(dim, seed=0):
    """A weight-normed `Conv1d(IN, OUT, K, padding=1)`, every array random."""
    torch.manual_seed(seed)
    conv = weight_norm(torch.nn.Conv1d(IN, OUT, K, padding=1), dim=dim)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn_like(p))
    return conv.eval()


def _legacy_linear(seed=0):
    """A `Linear(IN, OUT)` under the old `torch.nn.utils.weight_norm` hook
    (`weight_g`, `weight_v`), every array random."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still written
        linear = torch.nn.utils.weight_norm(torch.nn.Linear(IN, OUT), dim=0)
    with torch.no_grad():
        for p in linear.parameters():
            p.copy_(torch.randn_like(p))
    return linear.eval()


class FlaxConvWithWeightNorm(nnx.Module):
    """transformers' Flax weight-normed conv, in NNX: `weight_v` stored `(out, in,
    k)` (or `(k, in, out)` with `hwio`), `weight_g` with length 1 on the normalised
    axes, the kernel computed on each call; takes `(N, C, L)` as PyTorch does."""

    def __init__(self, g_axes, hwio=False, seed=1):
        keys = jax.random.split(jax.random.key(seed), 3)
        shape = (K, IN, OUT) if hwio else (OUT, IN, K)
        self.hwio = hwio
        self.weight_v = nnx.Param(jax.random.normal(keys[0], shape))
        g_shape = tuple(n if a in g_axes else 1 for a, n in enumerate(shape))
        self.weight_g = nnx.Param(jax.random.normal(keys[1], g_shape))
        self.bias = nnx.Param(jax.random.normal(keys[2], (OUT,)))

    def __call__(self, x):
        v, g = self.weight_v[...], self.weight_g[...]
        axes = tuple(a for a in range(3) if g.shape[a] == 1)
        kernel = v * g / jnp.sqrt(jnp.sum(v * v, axis=axes, keepdims=True))
        spec = ("NCH", "HIO" if self.hwio else "OIH", "NCH")
        y = jax.lax.conv_general_dilated(
            x, kernel, (1,), ((1, 1),), dimension_numbers=spec
        )
        return y + self.bias[...][None, :, None]


def _x(seed=3):
    return np.random.default_rng(seed).normal(size=(2, IN, L)).astype(np.float32)


def _torch_out(module, x):
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 2])
def test_parametrized_conv_into_flax_weight_norm_carries_g_and_v(dim):
    """g and v are carried as they are (no arithmetic: bit-exact), for torch's
    default `dim=0` and Wav2Vec2's `dim=2`; the outputs are torch's."""
    conv, x = _conv(dim), _x()
    target = FlaxConvWithWeightNorm(g_axes=(dim,))
    ported = bridge.port(conv, target, example=(x,))
    g = conv.parametrizations.weight.original0.detach().numpy()
    v = conv.parametrizations.weight.original1.detach().numpy()
    assert np.array_equal(np.asarray(ported.weight_g[...]), g)
    assert np.array_equal(np.asarray(ported.weight_v[...]), v)
    _close(ported(jnp.asarray(x)), _torch_out(conv, x))
    back = bridge.port(ported, _conv(dim, seed=9), example=(x,))
    assert np.array_equal(np.asarray(back["parametrizations.weight.original1"]), v)
    assert np.array_equal(np.asarray(back["parametrizations.weight.original0"]), g)


def test_flax_weight_v_axes_are_read_from_the_forward_pass():
    """A module storing `v` as `(k, in, out)`: the example input's forward pass
    shows the convolution reading it so; without one the `bias` does not fit
    PyTorch's order and the port is refused, naming the layer."""
    conv, x = _conv(0), _x()
    target = FlaxConvWithWeightNorm(g_axes=(2,), hwio=True)
    ported = bridge.port(conv, target, example=(x,))
    v = conv.parametrizations.weight.original1.detach().numpy()
    assert np.array_equal(np.asarray(ported.weight_v[...]), v.transpose(2, 1, 0))
    _close(ported(jnp.asarray(x)), _torch_out(conv, x))
    with pytest.raises(bridge.PortError, match=r"weight-normed `weight_v` \(3, 4, 6\)"):
        bridge.port(conv, FlaxConvWithWeightNorm(g_axes=(2,), hwio=True))


def test_weight_norm_into_plain_conv_computes_the_weight():
    """Into a plain `nnx.Conv` and `eqx.nn.Conv1d`: `weight = g * v / ||v||` over
    the axes torch normalises, the weight torch's forward pass uses."""
    conv, x = _conv(0), _x()
    with torch.no_grad():
        weight = conv.weight.numpy()  # what torch computes from g and v
    expected = _torch_out(conv, x)
    flax_conv = nnx.Conv(IN, OUT, (K,), padding=1, rngs=nnx.Rngs(0))
    ported = bridge.port(conv, flax_conv)
    assert np.allclose(ported.kernel[...], weight.transpose(2, 1, 0), atol=1e-5)
    out = ported(jnp.asarray(x).transpose(0, 2, 1)).transpose(0, 2, 1)
    assert np.allclose(out, expected, atol=1e-5)
    eqx_conv = eqx.nn.Conv1d(IN, OUT, K, padding=1, key=jax.random.key(0))
    ported = bridge.port(conv, eqx_conv)
    assert np.allclose(ported.weight, weight, atol=1e-5)
    assert np.allclose(jax.vmap(ported)(jnp.asarray(x)), expected, atol=1e-5)


def test_plain_conv_into_weight_norm_is_the_standard_decomposition():
    """From a plain layer: `v = w`, `g = ||w||` per output channel (torch's `dim=0`,
    read from the target's `g`); torch's forward pass with them is the plain one's."""
    x = _x()
    eqx_conv = eqx.nn.Conv1d(IN, OUT, K, padding=1, key=jax.random.key(4))
    target = _conv(0, seed=5)
    state = bridge.port(eqx_conv, target)
    target.load_state_dict(state, strict=True)
    _close(_torch_out(target, x), jax.vmap(eqx_conv)(jnp.asarray(x)))
    w = np.asarray(eqx_conv.weight)
    assert np.array_equal(np.asarray(state["parametrizations.weight.original1"]), w)
    norms = np.sqrt((w * w).sum(axis=(1, 2), keepdims=True))
    _close(state["parametrizations.weight.original0"], norms)


def test_legacy_weight_g_weight_v_state_dict_into_equinox_weight_norm():
    """The old hook's state dict (`weight_g`, `weight_v`) into `eqx.nn.WeightNorm`
    around a `Linear` (and back): g and v bit-exact, outputs torch's."""
    linear = _legacy_linear()
    x = np.random.default_rng(6).normal(size=(5, IN)).astype(np.float32)
    state = {k: v.detach().numpy() for k, v in linear.state_dict().items()}
    assert set(state) == {"weight_g", "weight_v", "bias"}
    target = eqx.nn.WeightNorm(eqx.nn.Linear(IN, OUT, key=jax.random.key(7)))
    ported = bridge.port(state, target)
    assert np.array_equal(np.asarray(ported.layer.weight), state["weight_v"])
    assert np.array_equal(np.asarray(ported.g), state["weight_g"])
    _close(jax.vmap(ported)(jnp.asarray(x)), _torch_out(linear, x))
    back = bridge.port(ported, _legacy_linear(seed=8))
    assert all(np.array_equal(np.asarray(back[k]), state[k]) for k in state)


def test_a_norm_axis_other_than_the_modules_is_refused():
    """`g` stored for another axis than the torch module's `dim` (arrays of another
    model): unreadable, never normalised over the wrong axes."""
    wrong = _conv(0, seed=2)
    wrong.parametrizations.weight.original0 = torch.nn.Parameter(torch.ones(1, 1, K))
    with pytest.raises(bridge.PortError, match=r"keeps axis 0 \(the module's `dim`\)"):
        bridge.port(wrong, FlaxConvWithWeightNorm(g_axes=(0,)))


class DenseWithWeightNorm(nnx.Module):
    """A weight-normed dense layer written by hand: `weight_v` stored `(out, in)`
    (PyTorch's order) or `(in, out)` (Flax's), normalised per output."""

    def __init__(self, flax_order, seed=1):
        keys = jax.random.split(jax.random.key(seed), 3)
        self.flax_order = flax_order
        shape = (IN, OUT) if flax_order else (OUT, IN)
        self.weight_v = nnx.Param(jax.random.normal(keys[0], shape))
        g_shape = (1, OUT) if flax_order else (OUT, 1)
        self.weight_g = nnx.Param(jax.random.normal(keys[1], g_shape))
        self.bias = nnx.Param(jax.random.normal(keys[2], (OUT,)))

    def __call__(self, x):
        v, g = self.weight_v[...], self.weight_g[...]
        axis = 0 if self.flax_order else 1
        w = v * g / jnp.sqrt(jnp.sum(v * v, axis=axis, keepdims=True))
        return x @ (w if self.flax_order else w.T) + self.bias[...][None]


@pytest.mark.parametrize("flax_order", [False, True])
def test_parametrized_linear_into_a_dense_weight_norm(flax_order):
    """A weight-normed `nn.Linear` into a hand-written Flax one: `v`'s axes as the
    product reads them (PyTorch's order needs no example; Flax's is refused without
    one, its `bias` not fitting), outputs torch's, `v` and `g` bit-exact."""
    torch.manual_seed(0)
    linear = weight_norm(torch.nn.Linear(IN, OUT), dim=0).eval()
    x = np.random.default_rng(6).normal(size=(5, IN)).astype(np.float32)
    target = DenseWithWeightNorm(flax_order)
    ported = bridge.port(linear, target, example=(x,))
    _close(ported(jnp.asarray(x)), _torch_out(linear, x))
    v = linear.parametrizations.weight.original1.detach().numpy()
    assert np.array_equal(np.asarray(ported.weight_v[...]), v.T if flax_order else v)
    if flax_order:
        with pytest.raises(bridge.PortError, match="does not fit PyTorch's order"):
            bridge.port(linear, DenseWithWeightNorm(flax_order))
    else:
        _close(bridge.port(linear, target)(jnp.asarray(x)), _torch_out(linear, x))


class TransposedWeightNorm(torch.nn.Module):
    """A weight-normed transposed convolution written by hand (no class tells it):
    `weight_v` `(in, out, k)` read by `conv_transpose1d`."""

    def __init__(self):
        super().__init__()
        self.weight_v = torch.nn.Parameter(torch.randn(IN, OUT, K))
        self.weight_g = torch.nn.Parameter(torch.randn(IN, 1, 1))
        self.bias = torch.nn.Parameter(torch.randn(IN))

    def forward(self, x):
        w = torch._weight_norm(self.weight_v, self.weight_g, 0)
        return torch.nn.functional.conv_transpose1d(x, w)


def test_a_weight_norm_the_forward_pass_convolves_transposed_is_refused():
    """Its entries look like a weight-normed convolution's; the traced forward pass
    shows `conv_transpose1d`: refused, never read as a convolution."""
    source = TransposedWeightNorm()
    x = np.random.default_rng(2).normal(size=(2, IN, L)).astype(np.float32)
    target = FlaxConvWithWeightNorm(g_axes=(0,))
    with pytest.raises(bridge.PortError, match="applies transposed"):
        bridge.port(source, target, example=(x,))


def test_parametrized_conv_into_equinox_weight_norm_and_a_dim_that_differs():
    """Into `eqx.nn.WeightNorm(Conv1d)` (its `axis=0` is torch's `dim=0`): g and v
    bit-exact, outputs torch's. A torch `dim=2` norm has another `g` shape: refused
    (`shape`), never normalised over other axes."""
    conv, x = _conv(0), _x()
    layer = eqx.nn.Conv1d(IN, OUT, K, padding=1, key=jax.random.key(0))
    ported = bridge.port(conv, eqx.nn.WeightNorm(layer))
    v = conv.parametrizations.weight.original1.detach().numpy()
    assert np.array_equal(np.asarray(ported.layer.weight), v)
    _close(jax.vmap(ported)(jnp.asarray(x)), _torch_out(conv, x))
    with pytest.raises(bridge.PortError, match=r"scale.*\(3, 1, 1\).*\(1, 1, 6\)"):
        bridge.port(_conv(2), eqx.nn.WeightNorm(layer))


def test_legacy_names_into_a_parametrized_module():
    """An old checkpoint's `weight_g`/`weight_v` into a module made today
    (`parametrizations.weight.original0/1`): same arrays, the target's names,
    `load_state_dict(strict=True)` takes them and computes torch's outputs."""
    legacy = _legacy_linear()
    state = {k: v.detach().numpy() for k, v in legacy.state_dict().items()}
    torch.manual_seed(1)
    target = weight_norm(torch.nn.Linear(IN, OUT), dim=0).eval()
    ported = bridge.port(state, target)
    assert np.array_equal(
        np.asarray(ported["parametrizations.weight.original1"]), state["weight_v"]
    )
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in ported.items()}
    )
    x = np.random.default_rng(6).normal(size=(5, IN)).astype(np.float32)
    _close(_torch_out(target, x), _torch_out(legacy, x))
