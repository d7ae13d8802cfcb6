"""Stacks written in PyTorch layout: a Linen `nn.scan` stack (bias-free, layer axis 0
or 1, MaxText's) saved with `layout="torch"` is per-layer names and 2-D `Linear`
weights, read by `load_state_dict(strict=True)` with equal outputs; a tensor that is
not what its layer kind is in PyTorch is refused and nothing is written."""

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import bridge

from .helpers import skip_unless
from .test_port_stacked import BiasFreeLooped, BiasFreeScanned, Scanned, X, _randomised


torch = pytest.importorskip("torch")


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(4, eps=1e-6)
        self.up = torch.nn.Linear(4, 4, bias=False)
        self.down = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TorchStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([TorchBlock() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(4, rngs=rngs)
        self.up = nnx.Linear(4, 4, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4, 4, use_bias=False, rngs=rngs)


class NNXStack(nnx.Module):
    """Blocks made under `nnx.vmap`: one block whose Variables have a layer axis."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NNXBlock(rngs)

        self.layers = make(rngs)


def _torch_outputs(state):
    model = TorchStack()
    model.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    with torch.no_grad():
        return model(torch.tensor(np.asarray(X))).numpy()


def test_an_nnx_stack_saved_in_torch_layout_loads_strictly(tmp_path):
    skip_unless("NNX")
    stack = NNXStack(nnx.Rngs(0))
    path = tmp_path / "model.safetensors"
    bridge.save_state_dict(path, stack)
    state = safetensors.numpy.load_file(str(path))
    assert state["layers.2.up.weight"].shape == (4, 4)
    assert state["layers.0.norm.weight"].shape == (4,)
    per_layer = bridge.port(stack, BiasFreeLooped(nnx.Rngs(1)))
    assert np.max(np.abs(_torch_outputs(state) - np.asarray(per_layer(X)))) < 1e-5


@pytest.mark.parametrize("axis", [0, 1])
def test_a_bias_free_scan_export_is_refused_until_a_torch_model_decides(axis, tmp_path):
    """A bias-free stack reads at axis 0 and at 1: with no other side, the export is
    refused naming the axes (nothing written); ported into the PyTorch model, its
    layers decide, and the state dict loads strictly with equal outputs."""
    module = BiasFreeScanned(axis=axis)
    variables = module.init(jax.random.key(0), X)
    path = tmp_path / "model.safetensors"
    with pytest.raises(ValueError, match=r"stack: \.layers reads as a stack"):
        bridge.save_state_dict(path, (module, variables))
    assert list(tmp_path.iterdir()) == []
    state = bridge.port((module, variables), TorchStack())
    state = {k: v.numpy() for k, v in state.items()}
    assert state["layers.2.up.weight"].shape == (4, 4)
    want = np.asarray(module.apply(variables, X))
    assert np.max(np.abs(_torch_outputs(state) - want)) < 1e-5


def test_a_tensor_that_is_no_torch_layer_is_refused_and_nothing_written(tmp_path):
    """A norm scanned alone: its `(L, D)` scale reads as a Flax norm, but a 2-D
    `weight` is no PyTorch norm."""
    variables = {"params": {"norm": {"scale": np.ones((3, 4), np.float32)}}}
    path = tmp_path / "model.safetensors"
    with pytest.raises(ValueError, match=r"\.norm would be written as 'norm' with"):
        bridge.save_state_dict(path, variables)
    assert list(tmp_path.iterdir()) == []


class TorchBiasedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.LayerNorm_0 = torch.nn.LayerNorm(4, eps=1e-6)
        self.Dense_0 = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + self.Dense_0(self.LayerNorm_0(x))


class TorchScanned(torch.nn.Module):
    """The PyTorch model of test_port_stacked's `Scanned` (`nn.scan` of LayerNorm +
    Dense with bias, a head), with its names."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([TorchBiasedBlock() for _ in range(3)])
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("axis", [0, 1])
def test_a_biased_linen_scan_saved_in_torch_layout_loads_strictly(axis, tmp_path):
    """A Linen `nn.scan` stack with biases (it raised a TypeError on
    ShapeDtypeStruct once), at axis 0 and MaxText's 1: per-layer names, checked
    against the PyTorch model (like=), read by load_state_dict(strict=True) with the
    Linen model's outputs."""
    variables = Scanned(axis=axis).init(jax.random.key(0), X)
    module, variables = _randomised((Scanned(axis=axis), variables))
    reference = TorchScanned()
    path = tmp_path / "model.safetensors"
    bridge.save_state_dict(path, (module, variables), like=reference)
    state = safetensors.numpy.load_file(str(path))
    assert state["blocks.2.Dense_0.weight"].shape == (4, 4)
    reference.load_state_dict(
        {k: torch.tensor(v) for k, v in state.items()}, strict=True
    )
    with torch.no_grad():
        got = reference(torch.tensor(np.asarray(X))).numpy()
    want = np.asarray(module.apply(variables, X))
    assert np.max(np.abs(got - want)) < 1e-5
