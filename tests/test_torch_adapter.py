"""The PyTorch-layout adapter on numpy state dicts (no torch needed), and on torch
tensors and modules when torch is installed: exact round trips for every dtype,
zero copy, prefixes, fused weights, tied weights, errors."""

import gc
import importlib.util

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import bridge
from bridge._adapters import _torch

from .helpers import check_collector_paused, requires


pytestmark = requires("NNX")  # the targets are NNX models


HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")

# every dtype torch and safetensors share
DTYPES = [
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
]


def _array(dtype, shape=(3, 2)):
    values = np.arange(np.prod(shape)).reshape(shape) - 2
    dt = getattr(ml_dtypes, dtype, None) or np.dtype(dtype)
    return values.astype(dt)


def test_numpy_round_trip_every_dtype_zero_copy():
    sd = {f"layer{i}.{d}": _array(d) for i, d in enumerate(DTYPES)}
    tree = bridge.from_torch(sd)
    back = bridge.to_torch(tree)
    assert list(back) == list(sd)
    for name, array in sd.items():
        assert back[name] is array  # the very array: no copy either way


def test_structure_and_roles():
    sd = {
        "encoder.layer.0.dense.weight": np.ones((2, 3), "f4"),
        "encoder.layer.1.dense.weight": np.ones((2, 3), "f4"),
        "bn.running_mean": np.zeros(2, "f4"),
        "bn.num_batches_tracked": np.zeros((), "i8"),
    }
    tree = bridge.from_torch(sd)
    assert tree.encoder.layer[1].dense.weight.shape == (2, 3)
    roles = bridge.roles(tree)
    assert roles.bn.running_mean == "batch_stats"
    assert roles.bn.num_batches_tracked == "counters"
    assert roles.encoder.layer[0].dense.weight == "params"
    assert bridge.to_native(tree).keys() == sd.keys()
    assert isinstance(bridge.to_neutral(sd), bridge.Tree)


def test_prefix_stripped_and_added_back():
    sd = {
        "bert.pooler.dense.weight": np.ones((2, 2), "f4"),
        "cls.bias": np.zeros(2, "f4"),
    }
    tree = bridge.from_torch(sd, prefix="bert.")
    assert set(tree) == {"pooler", "cls"}
    assert list(bridge.to_torch(tree)) == list(sd)
    assert list(bridge.to_torch(tree, prefix="model.")) == [
        "model.pooler.dense.weight",
        "model.cls.bias",
    ]


def test_split_fused_conv1d_and_back():
    """GPT-2's c_attn (Conv1D, weight (in, 3E)) as three nn.Linear-layout layers."""
    rng = np.random.default_rng(0)
    w, b = rng.normal(size=(4, 12)).astype("f4"), rng.normal(size=12).astype("f4")
    sd = {"h.0.attn.c_attn.weight": w, "h.0.attn.c_attn.bias": b}
    tree = bridge.from_torch(sd, split={r".*\.c_attn": ("q", "k", "v")})
    attn = tree.h[0].attn
    assert set(attn) == {"q", "k", "v"}
    np.testing.assert_array_equal(attn.k.weight, w[:, 4:8].T)
    assert np.shares_memory(attn.k.weight, w)  # a view
    back = bridge.to_torch(tree)
    assert list(back) == list(sd)
    np.testing.assert_array_equal(back["h.0.attn.c_attn.weight"], w)
    np.testing.assert_array_equal(back["h.0.attn.c_attn.bias"], b)
    # into three Flax Dense layers, each q/k/v in its own
    x = rng.normal(size=(2, 4)).astype("f4")
    for i, name in enumerate(("q", "k", "v")):
        linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        sub = {
            "weight": getattr(attn, name).weight,
            "bias": getattr(attn, name).bias,
        }
        ported = bridge.port(sub, linear)
        np.testing.assert_allclose(
            ported(x), x @ w[:, 4 * i : 4 * i + 4] + b[4 * i : 4 * i + 4], rtol=1e-5
        )


def test_split_errors():
    sd = {"attn.c_attn.weight": np.ones((4, 10), "f4")}
    with pytest.raises(ValueError, match="matches no module"):
        bridge.from_torch(sd, split={"qkv": ("q", "k", "v")})
    with pytest.raises(ValueError, match="not a multiple"):
        bridge.from_torch(sd, split={r"attn\.c_attn": ("q", "k", "v")})


def test_tied_numpy_arrays_kept_once():
    emb = np.ones((5, 2), "f4")
    sd = {"wte.weight": emb, "lm_head.weight": emb}
    tree = bridge.from_torch(sd)
    assert set(tree) == {"wte"}
    back = bridge.to_torch(tree)
    assert back["lm_head.weight"] is back["wte.weight"]
    plan = bridge.port_plan(tree, nnx.Embed(5, 2, rngs=nnx.Rngs(0)))
    assert "lm_head.weight = wte.weight" in str(plan)


def test_not_a_state_dict():
    with pytest.raises(TypeError, match="expects `obj`, a state dict"):
        bridge.from_torch([np.ones(2)])
    with pytest.raises(TypeError, match="'a' is a str"):
        bridge.from_torch({"a": "x"})
    with pytest.raises(ValueError, match="both an array and a prefix"):
        bridge.from_torch({"a": np.ones(1), "a.b": np.ones(1)})


@needs_torch
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_round_trip_exact(dtype):
    import torch

    array = _array(dtype)
    tensor = torch.from_numpy(array.view(f"u{array.itemsize}")).view(
        getattr(torch, dtype)
    )
    tree = bridge.from_torch({"w": tensor})
    assert tree.w.dtype == array.dtype
    assert tree.w.tobytes() == array.tobytes()
    assert np.shares_memory(tree.w, array)  # a view of the tensor's memory
    back = bridge.to_torch(tree, tensors=True)["w"]
    assert back.dtype == tensor.dtype
    assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))


@needs_torch
def test_tied_module_weights():
    import torch

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(5, 2)
            self.lm_head = torch.nn.Linear(2, 5, bias=False)
            self.lm_head.weight = self.wte.weight

    lm = LM()
    tree = bridge.from_torch(lm)
    assert "lm_head" not in tree
    state = bridge.to_torch(tree, tensors=True)
    LM().load_state_dict(state, strict=True)
    assert state["lm_head.weight"].data_ptr() == state["wte.weight"].data_ptr()


def test_to_torch_tensors_needs_torch(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)
    tree = bridge.from_torch({"w": np.ones(2, "f4")})
    with pytest.raises(ImportError, match="torch is not installed"):
        bridge.to_torch(tree, tensors=True)


@needs_torch
def test_tied_names_one_tensor_from_jax_arrays():
    """A tie among JAX arrays (after a port) is still one tensor, as PyTorch's own
    state dict has it (read-only JAX memory is copied once, not per name)."""
    import jax.numpy as jnp

    emb = jnp.arange(10.0).reshape(5, 2)
    tree = bridge.from_torch({"wte.weight": emb, "lm_head.weight": emb})
    state = bridge.to_torch(tree, tensors=True)
    assert state["lm_head.weight"] is state["wte.weight"]
    np.testing.assert_array_equal(state["wte.weight"].numpy(), np.asarray(emb))


def test_from_torch_pauses_the_collector_and_restores_the_callers_state(monkeypatch):
    during = []
    real = _torch.build

    def seen(*args):
        during.append(gc.isenabled())
        return real(*args)

    monkeypatch.setattr(_torch, "build", seen)
    sd = {"fc.weight": np.ones((3, 2), "f4")}
    not_arrays = {"fc.weight": "not an array"}
    check_collector_paused(
        lambda: bridge.from_torch(sd),
        during,
        lambda: bridge.from_torch(not_arrays),
        TypeError,
    )


@needs_torch
def test_a_modules_weights_are_copied_on_both_threads(tmp_path, monkeypatch):
    """A port from a PyTorch module into an abstract target: its transposed weights
    are views of memory the module holds anyway, copied without waiting for a
    budget (`Placing.put(held=)`); a lazily read file's arrays are memory of their
    own, counted. The ports are exact either way."""
    import safetensors.numpy
    import torch

    from bridge import _buffers

    seen = []
    put = _buffers.Placing.put

    def recorded(self, x, held=False):
        seen.append(held)
        return put(self, x, held)

    monkeypatch.setattr(_buffers.Placing, "put", recorded)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    target = nnx.eval_shape(
        lambda: nnx.Sequential(
            nnx.Linear(4, 6, rngs=nnx.Rngs(0)), nnx.Linear(6, 3, rngs=nnx.Rngs(1))
        )
    )
    ported = bridge.port(module, target)
    x = np.ones((2, 4), np.float32)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ported(x), want, rtol=1e-6)
    assert seen == [True] * 4  # two kernels, two biases
    seen.clear()
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file(
        {k: v.numpy() for k, v in module.state_dict().items()}, path
    )
    loaded = bridge.load(path, like=target)
    np.testing.assert_allclose(loaded(x), want, rtol=1e-6)
    assert seen == [False] * 4
