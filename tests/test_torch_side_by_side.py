"""Layers used side by side in a PyTorch module and a JAX model, with other names
and computed in another order on each side: paired by what changes each output by
itself before they meet (PyTorch's `Uses.alone`, JAX's traced program), never by the
order each forward pass happens to compute them (issue 37). The oracle: torch's own
forward pass."""

import numpy as np
import pytest
from flax import nnx

import bridge

from .test_port_silent import _GatedTarget as JaxGated  # the linear branch first


torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


class TorchGated(torch.nn.Module):
    """Llama's MLP: `down(silu(gate(x)) * up(x))`, the gate computed first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate_proj = torch.nn.Linear(4, 8, bias=False)
        self.up_proj = torch.nn.Linear(4, 8, bias=False)
        self.down_proj = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return self.down_proj(
            torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        )


X = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)


def _torch_out(model):
    with torch.no_grad():
        return model(torch.from_numpy(X)).numpy()


def test_torch_gated_mlp_into_jax_computing_the_other_branch_first():
    source = TorchGated().eval()
    ported = bridge.port(source, JaxGated(nnx.Rngs(1)), example=(X,))
    np.testing.assert_allclose(ported(X), _torch_out(source), rtol=1e-5, atol=1e-6)
    # the gate (silu) went to `fc_act`, the linear branch to `fc_lin`
    np.testing.assert_array_equal(
        np.asarray(ported.fc_act.kernel[...]),
        source.gate_proj.weight.detach().numpy().T,
    )


def test_jax_gated_mlp_into_torch_computing_the_other_branch_first():
    source = JaxGated(nnx.Rngs(2))
    target = TorchGated().eval()
    target.load_state_dict(bridge.port(source, target, example=(X,)), strict=True)
    np.testing.assert_allclose(_torch_out(target), source(X), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
        target.up_proj.weight.detach().numpy(), np.asarray(source.fc_lin.kernel[...]).T
    )
