"""Hand-written Flax weight-normed *transposed* convolutions (`weight_v`/`weight_g`
used as `v * g / ||v||`, then a transposed convolution) against PyTorch's
`weight_norm(nn.ConvTranspose{1,2}d)`, both directions (issue 37). The forward pass
on the example inputs says which axes of `v` are which and whether the kernel is
reversed; without one the layer is refused. Every port is checked against the
other framework's own forward pass."""

import warnings

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import load_strict, randomized, requires


torch = pytest.importorskip("torch")
pytestmark = requires("NNX")

weight_norm = torch.nn.utils.parametrizations.weight_norm
IN, OUT, K = 4, 6, 3


def _torch(n, seed=0, stride=2, legacy=False):
    """A weight-normed `ConvTranspose{n}d(IN, OUT, K, stride)` (torch's default
    `dim=0`: `g` per input channel), every array random; `legacy`: the old hook's
    `weight_g`/`weight_v`."""
    cls = {1: torch.nn.ConvTranspose1d, 2: torch.nn.ConvTranspose2d}[n]
    layer = cls(IN, OUT, K, stride=stride)
    if not legacy:
        return randomized(weight_norm(layer), seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still written
        return randomized(torch.nn.utils.weight_norm(layer), seed)


def _norm(v, g, axes):
    return v * g / jnp.sqrt(jnp.sum(v * v, axis=axes, keepdims=True))


class TorchOrdered(nnx.Module):
    """A port of `WNConvTranspose{n}d` to NNX: `weight_v` in PyTorch's `(in, out,
    *k)`, `weight_g` `(in, 1, ..)`, applied as PyTorch does (channels first, the
    kernel reversed: `jax.lax.conv_transpose(..., transpose_kernel=True)`)."""

    def __init__(self, n, stride=2, seed=1):
        keys = jax.random.split(jax.random.key(seed), 3)
        self.n, self.stride = n, stride
        self.weight_v = nnx.Param(jax.random.normal(keys[0], (IN, OUT) + (K,) * n))
        self.weight_g = nnx.Param(jax.random.normal(keys[1], (IN,) + (1,) * (n + 1)))
        self.bias = nnx.Param(jax.random.normal(keys[2], (OUT,)))

    def __call__(self, x):
        w = _norm(self.weight_v[...], self.weight_g[...], tuple(range(1, self.n + 2)))
        spatial = "HW"[: self.n]
        y = jax.lax.conv_transpose(
            x,
            w,
            (self.stride,) * self.n,
            ((K - 1, K - 1),) * self.n,
            dimension_numbers=("NC" + spatial, "OI" + spatial, "NC" + spatial),
            transpose_kernel=True,
        )
        return y + self.bias[...].reshape((1, OUT) + (1,) * self.n)


class FlaxOrdered(linen.Module):
    """A Linen weight-normed transposed convolution in Flax's `nn.ConvTranspose`
    layout: `weight_v` `(*k, in, out)`, `weight_g` `(1, .., in, 1)`, over a
    stride-dilated input, the kernel not reversed; channels last inside, taking
    `(N, C, *spatial)` as PyTorch does."""

    n: int

    @linen.compact
    def __call__(self, x):
        shape = (K,) * self.n + (IN, OUT)
        v = self.param("weight_v", jax.nn.initializers.normal(1.0), shape)
        g_shape = (1,) * self.n + (IN, 1)
        g = self.param("weight_g", jax.nn.initializers.normal(1.0), g_shape)
        b = self.param("bias", jax.nn.initializers.normal(1.0), (OUT,))
        axes = tuple(a for a, m in enumerate(g_shape) if m == 1)
        spatial = "HW"[: self.n]
        y = jax.lax.conv_transpose(
            jnp.moveaxis(x, 1, -1),
            _norm(v, g, axes),
            (2,) * self.n,
            "VALID",
            dimension_numbers=(
                "N" + spatial + "C",
                spatial + "IO",
                "N" + spatial + "C",
            ),
        )
        return jnp.moveaxis(y + b.reshape((1,) * (self.n + 1) + (OUT,)), -1, 1)


def _x(n, seed=7):
    shape = (2, IN) + (5,) * n
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _run(module, x):
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stride", [2, 1])
@pytest.mark.parametrize("n", [1, 2])
def test_nnx_torch_ordered_weight_norm_conv_transpose_both_ways(n, stride):
    """torch -> NNX: `g`, `v` carried bit-exact (the same layout), NNX's outputs are
    torch's (stride 1 too: the kernel's reversal alone tells it is transposed).
    NNX -> torch: `load_state_dict(strict=True)` takes the arrays, torch's outputs
    are NNX's."""
    source, x = _torch(n, stride=stride), _x(n)
    ported = bridge.port(source, TorchOrdered(n, stride), example=(x,))
    v = source.parametrizations.weight.original1.detach().numpy()
    g = source.parametrizations.weight.original0.detach().numpy()
    assert np.array_equal(np.asarray(ported.weight_v[...]), v)
    assert np.array_equal(np.asarray(ported.weight_g[...]), g)
    _close(ported(jnp.asarray(x)), _run(source, x))
    flax = TorchOrdered(n, stride, seed=5)
    target = _torch(n, seed=9, stride=stride)
    load_strict(target, bridge.port(flax, target, example=(x,)))
    _close(_run(target, x), flax(jnp.asarray(x)))


@pytest.mark.parametrize("n", [1, 2])
def test_linen_flax_ordered_weight_norm_conv_transpose_and_the_old_hook(n):
    """A Linen module in `nn.ConvTranspose`'s layout (`(*k, in, out)`, unreversed)
    and torch's old `weight_g`/`weight_v` hook: torch -> Linen, Linen's
    outputs are torch's, `v` is torch's reversed and relaid out; Linen -> torch,
    torch's outputs are Linen's."""
    source, x = _torch(n, legacy=True), _x(n)
    module = FlaxOrdered(n)
    variables = module.init(jax.random.key(0), jnp.asarray(x))
    _, ported = bridge.port(source, (module, variables), example=(x,))
    _close(module.apply(ported, jnp.asarray(x)), _run(source, x))
    v = source.weight_v.detach().numpy()
    want_v = np.flip(v, tuple(range(2, n + 2))).transpose(*range(2, n + 2), 0, 1)
    assert np.array_equal(np.asarray(ported["params"]["weight_v"]), want_v)
    target = _torch(n, seed=4, legacy=True)
    state = bridge.port((module, variables), target, example=(x,))
    load_strict(target, state)
    _close(_run(target, x), module.apply(variables, jnp.asarray(x)))


def test_a_weight_normed_conv_transpose_without_a_forward_pass_is_refused():
    """Without example inputs nothing says a `weight_v` is applied transposed (a
    ConvTranspose's weight is not a convolution's): refused, naming the layer and
    the fix (here its `bias` does not fit a convolution's `(out, in, k)` either)."""
    with pytest.raises(bridge.PortError, match=r"Give example inputs"):
        bridge.port(_torch(1), TorchOrdered(1))


class PartlyReversed(TorchOrdered):
    """Reverses one of two kernel axes only: no transposed convolution's layout."""

    def __call__(self, x):
        w = _norm(self.weight_v[...], self.weight_g[...], (1, 2, 3))
        return jax.lax.conv_general_dilated(
            x,
            jnp.flip(w, 2).swapaxes(0, 1),
            (1, 1),
            ((2, 2), (2, 2)),
            lhs_dilation=(2, 2),
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        )


def test_a_weight_norm_reversing_some_kernel_axes_is_refused():
    with pytest.raises(bridge.PortError, match=r"reversing its stored axes \[2\]"):
        bridge.port(_torch(2), PartlyReversed(2), example=(_x(2),))
