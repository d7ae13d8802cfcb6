"""Quantized tensors are recognised by their companions and never read as dense: what
bridge cannot establish is refused, naming each tensor and what is missing, and
nothing is loaded. (Files made by the reference tools, and their values, are tested in
test_quant_torch.py and test_quant_gguf.py.)"""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import bridge
from bridge._quant import _fp8, _schemes

from .helpers import requires


F8 = ml_dtypes.float8_e4m3fn
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


def _folder(tmp_path, state, quantization_config=None):
    safetensors.numpy.save_file(
        state, tmp_path / "model.safetensors", metadata={"format": "pt"}
    )
    if quantization_config is not None:
        config = {"dtype": "float32", "quantization_config": quantization_config}
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _fp8_values(shape, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=shape).astype(np.float32).clip(-400, 400).astype(F8)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(256, 200, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(200, 8, rngs=rngs)


def assert_refused(path, *fragments):
    with pytest.raises(_schemes.QuantizationError) as info:
        bridge.load(path, like=Net(nnx.Rngs(0)))
    message = str(info.value)
    assert "nothing was loaded" in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    with pytest.raises(_schemes.QuantizationError):
        bridge.load(path)  # without `like` too


@requires("NNX")
def test_fp8_without_scale_refused(tmp_path):
    state = {
        "fc.weight": _fp8_values((200, 256)),
        "out.weight": np.ones((8, 200), "f4"),
    }
    state["out.bias"] = np.zeros(8, "f4")
    assert_refused(
        _folder(tmp_path, state, FP8_CONFIG),
        "fc.weight: float8_e4m3fn without its scale",
        "'fc.weight_scale_inv'",
    )


@requires("NNX")
def test_scale_of_the_wrong_shape_refused(tmp_path):
    state = {
        "fc.weight": _fp8_values((200, 256)),
        "fc.weight_scale_inv": np.ones((3, 3), "f4"),
        "out.weight": np.ones((8, 200), "f4"),
        "out.bias": np.zeros(8, "f4"),
    }
    assert_refused(
        _folder(tmp_path, state, FP8_CONFIG),
        "fc.weight_scale_inv: shape (3, 3)",
        "needs (2, 2)",
    )


@requires("NNX")
def test_packed_int4_without_config_refused(tmp_path):
    state = {
        "fc.weight_packed": np.zeros((200, 32), np.int32),
        "fc.weight_scale": np.ones((200, 1), "f4"),
        "fc.weight_shape": np.array([200, 256], np.int64),
        "out.weight": np.ones((8, 200), "f4"),
        "out.bias": np.zeros(8, "f4"),
    }
    assert_refused(
        _folder(tmp_path, state),
        "fc.weight_packed: packed integers, but no compressed-tensors",
        "bits per value unknown",
    )


@requires("NNX")
def test_every_problem_listed_once(tmp_path):
    state = {
        "fc.qweight": np.zeros((32, 200), np.int32),
        "fc.qzeros": np.zeros((2, 25), np.int32),
        "fc.scales": np.ones((2, 200), "f2"),
        "out.weight": _fp8_values((8, 200)),
        "out.bias": np.zeros(8, "f4"),
        "lone.weight_scale_inv": np.ones((1, 1), "f4"),
    }
    assert_refused(
        _folder(tmp_path, state),
        "3 quantized tensor(s)",
        "fc.qweight: GPTQ-packed integers, but no quantization_config",
        "out.weight: float8_e4m3fn without its scale",
        "lone.weight_scale_inv: a scale without its weight",
    )


def test_plain_fp8_file_is_not_quantized(tmp_path):
    """A file with FP8 arrays and no sign of quantization (no scale, no config)
    holds FP8 arrays: read as they are, as before."""
    state = {"fc.weight": _fp8_values((4, 3))}
    _folder(tmp_path, state)
    tree = bridge.load(tmp_path / "model.safetensors")
    assert tree.fc.weight.dtype == F8
    assert np.array_equal(
        np.asarray(tree.fc.weight).view(np.uint8), state["fc.weight"].view(np.uint8)
    )


@requires("NNX")
def test_fp8_block_read_lazily_one_weight_at_a_time(tmp_path, monkeypatch):
    weight = _fp8_values((200, 256))
    scale = np.array([[0.5, 2.0], [0.25, 4.0]], np.float32)
    state = {
        "fc.weight": weight,
        "fc.weight_scale_inv": scale,
        "fc.input_scale": np.ones((), "f4"),  # an activation scale: not needed
        "out.weight": np.ones((8, 200), "f4"),
        "out.bias": np.zeros(8, "f4"),
    }
    _folder(tmp_path, state, FP8_CONFIG)
    calls = []
    dequantize = _schemes.dequantize
    monkeypatch.setattr(
        _schemes, "dequantize", lambda q, *a: calls.append(q.name) or dequantize(q, *a)
    )
    model = bridge.load(tmp_path, like=Net(nnx.Rngs(0)))
    assert calls == ["fc.weight"]
    expected = (
        weight.astype(np.float32) * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:200]
    )
    assert np.array_equal(np.asarray(model.fc.kernel[...]), expected.T)


@requires("NNX")
def test_quantize_options_checked(tmp_path):
    model = Net(nnx.Rngs(0))
    with pytest.raises(ValueError, match="`scheme` must be one of"):
        bridge.save_quantized(tmp_path / "m.safetensors", model, "int4")


@requires("NNX")
def test_fp8_out_round_trip_within_fp8_error(tmp_path):
    model = Net(nnx.Rngs(0))
    bridge.save_quantized(tmp_path / "model.safetensors", model, "fp8-block")
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [128, 128]
    back = bridge.load(tmp_path, like=Net(nnx.Rngs(1)))
    for layer in ("fc", "out"):
        want = np.asarray(getattr(model, layer).kernel[...])
        got = np.asarray(getattr(back, layer).kernel[...])
        # e4m3: 3 mantissa bits (relative error 2**-4), subnormals below 2**-6 in
        # steps of 2**-9, for values scaled so that the largest is 448
        bound = 2**-4 * np.abs(want) + 2**-10 * np.abs(want).max() / 448
        assert np.all(np.abs(got - want) <= bound)
    assert np.array_equal(back.out.bias[...], model.out.bias[...])
    # the block grid of a weight that is not a multiple of 128: partial blocks
    assert _fp8.grid((200, 256), (128, 128)) == (2, 2)
    assert back.fc.kernel[...].dtype == jnp.float32


@requires("NNX")
def test_sharded_fp8_folder_scale_in_another_shard(tmp_path, capsys):
    weight, scale = _fp8_values((200, 256)), np.full((2, 2), 0.5, np.float32)
    shards = {
        "model-00001-of-00002.safetensors": {
            "fc.weight": weight,
            "out.bias": np.zeros(8, "f4"),
        },
        "model-00002-of-00002.safetensors": {
            "fc.weight_scale_inv": scale,
            "out.weight": np.ones((8, 200), "f4"),
        },
    }
    weight_map = {}
    for file, state in shards.items():
        safetensors.numpy.save_file(state, tmp_path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"dtype": "float32", "quantization_config": FP8_CONFIG}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = bridge.load(tmp_path, like=Net(nnx.Rngs(0)))
    assert np.array_equal(model.fc.kernel[...], (weight.astype(np.float32) * 0.5).T)
    from bridge._cli import main

    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fp8-block 128x128, 8-bit: 1 weight," in out
    assert f"{200 * 256 * 4:,} bytes dequantized" in out
