"""Layers used side by side in a PyTorch module and a JAX model, with other names
and computed in another order on each side: paired by what changes each output by
itself before they meet and where they meet (PyTorch's `Uses.alone` and
`Uses.merges`, JAX's traced program), never by the order each forward pass happens to
compute them (issue 37). The oracle: torch's own
forward pass."""

import jax
import jax.numpy as jnp
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


class TorchAttention(torch.nn.Module):
    """Single-head self-attention, query, key and value computed in that order;
    `sdpa`: through `F.scaled_dot_product_attention`, else written out."""

    def __init__(self, sdpa: bool):
        super().__init__()
        torch.manual_seed(1)
        self.sdpa = sdpa
        self.q_proj = torch.nn.Linear(4, 4, bias=False)
        self.k_proj = torch.nn.Linear(4, 4, bias=False)
        self.v_proj = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.sdpa:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        scores = torch.matmul(q, k.transpose(-1, -2)) * 0.5
        return torch.matmul(scores.softmax(-1), v)


class JaxAttention(nnx.Module):
    """The same attention with names of its own, computing the value, then the
    key, then the query: paired by the order of use, `first` would take torch's
    query."""

    def __init__(self, rngs: nnx.Rngs):
        self.first = nnx.Linear(4, 4, use_bias=False, rngs=rngs)  # the value
        self.second = nnx.Linear(4, 4, use_bias=False, rngs=rngs)  # the key
        self.third = nnx.Linear(4, 4, use_bias=False, rngs=rngs)  # the query

    def __call__(self, x):
        v, k, q = self.first(x), self.second(x), self.third(x)
        scores = jnp.einsum("qd,kd->qk", q, k) * 0.5
        return jax.nn.softmax(scores, axis=-1) @ v


@pytest.mark.parametrize("sdpa", [False, True], ids=["matmul", "sdpa"])
def test_torch_attention_into_jax_computing_value_key_query(sdpa):
    source = TorchAttention(sdpa).eval()
    ported = bridge.port(source, JaxAttention(nnx.Rngs(3)), example=(X,))
    np.testing.assert_allclose(ported(X), _torch_out(source), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(ported.third.kernel[...]), source.q_proj.weight.detach().numpy().T
    )
    np.testing.assert_array_equal(
        np.asarray(ported.second.kernel[...]), source.k_proj.weight.detach().numpy().T
    )


@pytest.mark.parametrize("sdpa", [False, True], ids=["matmul", "sdpa"])
def test_jax_attention_into_torch_computing_query_key_value(sdpa):
    source = JaxAttention(nnx.Rngs(4))
    target = TorchAttention(sdpa).eval()
    target.load_state_dict(bridge.port(source, target, example=(X,)), strict=True)
    np.testing.assert_allclose(_torch_out(target), source(X), rtol=1e-5, atol=1e-6)


class TorchTwoHeads(torch.nn.Module):
    """Two heads of one shape on one input, both returned: nothing in the
    computation says which is which in another framework."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.sentiment = torch.nn.Linear(4, 3)
        self.topic = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.sentiment(x), self.topic(x)


class JaxTwoHeads(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.head_a = nnx.Linear(4, 3, rngs=rngs)
        self.head_b = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.head_a(x), self.head_b(x)


def test_two_heads_on_one_input_against_torch_are_refused_not_paired_by_order():
    with pytest.raises(bridge.PortError, match="side by side") as refused:
        bridge.port(TorchTwoHeads(), JaxTwoHeads(nnx.Rngs(5)), example=(X,))
    assert "sentiment" in str(refused.value) and "head_a" in str(refused.value)
    # with rules, as the message says, the port is made
    ported = bridge.port(
        TorchTwoHeads(),
        JaxTwoHeads(nnx.Rngs(5)),
        example=(X,),
        rules={r"\.sentiment": ".head_b", r"\.topic": ".head_a"},
    )
    with torch.no_grad():
        sentiment, topic = TorchTwoHeads()(torch.from_numpy(X))
    a, b = ported(X)  # head_a, head_b
    np.testing.assert_allclose(a, topic.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, sentiment.numpy(), rtol=1e-5, atol=1e-6)
