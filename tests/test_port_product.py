"""Layers read by what they compute (issue 37): a kernel stored `(out, in)` as
transformers' `FlaxConv1D` holds it, and an `nnx.Einsum`'s per-head kernels, are
`Dense` layers whose layout the traced product decides; a square one nothing
traced is refused, never guessed. Each port is compared with the other framework's
own outputs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires


D, F = 4, 6  # FlaxConv1D-like block: D -> F -> F (square) -> D


class _Conv1D(nn.Module):
    """transformers' `FlaxConv1D`: `kernel (out, in)`, `x @ kernel.T + bias`."""

    features: int

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(1.0)
        kernel = self.param("kernel", init, (self.features, x.shape[-1]))
        bias = self.param("bias", init, (self.features,))
        y = jax.lax.dot_general(x, kernel.T, (((x.ndim - 1,), (0,)), ((), ())))
        return y + jnp.broadcast_to(bias, y.shape)


class _LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(_Conv1D(F, name="up")(x))
        h = jnp.tanh(_Conv1D(F, name="mid")(h))  # square: only the trace tells
        return _Conv1D(D, name="down")(h)


class _NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, F, bias_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.mid = nnx.Linear(F, F, bias_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.down = nnx.Linear(F, D, bias_init=nnx.initializers.normal(1.0), rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.up(x))
        return self.down(jnp.tanh(self.mid(h)))


def _x(shape=(2, 3, D)):
    return np.random.default_rng(0).normal(size=shape).astype(np.float32)


def _linen():
    module = _LinenBlock()
    return module, module.init(jax.random.key(1), _x())


@requires("NNX")
def test_flax_conv1d_into_nnx_linear_and_back():
    module, variables = _linen()
    x = _x()
    assert variables["params"]["up"]["kernel"].shape == (F, D)  # (out, in)
    ported = bridge.port((module, variables), _NNXBlock(nnx.Rngs(2)), example=(x,))
    np.testing.assert_allclose(ported(x), module.apply(variables, x), atol=1e-5)
    source = _NNXBlock(nnx.Rngs(3))
    _, back = bridge.port(source, (module, variables), example=(x,))
    np.testing.assert_allclose(module.apply(back, x), source(x), atol=1e-5)
    plan = bridge.port_plan((module, variables), _NNXBlock(nnx.Rngs(2)), example=(x,))
    assert "kernel (out,in)" in str(plan)


@requires("NNX")
def test_flax_conv1d_square_kernel_without_example_is_refused():
    """`up`'s and `down`'s biases say they are stored (out, in); `mid` is
    square, and nothing but the forward pass says how it is stored."""
    module, variables = _linen()
    with pytest.raises(bridge.PortError, match=r"mid holds a square kernel \(6, 6\)"):
        bridge.port((module, variables), _NNXBlock(nnx.Rngs(2)))


def test_flax_conv1d_saved_in_torch_layout(tmp_path):
    module, variables = _linen()
    x = _x()
    path = tmp_path / "block.safetensors"
    with pytest.raises(ValueError, match=r"mid holds a square kernel"):
        bridge.save_state_dict(path, (module, variables))
    bridge.save_state_dict(path, (module, variables), example=(x,))
    import safetensors.numpy

    state = safetensors.numpy.load_file(path)
    assert state["up.weight"].shape == (F, D)  # nn.Linear: (out, in)
    h = np.asarray(x, np.float64)  # the oracle in NumPy, off any accelerator
    for name in ("up", "mid", "down"):
        h = h @ state[f"{name}.weight"].T + state[f"{name}.bias"][None, None]
        h = np.tanh(h) if name != "down" else h
    # a layout mistake is O(1) off; an accelerator's float32 products, 1e-4
    np.testing.assert_allclose(h, module.apply(variables, x), rtol=1e-4, atol=1e-4)


def _torch_block():
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(D, F)
            self.mid = torch.nn.Linear(F, F)
            self.down = torch.nn.Linear(F, D)

        def forward(self, x):
            h = torch.tanh(self.up(x))
            return self.down(torch.tanh(self.mid(h)))

    torch.manual_seed(0)
    return Block().eval()


def _run_torch(model, x):
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


@pytest.mark.torch
def test_flax_conv1d_with_torch_linear_both_ways():
    torch = pytest.importorskip("torch")

    module, variables = _linen()
    x = _x()
    source = _torch_block()
    _, ported = bridge.port(source, (module, variables), example=(x,))
    np.testing.assert_allclose(
        module.apply(ported, x), _run_torch(source, x), atol=1e-5
    )
    target = _torch_block()
    state = bridge.port((module, variables), target, example=(x,))
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}
    )
    np.testing.assert_allclose(
        _run_torch(target, x), module.apply(variables, x), atol=1e-5
    )


# --- nnx.Einsum per-head projections ---------------------------------------------

H, HD = 2, 4  # heads, head size: D_MODEL = H * HD, so every fused kernel is square
D_MODEL = H * HD


class _Einsum(nnx.Module):
    """bonsai's attention projections: `q` `(D, H, hd)` with a per-head bias, `o`
    `(H, hd, D)`."""

    def __init__(self, rngs):
        normal = nnx.initializers.normal(1.0)
        self.q_proj = nnx.Einsum(
            "BTD,DNH->BTNH", (D_MODEL, H, HD), (H, HD), bias_init=normal, rngs=rngs
        )
        self.o_proj = nnx.Einsum("BTNH,NHD->BTD", (H, HD, D_MODEL), rngs=rngs)

    def __call__(self, x):
        return self.o_proj(jnp.tanh(self.q_proj(x)))


class _Fused(nnx.Module):
    def __init__(self, rngs):
        normal = nnx.initializers.normal(1.0)
        self.q_proj = nnx.Linear(D_MODEL, D_MODEL, bias_init=normal, rngs=rngs)
        self.o_proj = nnx.Linear(D_MODEL, D_MODEL, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.o_proj(jnp.tanh(self.q_proj(x)))


@requires("NNX")
def test_einsum_per_head_kernels_pair_with_fused_linears():
    x = _x((2, 3, D_MODEL))
    source = _Einsum(nnx.Rngs(0))
    ported = bridge.port(source, _Fused(nnx.Rngs(1)), example=(x,))
    np.testing.assert_allclose(ported(x), source(x), atol=1e-5)
    fused = _Fused(nnx.Rngs(2))
    back = bridge.port(fused, _Einsum(nnx.Rngs(3)), example=(x,))
    np.testing.assert_allclose(back(x), fused(x), atol=1e-5)
    assert back.q_proj.kernel[...].shape == (D_MODEL, H, HD)


@requires("NNX")
def test_einsum_without_example_stays_loose_and_is_refused():
    """Without a trace nothing says which axes of `(8, 2, 4)` meet the input."""
    with pytest.raises(
        bridge.PortError,
        match=r"(?s)unread: the source's loose arrays .*q_proj\.kernel \(8, 2, 4\)"
        r".*give example inputs",
    ):
        bridge.port(_Einsum(nnx.Rngs(0)), _Fused(nnx.Rngs(1)))


@pytest.mark.torch
@requires("NNX")
def test_einsum_per_head_kernels_with_torch_linears_both_ways():
    torch = pytest.importorskip("torch")

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(D_MODEL, D_MODEL)
            self.o_proj = torch.nn.Linear(D_MODEL, D_MODEL, bias=False)

        def forward(self, x):
            return self.o_proj(torch.tanh(self.q_proj(x)))

    x = _x((2, 3, D_MODEL))
    torch.manual_seed(0)
    source = Attn().eval()
    ported = bridge.port(source, _Einsum(nnx.Rngs(1)), example=(x,))
    np.testing.assert_allclose(ported(x), _run_torch(source, x), atol=1e-5)
    einsum = _Einsum(nnx.Rngs(2))
    target = Attn().eval()
    state = bridge.port(einsum, target, example=(x,))
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}
    )
    np.testing.assert_allclose(_run_torch(target, x), einsum(x), atol=1e-5)
