"""The layer kinds of recurrent and state-space blocks (issue 54, item 7), read by
what the forward pass does with them, whatever they are called: a causal depthwise
1-D convolution (`groups` = channels), learnable per-channel vectors used
elementwise (a gate, a decay rate), a block-diagonal product (`einsum('...hi,hij->
...hj')`, weights `(heads, in, out)`) and its per-head bias. The two models declare
their vectors in opposite orders and name nothing alike: pairing by order or name
would swap the gate and the decay. Oracle: PyTorch's forward, and
`load_state_dict(strict=True)` of what the port writes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge


torch = pytest.importorskip("torch")

C, K, T, H, IN, OUT = 8, 4, 6, 2, 4, 3


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # causal: padded both sides, the last K - 1 outputs cut
        self.conv = torch.nn.Conv1d(C, C, K, groups=C, padding=K - 1)
        self.gate = torch.nn.Parameter(torch.randn(C))
        self.decay = torch.nn.Parameter(torch.randn(C))
        self.block = torch.nn.Parameter(torch.randn(H, IN, OUT))
        self.block_bias = torch.nn.Parameter(torch.randn(H, OUT))

    def forward(self, x):  # (B, T, C) -> (B, T, H * OUT)
        y = self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2)
        decay = torch.exp(-torch.nn.functional.softplus(self.decay))
        y = y * torch.sigmoid(self.gate) + x * decay
        y = y.reshape(*y.shape[:-1], H, IN)
        y = torch.einsum("...hi,hij->...hj", y, self.block) + self.block_bias
        return y.flatten(-2)


class JaxBlock(nnx.Module):
    def __init__(self, rngs):
        # causal: padded on the left only
        self.conv1d = nnx.Conv(
            C, C, (K,), feature_group_count=C, padding=((K - 1, 0),), rngs=rngs
        )

        def normal(*shape):
            return nnx.Param(jax.random.normal(rngs.params(), shape))

        self.a_param = normal(C)  # the decay, declared first here
        self.input_gate = normal(C)
        self.w = normal(H, IN, OUT)
        self.b = normal(H, OUT)

    def __call__(self, x):
        y = self.conv1d(x)
        decay = jnp.exp(-jax.nn.softplus(self.a_param[...]))
        y = y * jax.nn.sigmoid(self.input_gate[...]) + x * decay
        y = y.reshape(*y.shape[:-1], H, IN)
        y = jnp.einsum("...hi,hij->...hj", y, self.w[...]) + self.b[...]
        return y.reshape(*y.shape[:-2], H * OUT)


X = np.random.default_rng(0).standard_normal((2, T, C)).astype("float32")


@pytest.fixture(autouse=True)
def _broadcasting():
    # the vectors broadcast against (B, T, C), as such code writes them
    with jax.numpy_rank_promotion("allow"):
        yield


def _torch_out(module):
    with torch.no_grad():
        return module(torch.from_numpy(X)).numpy()


def _port(source, target):
    # the two convolutions pad differently (the torch one cuts its extra outputs):
    # the port says so, layer by layer, and the outputs are checked below
    with pytest.warns(bridge.PortWarning, match="padding is"):
        return bridge.port(source, target, example=(X,))


def test_torch_to_nnx():
    torch.manual_seed(0)
    source = TorchBlock()
    ported = _port(source, JaxBlock(nnx.Rngs(1)))
    np.testing.assert_allclose(ported(X), _torch_out(source), rtol=1e-5, atol=1e-5)
    # the vectors moved bit for bit, each to the one it computes as
    np.testing.assert_array_equal(ported.input_gate[...], source.gate.detach())
    np.testing.assert_array_equal(ported.a_param[...], source.decay.detach())


def test_nnx_to_torch_loads_strictly():
    source = JaxBlock(nnx.Rngs(2))
    state = _port(source, TorchBlock())
    target = TorchBlock()
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=True
    )
    np.testing.assert_allclose(_torch_out(target), source(X), rtol=1e-5, atol=1e-5)
