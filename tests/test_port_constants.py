"""A constant one side keeps as a loose array and the other computes at build and
keeps out of its state (a PyTorch non-persistent buffer): bonsai's Gemma 3
`embed_tokens.embed_scale` against transformers' `Gemma3TextScaledWordEmbedding`
buffer (tests/test_public_bonsai.py). With the PyTorch module at hand, equal values
mean both compute the same: the port neither refuses nor moves it; a value that
differs, or no module (a bare state dict), still refuses naming the array."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge


torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

IDS = np.array([[1, 4, 2]], np.int32)


class ScaledEmbedding(torch.nn.Embedding):
    """transformers' scaled embedding: `scale` in no state dict."""

    def __init__(self, scale):
        super().__init__(5, 4)
        self.register_buffer("scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.scale


class TorchModel(torch.nn.Module):
    def __init__(self, scale=2.0):
        super().__init__()
        self.embed = ScaledEmbedding(scale)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, ids):
        return self.out(self.embed(ids))


class Embedder(nnx.Module):
    """bonsai's: the table in a layer of its own, the scale a plain array beside it."""

    def __init__(self, rngs):
        self.weight = nnx.Embed(5, 4, rngs=rngs)
        self.scale = nnx.data(jnp.array(2.0))

    def __call__(self, ids):
        return self.weight(ids) * self.scale


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = Embedder(rngs)
        self.out = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, ids):
        return self.out(self.embed(ids))


def _torch_out(model):
    with torch.no_grad():
        return model(torch.from_numpy(IDS).long()).numpy()


def test_torch_to_nnx_keeps_an_equal_constant():
    source = TorchModel()
    ported = bridge.port(source, NnxModel(nnx.Rngs(0)), example=(IDS,))
    np.testing.assert_allclose(ported(IDS), _torch_out(source), atol=1e-6)
    assert float(ported.embed.scale) == 2.0
    plan = bridge.port_plan(source, NnxModel(nnx.Rngs(0)), example=(IDS,))
    assert plan.constants == (".embed.scale",)
    assert not plan.missing and not plan.problems


def test_nnx_to_torch_writes_no_equal_constant():
    source = NnxModel(nnx.Rngs(1))
    target = TorchModel()
    state = bridge.port(source, target, example=(IDS,))
    assert not any("scale" in k for k in state)
    target.load_state_dict(state, strict=True)
    np.testing.assert_allclose(_torch_out(target), source(IDS), atol=1e-6)


def test_a_constant_that_differs_is_refused():
    with pytest.raises(bridge.PortError, match=r"missing: target layer \.embed\.scale"):
        bridge.port(TorchModel(scale=3.0), NnxModel(nnx.Rngs(0)), example=(IDS,))
    with pytest.raises(
        bridge.PortError, match=r"unexpected: source layer \.embed\.scale"
    ):
        bridge.port(NnxModel(nnx.Rngs(0)), TorchModel(scale=3.0), example=(IDS,))


def test_a_state_dict_holds_no_constant():
    state = TorchModel().state_dict()
    with pytest.raises(bridge.PortError, match=r"missing: target layer \.embed\.scale"):
        bridge.port(state, NnxModel(nnx.Rngs(0)))
