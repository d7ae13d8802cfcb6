"""Weight-normed layers (`weight = g * v / ||v||`) between PyTorch (its
`parametrizations.weight_norm` and the old `weight_g`/`weight_v` hook), a Flax module
holding `weight_v`/`weight_g` (as transformers' `FlaxConvWithWeightNorm`),
`eqx.nn.WeightNorm`, and plain layers (issue 37). Every port is checked against
PyTorch's own forward pass."""

import warnings

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import randomized, requires


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


# --- nnx.WeightNorm, and weight-normed ConvTranspose ---------------------------------


def _nnx_out(module, x):
    """`module(x)` on a copy: `nnx.WeightNorm`'s call writes the normalised kernel
    into `layer_instance.kernel`."""
    return np.asarray(nnx.clone(module)(jnp.asarray(x)))


def _scale(module):
    return np.asarray(module.scales[("kernel",)][...])


def _set_scale(module, value):
    """`nnx.WeightNorm`'s scale set: an array (flax 0.12.8) or an `nnx.Param`
    (flax >= 0.12.9) keeps its type."""
    if isinstance(module.scales[("kernel",)], nnx.Variable):
        module.scales[("kernel",)][...] = value
    else:
        module.scales[("kernel",)] = value


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_parametrized_layer_into_nnx_weight_norm_and_back(layer):
    """A weight-normed `nn.Linear`/`nn.Conv1d` (torch's default `dim=0`, per output)
    into `nnx.WeightNorm` (its default `feature_axes=-1`, per output): `v` is the
    wrapped layer's kernel, `g` its `scales`, both bit-exact; the outputs are
    torch's; and back into a new torch module, bit-exact again."""
    if layer == "linear":
        source = randomized(weight_norm(torch.nn.Linear(IN, OUT)), 0)
        inner = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
        x, nwc = np.random.default_rng(1).normal(size=(5, IN)).astype(np.float32), 0
    else:
        source = _conv(0)
        inner = nnx.Conv(IN, OUT, (K,), padding=1, rngs=nnx.Rngs(0))
        x, nwc = _x(), 1
    target = nnx.WeightNorm(inner, rngs=nnx.Rngs(1))
    ported = bridge.port(source, target)
    v = source.parametrizations.weight.original1.detach().numpy()
    g = source.parametrizations.weight.original0.detach().numpy()
    kernel = v.T if layer == "linear" else v.transpose(2, 1, 0)
    assert np.array_equal(np.asarray(ported.layer_instance.kernel[...]), kernel)
    assert np.array_equal(_scale(ported), g.reshape(-1))
    flax_x = x.transpose(0, 2, 1) if nwc else x
    out = _nnx_out(ported, flax_x)
    _close(out.transpose(0, 2, 1) if nwc else out, _torch_out(source, x))
    fresh = weight_norm(torch.nn.Linear(IN, OUT) if layer == "linear" else _conv(0, 9))
    back = bridge.port(ported, fresh)
    assert np.array_equal(np.asarray(back["parametrizations.weight.original1"]), v)
    assert np.array_equal(np.asarray(back["parametrizations.weight.original0"]), g)


def test_nnx_weight_norm_into_a_plain_linear_and_from_one():
    """Into a plain `nn.Linear`: `weight = g * v / ||v||`, torch's outputs are
    `nnx.WeightNorm`'s own. From one: `v = w`, `g = ||w||` (the documented
    re-parametrisation), `nnx.WeightNorm`'s outputs are torch's."""
    x = np.random.default_rng(2).normal(size=(5, IN)).astype(np.float32)
    source = nnx.WeightNorm(nnx.Linear(IN, OUT, rngs=nnx.Rngs(3)), rngs=nnx.Rngs(4))
    _set_scale(source, jax.random.normal(jax.random.key(5), (OUT,)))
    linear = torch.nn.Linear(IN, OUT).eval()
    state = bridge.port(source, linear)
    linear.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}
    )
    _close(_torch_out(linear, x), _nnx_out(source, x))
    plain = randomized(torch.nn.Linear(IN, OUT), 6)
    target = nnx.WeightNorm(nnx.Linear(IN, OUT, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    ported = bridge.port(plain, target)
    w = plain.weight.detach().numpy()
    assert np.array_equal(np.asarray(ported.layer_instance.kernel[...]), w.T)
    _close(_scale(ported), np.linalg.norm(w, axis=1))
    _close(_nnx_out(ported, x), _torch_out(plain, x))


def test_nnx_weight_norm_feature_axes_other_than_torchs_dim_is_refused():
    """`nnx.WeightNorm(feature_axes=0)` normalises a Linear's kernel per input, torch's
    `dim=0` per output: another function, refused by `scale`'s shape."""
    source = randomized(weight_norm(torch.nn.Linear(IN, OUT)), 0)
    inner = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    target = nnx.WeightNorm(inner, feature_axes=0, rngs=nnx.Rngs(1))
    with pytest.raises(bridge.PortError, match=r"`scale` is \(1, 6\).*\(4, 1\)"):
        bridge.port(source, target)


def _conv_transpose(n, seed=0):
    """A weight-normed `ConvTranspose{n}d(IN, OUT, K, stride=2)` under torch's
    default `dim=0`, every array random."""
    cls = {1: torch.nn.ConvTranspose1d, 2: torch.nn.ConvTranspose2d}[n]
    return randomized(weight_norm(cls(IN, OUT, K, stride=2)), seed)


def _flax_transpose(n, seed):
    """`nnx.ConvTranspose` computing what the torch one does (stride 2, "VALID":
    torch's `padding=0`)."""
    return nnx.ConvTranspose(
        IN, OUT, (K,) * n, strides=2, padding="VALID", rngs=nnx.Rngs(seed)
    )


def _images(n, seed=7):
    shape = (2, IN) + (5,) * n
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _nhwc(x):
    return np.moveaxis(x, 1, -1)


@pytest.mark.parametrize("n", [1, 2])
def test_weight_normed_conv_transpose_norms_per_input_channel(n):
    """torch's own behaviour, asserted: `weight_norm`'s default `dim=0` on a
    `ConvTranspose`, whose weight is `(in, out, *k)`, keeps `g` per input channel."""
    source = _conv_transpose(n)
    g = source.parametrizations.weight.original0
    assert tuple(g.shape) == (IN,) + (1,) * (n + 1)
    v = source.parametrizations.weight.original1.detach()
    norms = v.reshape(IN, -1).norm(dim=1).reshape(g.shape)
    with torch.no_grad():
        assert torch.allclose(source.weight, g * v / norms)


@pytest.mark.parametrize("n", [1, 2])
def test_weight_normed_conv_transpose_into_flax_and_equinox(n):
    """A weight-normed `ConvTranspose{1,2}d` into plain `nnx.ConvTranspose` and
    `eqx.nn.ConvTranspose` (weight = `g * v / ||v||`, flipped), into
    `nnx.WeightNorm(feature_axes=-2)` and `eqx.nn.WeightNorm(axis=1)` (g per input
    channel, as torch's: `g`, `v` carried, bit-exact up to the layout): every output
    is torch's (Equinox's weight is `(out, in, *k)`, applied unflipped). Its default
    `axis=0` norms per output: refused."""
    source, x = _conv_transpose(n), _images(n)
    want = _torch_out(source, x)
    flax = _flax_transpose(n, 0)
    _close(np.moveaxis(_nnx_out(bridge.port(source, flax), _nhwc(x)), -1, 1), want)
    wrapped = nnx.WeightNorm(flax, feature_axes=-2, rngs=nnx.Rngs(1))
    ported = bridge.port(source, wrapped)
    _close(np.moveaxis(_nnx_out(ported, _nhwc(x)), -1, 1), want)
    g = source.parametrizations.weight.original0.detach().numpy()
    assert np.array_equal(_scale(ported), g.reshape(-1))
    layer = eqx.nn.ConvTranspose(n, IN, OUT, K, stride=2, key=jax.random.key(2))
    _close(jax.vmap(bridge.port(source, layer))(jnp.asarray(x)), want)
    normed = bridge.port(source, eqx.nn.WeightNorm(layer, axis=1))
    v = source.parametrizations.weight.original1.detach().numpy()
    flipped = np.flip(np.swapaxes(v, 0, 1), tuple(range(2, n + 2)))  # unflipped
    assert np.array_equal(np.asarray(normed.layer.weight), flipped)
    _close(jax.vmap(normed)(jnp.asarray(x)), want)
    with pytest.raises(bridge.PortError, match="WeightNormConvTranspose"):
        bridge.port(source, eqx.nn.WeightNorm(layer))


@pytest.mark.parametrize("n", [1, 2])
def test_flax_and_equinox_conv_transpose_into_a_weight_normed_one(n):
    """Back: `nnx.WeightNorm(ConvTranspose)` into a weight-normed torch
    `ConvTranspose{1,2}d` (g, v bit-exact), and a plain `eqx.nn.ConvTranspose` into
    one (`v = w`, `g = ||w||` per input channel): `load_state_dict(strict=True)`
    takes them, and torch's outputs are the source's."""
    x = _images(n)
    inner = _flax_transpose(n, 3)
    source = nnx.WeightNorm(inner, feature_axes=-2, rngs=nnx.Rngs(4))
    _set_scale(source, jax.random.normal(jax.random.key(5), (IN,)))
    target = _conv_transpose(n, seed=8)
    state = bridge.port(source, target)
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=True
    )
    want = np.moveaxis(_nnx_out(source, _nhwc(x)), -1, 1)
    _close(_torch_out(target, x), want)
    assert np.array_equal(
        np.asarray(state["parametrizations.weight.original0"]).reshape(-1),
        _scale(source),
    )
    layer = eqx.nn.ConvTranspose(n, IN, OUT, K, stride=2, key=jax.random.key(9))
    state = bridge.port(layer, target)
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=True
    )
    _close(_torch_out(target, x), jax.vmap(layer)(jnp.asarray(x)))


class LinenWeightNormed(linen.Module):
    """Linen's `nn.WeightNorm` around an `nn.Dense` or an `nn.Conv` taking `(N, C,
    L)` as PyTorch does: the layer's kernel and bias where it is, its scale in the
    wrapper's scope."""

    conv: bool

    @linen.compact
    def __call__(self, x):
        if not self.conv:
            return linen.WeightNorm(linen.Dense(OUT))(x)
        layer = linen.Conv(OUT, (K,), padding=1)
        return linen.WeightNorm(layer)(x.transpose(0, 2, 1)).transpose(0, 2, 1)


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_linen_weight_norm_and_a_parametrized_torch_layer_both_ways(layer):
    """Linen `nn.WeightNorm(nn.Dense / nn.Conv)` (default `feature_axes=-1`, per
    output) and torch's `weight_norm` (`dim=0`): torch -> Linen carries `g` and
    `v` bit-exact, Linen's outputs are torch's; Linen -> torch,
    `load_state_dict(strict=True)` takes them and torch's outputs are Linen's."""
    conv = layer == "conv"
    source = _conv(0) if conv else randomized(weight_norm(torch.nn.Linear(IN, OUT)), 0)
    x = _x() if conv else np.random.default_rng(1).normal(size=(5, IN))
    x = x.astype(np.float32)
    module = LinenWeightNormed(conv)
    variables = module.init(jax.random.key(0), jnp.asarray(x))
    _, ported = bridge.port(source, (module, variables))
    _close(module.apply(ported, jnp.asarray(x)), _torch_out(source, x))
    g = source.parametrizations.weight.original0.detach().numpy()
    held = ported["params"]["WeightNorm_0"]
    scale = held["Conv_0/kernel/scale" if conv else "Dense_0/kernel/scale"]
    assert np.array_equal(np.asarray(scale), g.reshape(-1))
    noisy = jax.tree.map(lambda a: a + 0.5, variables)  # the scale away from ones
    target = _conv(0, seed=4) if conv else weight_norm(torch.nn.Linear(IN, OUT))
    state = bridge.port((module, noisy), target)
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=True
    )
    _close(_torch_out(target, x), module.apply(noisy, jnp.asarray(x)))


def test_an_equinox_weight_norm_file_into_torch(tmp_path):
    """`eqx.nn.WeightNorm(ConvTranspose1d, axis=1)` saved by `bridge.save`, loaded
    into a weight-normed torch `ConvTranspose1d`: the file's recorded classes say
    which layer it wraps (read back without the model's code); torch's outputs are
    Equinox's."""
    layer = eqx.nn.ConvTranspose1d(IN, OUT, K, stride=2, key=jax.random.key(1))
    source = eqx.nn.WeightNorm(layer, axis=1)
    path = tmp_path / "normed.safetensors"
    bridge.save(path, source)
    target = _conv_transpose(1, seed=3)
    state = bridge.load(path, like=target)
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=True
    )
    x = _images(1)
    got, want = _torch_out(target, x), jax.vmap(source)(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # g and v carried as stored (no arithmetic): torch's g per input channel
    g = {k: v for k, v in state.items() if k.endswith(("weight_g", "original0"))}
    assert len(g) == 1
    assert np.array_equal(
        np.asarray(next(iter(g.values()))).reshape(-1), np.asarray(source.g).reshape(-1)
    )


def test_a_weight_normed_conv_transpose_state_dict_is_read_by_its_bias():
    """No class (a state dict): `v` `(4, 6, 3)` with a `bias` of 6, its second axis
    and not its first, is a `ConvTranspose`: into `nnx.ConvTranspose`, torch's
    outputs. A square one (`(4, 4, 3)`) could be either: never read as a
    `ConvTranspose` from its arrays alone (refused against one)."""
    source, x = _conv_transpose(1), _images(1)
    state = {k: v.detach().numpy() for k, v in source.state_dict().items()}
    ported = bridge.port(state, _flax_transpose(1, 0))
    got = np.moveaxis(_nnx_out(ported, _nhwc(x)), -1, 1)
    _close(got, _torch_out(source, x))
    square = randomized(weight_norm(torch.nn.ConvTranspose1d(IN, IN, K)), 1)
    state = {k: v.detach().numpy() for k, v in square.state_dict().items()}
    target = nnx.ConvTranspose(IN, IN, (K,), padding="VALID", rngs=nnx.Rngs(0))
    with pytest.raises(bridge.PortError, match="has no source layer"):
        bridge.port(state, target)


def _zero_rows(w, rows):
    """`w` with the output rows `rows` (first axis) set to zero."""
    return w.at[jnp.asarray(rows)].set(0.0)


@pytest.mark.parametrize("api", ["parametrizations", "legacy"])
@pytest.mark.parametrize("dim", [0, None])
def test_a_plain_layer_with_zero_rows_into_a_weight_norm_computes_zero(api, dim):
    """A plain `Linear` whose output rows 1 and 4 are all zero (a pruned unit), or
    whose whole weight is zero, into a weight-normed torch `Linear`: `||w|| = 0`
    there, and `v = w` would make torch compute `0 * 0 / 0` = NaN. Torch's own
    forward after `load_state_dict` computes the plain layer's output, zeros where
    it has them, no NaN; `v = w` where the norm is not zero."""
    source = eqx.nn.Linear(IN, OUT, key=jax.random.key(2))
    rows = [1, 4] if dim == 0 else list(range(OUT))
    source = eqx.tree_at(lambda m: m.weight, source, _zero_rows(source.weight, rows))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old hook is deprecated
        wrap = weight_norm if api == "parametrizations" else torch.nn.utils.weight_norm
        target = wrap(torch.nn.Linear(IN, OUT), dim=dim).eval()
    state = bridge.port(source, target)
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}
    )
    x = np.random.default_rng(6).normal(size=(5, IN)).astype(np.float32)
    out = _torch_out(target, x)
    assert np.isfinite(out).all()
    _close(out, jax.vmap(source)(jnp.asarray(x)))
    v = "parametrizations.weight.original1" if api == "parametrizations" else "weight_v"
    kept = [r for r in range(OUT) if r not in rows]
    w = np.asarray(source.weight)
    assert np.array_equal(np.asarray(state[v])[kept], w[kept])


def test_a_plain_conv_with_a_zero_channel_into_a_weight_norm_computes_zero():
    """The same for a `Conv1d`'s all-zero output channel (torch's `dim=0`)."""
    x = _x()
    source = eqx.nn.Conv1d(IN, OUT, K, padding=1, key=jax.random.key(4))
    source = eqx.tree_at(lambda m: m.weight, source, _zero_rows(source.weight, [2]))
    target = _conv(0, seed=5)
    state = bridge.port(source, target)
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}
    )
    out = _torch_out(target, x)
    assert np.isfinite(out).all()
    _close(out, jax.vmap(source)(jnp.asarray(x)))


def _g_like_v_file(path, g_shape):
    """A file holding `fc.weight_v` (3, 4) (PyTorch's `(out, in)`), `fc.bias` and
    a `fc.weight_g` of `g_shape`."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    save_file(
        {
            "fc.weight_g": rng.normal(size=g_shape).astype(np.float32),
            "fc.weight_v": rng.normal(size=(3, 4)).astype(np.float32),
            "fc.bias": np.zeros(3, np.float32),
        },
        path,
    )
    return path


class _Fc(nnx.Module):
    def __init__(self):
        self.fc = nnx.Linear(4, 3, rngs=nnx.Rngs(0))


def test_a_g_shaped_like_v_is_refused_naming_the_arrays(tmp_path):
    """`fc.weight_g` shaped like `fc.weight_v` (3, 4): no `dim` of torch's weight
    norm gives that `g` (it keeps one axis, `(3, 1)` for `dim=0`, or none). Into a
    plain `Linear(4, 3)` (torch's, NNX's) it is refused, naming both arrays, their
    shapes and the fix; it loaded silently (`g * v / |v|` element by element).
    A `(3, 1)` `g` loads and computes `g * v / ||v||` as torch does."""
    bad = _g_like_v_file(str(tmp_path / "bad.safetensors"), (3, 4))
    torch_fc = torch.nn.Sequential()
    torch_fc.add_module("fc", torch.nn.Linear(4, 3))
    message = (
        r"`weight_g` has shape \(3, 4\) for `weight_v` \(3, 4\): no axis of "
        r"PyTorch's weight norm explains it.*Save `g` as torch's weight_norm"
    )
    for like in (torch_fc, _Fc()):
        with pytest.raises(bridge.PortError, match=message):
            bridge.load(bad, like=like)
    good = _g_like_v_file(str(tmp_path / "good.safetensors"), (3, 1))
    from safetensors.numpy import load_file

    arrays = load_file(good)
    legacy = _legacy_linear_of(arrays)
    x = np.random.default_rng(6).normal(size=(5, 4)).astype(np.float32)
    loaded = bridge.load(good, like=torch_fc)
    torch_fc.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in loaded.items()}
    )
    _close(_torch_out(torch_fc, x), _torch_out(legacy, x))


def _legacy_linear_of(arrays):
    """A `Linear(4, 3)` under the old hook holding `arrays` (`fc.` entries)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        linear = torch.nn.utils.weight_norm(torch.nn.Linear(4, 3), dim=0)
    linear.load_state_dict(
        {k[3:]: torch.as_tensor(v) for k, v in arrays.items()}, strict=True
    )
    return linear.eval()
