"""A PyTorch vision model takes images channels first, a Flax one channels last: one
example `(N, H, W, C)` traces both, the PyTorch pass on the images moved to `(N, C,
H, W)` where it fails on them as given (`_trace.Trace._channels_first`). It was
refused: "the source's forward pass on the example inputs failed (expected input
... to have 3 channels)". Skipped without torch."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx


torch = pytest.importorskip("torch")

import bridge  # noqa: E402


X = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)


class TorchNet(torch.nn.Module):  # channels first, as torchvision's models are
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.conv(torch.relu(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Conv(3, 8, (3, 3), padding=1, rngs=rngs)
        self.second = nnx.Conv(8, 8, (3, 3), padding=1, rngs=rngs)
        self.out = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.second(nnx.relu(self.first(x))))
        return self.out(jnp.mean(x, axis=(1, 2)))


def test_a_channels_first_torch_model_traced_from_channels_last_images():
    source = TorchNet()
    ported = bridge.port(source, NNXNet(nnx.Rngs(0)), example=(X,))
    with torch.no_grad():
        want = source(torch.from_numpy(X).permute(0, 3, 1, 2)).numpy()
    np.testing.assert_allclose(ported(X), want, atol=1e-5)
    back = TorchNet()
    back.load_state_dict(bridge.port(ported, back, example=(X,)))
    with torch.no_grad():
        got = back(torch.from_numpy(X).permute(0, 3, 1, 2)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
