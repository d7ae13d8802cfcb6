"""Norms over several axes (issue 37): PyTorch's `nn.LayerNorm((a, b))` /
`nn.RMSNorm((a, b))` (weight `(a, b)`), Equinox's `LayerNorm(shape=(a, b))` and
Linen's `LayerNorm(reduction_axes=(-2, -1), feature_axes=(-2, -1))` compute the same
function and port exactly; a Flax norm normalising over other axes than those it
scales is none of them and is refused, as is a Linen `scale` of several axes whose
`reduction_axes` nothing tells (its variables alone). Outputs compared with each
framework's own forward pass."""

import equinox as eqx
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
A, B = 3, 4
X = np.random.default_rng(0).normal(size=(2, 5, A, B)).astype(np.float32)


def _run(module):
    with torch.no_grad():
        return module(torch.from_numpy(X)).numpy()


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


class Normed(linen.Module):
    """A Linen norm as a model's layer; `rms`: `nn.RMSNorm`."""

    rms: bool = False
    reduction: tuple = (-2, -1)

    @linen.compact
    def __call__(self, x):
        cls = linen.RMSNorm if self.rms else linen.LayerNorm
        norm = cls(epsilon=1e-5, reduction_axes=self.reduction, feature_axes=(-2, -1))
        return norm(x)


def _linen(seed, **kwargs):
    module = Normed(**kwargs)
    variables = module.init(jax.random.key(0), jnp.asarray(X))
    noise = jax.random.split(jax.random.key(seed), 2)
    leaves, tree = jax.tree.flatten(variables)
    leaves = [a + jax.random.normal(k, a.shape) for a, k in zip(leaves, noise)]
    return module, jax.tree.unflatten(tree, leaves)


def _eqx(module):
    return jax.vmap(jax.vmap(module))(jnp.asarray(X))


@pytest.mark.parametrize("rms", [False, True])
def test_a_norm_over_two_axes_torch_linen_and_equinox(rms):
    """torch `nn.LayerNorm((A, B))` (or `nn.RMSNorm`) -> Linen (2-D `scale`, with
    example inputs) and -> `eqx.nn.LayerNorm((A, B))`: the outputs are torch's, the
    arrays carried as they are; Linen -> torch: `load_state_dict(strict=True)`
    takes them, torch's outputs are Linen's."""
    cls = torch.nn.RMSNorm if rms else torch.nn.LayerNorm
    source = randomized(cls((A, B), eps=1e-5), 0)
    module, variables = _linen(1, rms=rms)
    _, ported = bridge.port(source, (module, variables), example=(X,))
    _close(module.apply(ported, jnp.asarray(X)), _run(source))
    held = ported["params"]["RMSNorm_0" if rms else "LayerNorm_0"]
    assert np.array_equal(held["scale"], source.weight.detach().numpy())
    eqx_cls = eqx.nn.RMSNorm if rms else eqx.nn.LayerNorm
    kwargs = {"use_bias": False} if rms else {}
    into = bridge.port(source, eqx_cls((A, B), eps=1e-5, **kwargs))
    _close(_eqx(into), _run(source))
    target = cls((A, B), eps=1e-5)
    load_strict(target, bridge.port((module, variables), target, example=(X,)))
    _close(_run(target), module.apply(variables, jnp.asarray(X)))


def test_a_linen_norm_over_two_axes_and_equinox_both_ways():
    """Linen <-> `eqx.nn.LayerNorm((A, B))` with example inputs whose examples are
    `(A, B)` (Equinox's call takes one): each side's outputs are the other's; a
    Linen norm normalising each row alone (`reduction_axes=-1`) is refused."""
    x = X[0]  # 5 examples of (A, B)
    module, variables = _linen(1)
    into = bridge.port(
        (module, variables), eqx.nn.LayerNorm((A, B), eps=1e-5), example=(x,)
    )
    _close(_eqx(into), module.apply(variables, jnp.asarray(X)))
    _, back = bridge.port(into, (module, _linen(5)[1]), example=(x,))
    _close(module.apply(back, jnp.asarray(X)), _eqx(into))
    rows, row_variables = _linen(1, reduction=(-1,))
    with pytest.raises(bridge.PortError, match=r"normalises over axes \(-1,\)"):
        bridge.port((rows, row_variables), eqx.nn.LayerNorm((A, B)), example=(x,))


def test_a_linen_norm_over_two_axes_without_a_forward_pass_is_refused():
    """Linen variables do not hold `reduction_axes`: a 2-D `scale` is refused
    without example inputs (it may normalise over one axis only), naming the fix."""
    module, variables = _linen(1)
    with pytest.raises(bridge.PortError, match=r"LayerNorm_0 is a Linen LayerNorm"):
        bridge.port((module, variables), eqx.nn.LayerNorm((A, B), eps=1e-5))
    with pytest.raises(bridge.PortError, match=r"Give example inputs"):
        bridge.port(randomized(torch.nn.LayerNorm((A, B)), 0), (module, variables))


def test_a_linen_norm_scaling_two_axes_over_one_is_refused():
    """`reduction_axes=-1` with a 2-D `scale`: each row normalised on its own, which
    no PyTorch norm of shape `(A, B)` computes: refused with example inputs (its
    module tells), where by shape it would pair."""
    module, variables = _linen(1, reduction=(-1,))
    target = torch.nn.LayerNorm((A, B))
    with pytest.raises(bridge.PortError, match=r"normalises over axes \(-1,\)"):
        bridge.port((module, variables), target, example=(X,))


def test_an_nnx_norm_over_more_axes_than_it_scales_is_refused():
    """`nnx.LayerNorm(B, reduction_axes=(-2, -1))` normalises over two axes and
    scales the last: not torch's `nn.LayerNorm(B)` though the shapes agree (ported
    before, with other outputs); `nnx.LayerNorm(B)` (its defaults) still ports."""
    source = randomized(torch.nn.LayerNorm(B, eps=1e-5), 0)
    wide = nnx.LayerNorm(B, epsilon=1e-5, reduction_axes=(-2, -1), rngs=nnx.Rngs(0))
    with pytest.raises(bridge.PortError, match=r"normalises over axes \(-2, -1\)"):
        bridge.port(source, wide)
    plain = bridge.port(source, nnx.LayerNorm(B, epsilon=1e-5, rngs=nnx.Rngs(0)))
    _close(plain(jnp.asarray(X)), _run(source))
