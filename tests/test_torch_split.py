"""A PyTorch fused projection against a JAX model's separate ones, both ways
(`bridge/_port/_split.py`): timm's ViT attention (`qkv`, `(3D, D)`, split with
`unbind` after a reshape) into three NNX Linears, and back, outputs compared with
PyTorch's forward (the torch adapter now runs a module for inference: `bridge.compare`
takes one too). Skipped without torch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx


torch = pytest.importorskip("torch")

import bridge  # noqa: E402


D, H, N = 8, 2, 5
X = np.random.default_rng(0).normal(size=(2, N, D)).astype(np.float32)


class TimmAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, H, D // H).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1) / (D // H) ** 0.5).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, D))


class Separate(nnx.Module):
    def __init__(self, rngs):
        self.k = nnx.Linear(D, D, rngs=rngs)
        self.q = nnx.Linear(D, D, rngs=rngs)
        self.v = nnx.Linear(D, D, rngs=rngs)
        self.out = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        heads = lambda t: t.reshape(*t.shape[:-1], H, D // H)  # noqa: E731
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // H)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return self.out(out.reshape(*out.shape[:-2], D))


def _torch_out(model):
    with torch.no_grad():
        return model(torch.from_numpy(X)).numpy()


def test_timm_qkv_into_separate_projections_and_back():
    source = TimmAttention()
    ported = bridge.port(source, Separate(nnx.Rngs(0)), example=(X,))
    np.testing.assert_allclose(ported(X), _torch_out(source), atol=1e-5)
    assert bridge.compare(source, ported, X) < 1e-5
    target = TimmAttention()
    target.load_state_dict(bridge.port(ported, target, example=(X,)))
    np.testing.assert_allclose(_torch_out(target), _torch_out(source), atol=1e-5)
