"""PyTorch norms written by hand read by what they compute (`bridge/_port/_norms.py`
with the recorder's norm tags): a `scale` computing `x * (1 + scale)` (Griffin's
torch `RMSNorm`), a gated norm's `weight` (`x * silu(gate)` first: Mamba2's), and
`nn.RMSNorm` (`x * weight`) against a JAX norm computing `x * (1 + scale)`: each
was a loose array against a norm ("missing" and "unexpected"), or paired and copied
off by one. Outputs compared with PyTorch's forward. Skipped without torch."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx


torch = pytest.importorskip("torch")

import bridge  # noqa: E402


X = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)


class TorchOffset(torch.nn.Module):  # recurrentgemma's torch RMSNorm, trimmed
    def __init__(self, width):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(width) * 0.5)

    def forward(self, x):
        var = torch.mean(torch.square(x), axis=-1, keepdims=True)
        return x * torch.rsqrt(var + 1e-6) * (self.scale + 1)


class TorchGated(torch.nn.Module):  # transformers' MambaRMSNormGated, trimmed
    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width) * 0.5 + 1)

    def forward(self, x, gate):
        x = x * torch.nn.functional.silu(gate)
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + 1e-6))


class TorchNet(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.up, self.norm, self.down = (
            torch.nn.Linear(8, 8),
            norm,
            torch.nn.Linear(8, 4),
        )

    def forward(self, x):
        h = self.up(x)
        if isinstance(self.norm, TorchGated):
            return self.down(self.norm(h, h))
        return self.down(self.norm(h))


class LinenOffset(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)[None]


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="up")(x)
        return nn.Dense(4, name="down")(LinenOffset(name="norm")(h))


class NNXGated(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.RMSNorm(8, epsilon=1e-6, rngs=rngs)
        self.down = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        h = self.up(x)
        return self.down(self.norm(h * nnx.silu(h)))


def _torch_out(model):
    with torch.no_grad():
        return model(torch.from_numpy(X)).numpy()


@pytest.mark.parametrize("norm", [TorchOffset, torch.nn.RMSNorm])
def test_torch_norm_and_linen_offset_norm_both_ways(norm):
    source = TorchNet(norm(8) if norm is TorchOffset else norm(8, eps=1e-6))
    if norm is torch.nn.RMSNorm:
        torch.nn.init.normal_(source.norm.weight, 1.0, 0.5)
    module = LinenNet()
    variables = module.init(jax.random.key(0), X)
    _, filled = bridge.port(source, (module, variables), example=(X,))
    np.testing.assert_allclose(module.apply(filled, X), _torch_out(source), atol=1e-5)
    target = TorchNet(norm(8) if norm is TorchOffset else norm(8, eps=1e-6))
    target.load_state_dict(bridge.port((module, filled), target, example=(X,)))
    np.testing.assert_allclose(_torch_out(target), _torch_out(source), atol=1e-5)


def test_gated_norm_weight_is_a_norm():
    source = TorchNet(TorchGated(8))
    ported = bridge.port(source, NNXGated(nnx.Rngs(0)), example=(X,))
    np.testing.assert_allclose(ported(X), _torch_out(source), atol=1e-5)
    back = TorchNet(TorchGated(8))
    back.load_state_dict(bridge.port(ported, back, example=(X,)))
    np.testing.assert_allclose(_torch_out(back), _torch_out(source), atol=1e-5)
