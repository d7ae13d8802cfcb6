"""Quantized checkpoints whose companions lie (round 3 of the hostile-input audit):
parts of a dtype their scheme does not define (a float `qweight` would be read as
packed integers; integer or bool scales; int64 `qzeros`), zero points of the wrong
shape, settings of the wrong type (`bits: 4.0`), a block size that would make a scale
grid the weight's size, NaN or infinite scales, an NVFP4 global scale of 0. Each is
refused with a `CheckpointError` naming the tensor, by the dequantizing load and by
`keep_quantized=True` alike, nothing loaded; a valid file loads bit-equal both ways.
"""

import json
import re

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import bridge
from bridge._quant import _schemes

from .helpers import skip_unless


F8 = ml_dtypes.float8_e4m3fn


class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(256, 200, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(200, 8, rngs=rngs)


def _like():
    skip_unless("NNX")
    return nnx.eval_shape(lambda: Net(nnx.Rngs(0)))


def _folder(tmp_path, state, config):
    rng = np.random.default_rng(1)
    state = {
        **state,
        "out.weight": rng.normal(size=(8, 200)).astype(np.float32),
        "out.bias": np.zeros(8, np.float32),
    }
    safetensors.numpy.save_file(state, tmp_path / "model.safetensors")
    text = json.dumps({"dtype": "float32", "quantization_config": config})
    (tmp_path / "config.json").write_text(text)
    return tmp_path


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
CT_INT = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        }
    },
}
NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": 16,
                "symmetric": True,
            },
        }
    },
}


def _packed(qweight_shape, seed=0):
    """`fc` (in 256, out 200) as 4-bit packed int32 words (GPTQ or AWQ), groups of
    128: qzeros (2, 25), scales float16 (2, 200)."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, (2, *qweight_shape), dtype=np.uint64)
    return {
        "fc.qweight": words[0].astype(np.uint32).view(np.int32),
        "fc.qzeros": words[1, :2, :25].astype(np.uint32).view(np.int32),
        "fc.scales": (rng.random((2, 200)) * 0.01 + 0.001).astype(np.float16),
    }


def gptq():
    return _packed((32, 200))  # (in * 4 / 32, out)


def awq():
    return _packed((256, 25))  # (in, out * 4 / 32)


def fp8(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "fc.weight": rng.normal(size=(200, 256)).astype(np.float32).astype(F8),
        "fc.weight_scale_inv": (rng.random((2, 2)) + 0.5).astype(np.float32),
    }


def ct_int(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "fc.weight": rng.integers(-128, 128, (200, 256), dtype=np.int8),
        "fc.weight_scale": (rng.random((200, 1)) * 0.01).astype(np.float32),
    }


def nvfp4(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "fc.weight_packed": rng.integers(0, 256, (200, 128), dtype=np.uint8),
        "fc.weight_scale": (rng.random((200, 16)) + 0.5).astype(F8),
        "fc.weight_global_scale": np.array([2.0], np.float32),
    }


SCHEMES = {
    "gptq": (gptq, GPTQ),
    "awq": (awq, AWQ),
    "fp8-block": (fp8, FP8),
    "int": (ct_int, CT_INT),
    "nvfp4": (nvfp4, NVFP4),
}


def _bits(tree):
    return [np.asarray(a).view(np.uint32) for a in jax.tree.leaves(tree)]


@pytest.mark.parametrize("scheme", ["gptq", "awq", "fp8-block", "int"])
def test_valid_files_load_bit_equal_dequantized_and_kept(tmp_path, scheme):
    make, config = SCHEMES[scheme]
    folder = _folder(tmp_path, make(), config)
    dense = bridge.load(folder, like=_like())
    kept = bridge.load(folder, like=_like(), keep_quantized=True)
    fc = bridge.to_neutral(kept).fc.kernel
    assert isinstance(fc, bridge.QuantizedArray) and fc.scheme.name == scheme
    got = bridge.to_neutral(bridge.dequantize(kept))
    for a, b in zip(_bits(bridge.to_neutral(dense)), _bits(got), strict=True):
        assert np.array_equal(a, b)


def _changed(scheme, name, change):
    make, config = SCHEMES[scheme]
    state = make()
    state[name] = change(state[name]) if callable(change) else change
    return state, config


def _as(dtype):
    return lambda a: a.astype(dtype)


def _poisoned(dtype, index, value):
    def change(a):
        b = a.astype(np.float32)
        b[index] = value
        return b.astype(dtype)

    return change


# (id, scheme, tensor changed, change, fragments the message must hold)
REFUSED = [
    # item 4: companions of a dtype the scheme does not define
    (
        "gptq qweight float32",
        "gptq",
        "fc.qweight",
        _as(np.float32),
        ["fc.qweight: float32", "int32"],
    ),
    (
        "gptq qzeros float32",
        "gptq",
        "fc.qzeros",
        _as(np.float32),
        ["fc.qzeros: float32"],
    ),
    ("gptq qzeros int64", "gptq", "fc.qzeros", _as(np.int64), ["fc.qzeros: int64"]),
    (
        "gptq scales int32",
        "gptq",
        "fc.scales",
        _as(np.int32),
        ["fc.scales: int32", "float"],
    ),
    ("gptq scales bool", "gptq", "fc.scales", _as(np.bool_), ["fc.scales: bool"]),
    ("awq qzeros int64", "awq", "fc.qzeros", _as(np.int64), ["fc.qzeros: int64"]),
    ("awq scales uint8", "awq", "fc.scales", _as(np.uint8), ["fc.scales: uint8"]),
    (
        "fp8 scale_inv int32",
        "fp8-block",
        "fc.weight_scale_inv",
        _as(np.int32),
        ["fc.weight_scale_inv: int32"],
    ),
    (
        "int scale bool",
        "int",
        "fc.weight_scale",
        _as(np.bool_),
        ["fc.weight_scale: bool"],
    ),
    (
        "int zero point float",
        "int",
        "fc.weight_zero_point",
        np.zeros((200, 1), np.float32),
        ["fc.weight_zero_point: float32"],
    ),
    # item 18: a zero point of the wrong size (was a raw reshape error)
    (
        "int zero point (7, 1)",
        "int",
        "fc.weight_zero_point",
        np.zeros((7, 1), np.int8),
        ["fc.weight_zero_point: shape (7, 1)", "(200, 1)"],
    ),
]
NOT_FINITE = [
    # item 6: NaN / infinite scales, NVFP4 global scale 0
    (
        "gptq scale NaN",
        "gptq",
        "fc.scales",
        _poisoned(np.float16, (1, 3), np.nan),
        ["fc.scales", "NaN", "(1, 3)"],
    ),
    (
        "awq scale inf",
        "awq",
        "fc.scales",
        _poisoned(np.float16, (0, 0), np.inf),
        ["fc.scales", "infinite"],
    ),
    (
        "fp8 scale_inv NaN",
        "fp8-block",
        "fc.weight_scale_inv",
        _poisoned(np.float32, (1, 1), np.nan),
        ["fc.weight_scale_inv"],
    ),
    (
        "int scale -inf",
        "int",
        "fc.weight_scale",
        _poisoned(np.float32, (5, 0), -np.inf),
        ["fc.weight_scale"],
    ),
    (
        "nvfp4 global 0",
        "nvfp4",
        "fc.weight_global_scale",
        np.array([0.0], np.float32),
        ["fc.weight_global_scale", "zero"],
    ),
    (
        "nvfp4 global NaN",
        "nvfp4",
        "fc.weight_global_scale",
        np.array([np.nan], np.float32),
        ["fc.weight_global_scale"],
    ),
    (
        "nvfp4 scale NaN",
        "nvfp4",
        "fc.weight_scale",
        _poisoned(F8, (0, 2), np.nan),
        ["fc.weight_scale"],
    ),
]


def _check(folder, fragments, keep):
    """The refusals of every load of `folder` (their messages), each checked to name
    the file and every fragment."""
    messages = []
    for like in (_like(), None) if not keep else (_like(),):
        with pytest.raises(bridge.CheckpointError) as info:
            bridge.load(folder, like=like, keep_quantized=keep)
        message = str(info.value)
        assert "model.safetensors" in message or str(folder) in message, message
        for fragment in fragments:
            assert fragment in message, (fragment, message)
        messages.append(message)
    return messages


@pytest.mark.parametrize("keep", [False, True], ids=["dequantizing", "kept"])
@pytest.mark.parametrize("case", REFUSED + NOT_FINITE, ids=lambda c: c[0])
def test_lying_companions_are_refused_naming_the_tensor(tmp_path, case, keep):
    _, scheme, name, change, fragments = case
    state, config = _changed(scheme, name, change)
    messages = _check(_folder(tmp_path, state, config), fragments, keep)
    assert all(f in m for m in messages for f in fragments), messages


@pytest.mark.parametrize(
    "setting, value",
    [("bits", 4.0), ("bits", True), ("group_size", 128.0), ("group_size", True)],
)
def test_gptq_settings_of_the_wrong_type_are_refused(tmp_path, setting, value):
    """`bits: 4.0` equals 4 in Python: it was accepted, then a raw TypeError."""
    folder = _folder(tmp_path, gptq(), {**GPTQ, setting: value})
    with pytest.raises(_schemes.QuantizationError, match=f"fc.qweight: GPTQ .*{value}"):
        bridge.load(folder, like=_like())


@pytest.mark.parametrize("block", [[1, 2**31], [128, 128.0], [0, 128], [True, 128]])
def test_fp8_block_sizes_are_bounded(tmp_path, block):
    """`weight_block_size: [1, 2**31]` made an 8 GiB scale grid for an 8 KiB weight."""
    state = fp8()
    state["fc.weight_scale_inv"] = np.ones((200, 1), np.float32)
    folder = _folder(tmp_path, state, {**FP8, "weight_block_size": block})
    with pytest.raises(_schemes.QuantizationError, match="weight_block_size"):
        bridge.load(folder, like=_like())


def _packed_int4():
    """`fc` as compressed-tensors pack-quantized int4 (per-row scales)."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, (200, 32), dtype=np.uint64).astype(np.uint32)
    return {
        "fc.weight_packed": words.view(np.int32),
        "fc.weight_scale": np.full((200, 1), 0.01, np.float32),
        "fc.weight_shape": np.array([200, 256], np.int64),
    }


def _ct_packed(targets):
    group = {
        "targets": targets,
        "weights": {"num_bits": 4, "type": "int", "strategy": "channel"},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
    }


@pytest.mark.parametrize(
    "targets, match",
    [
        (["re:("], r"target 're:\(' is no regular expression"),
        ("Linear", "targets are Linear, not a list"),
    ],
)
def test_config_group_targets_that_are_no_pattern_are_refused(
    tmp_path, targets, match, capsys
):
    """`re:(` was a raw re.error, which `bridge inspect` blamed on a --filter never
    given."""
    from bridge import _cli

    folder = _folder(tmp_path, _packed_int4(), _ct_packed(targets))
    with pytest.raises(_schemes.QuantizationError, match=match):
        bridge.load(folder, like=_like())
    assert _cli.main(["inspect", str(folder)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("bridge inspect: error: ") and "Traceback" not in err
    assert "--filter" not in err and "fc.weight_packed" in err


def test_packed_int4_loads(tmp_path):
    folder = _folder(tmp_path, _packed_int4(), _ct_packed(["Linear"]))
    assert bridge.load(folder, like=_like()).fc.kernel.shape == (256, 200)


@pytest.mark.parametrize(
    "shape, packed",
    [([0, 2**33], (0, 2**30)), ([2**33, 0], (2**33, 0)), ([200, 256, 1], (200, 32))],
)
def test_weight_shape_of_no_weight_is_refused(tmp_path, shape, packed):
    """`weight_shape` [0, 2**33] over an empty packed tensor was NumPy's raw
    reshape error; [2**33, 0] loaded as an empty weight."""
    state = _packed_int4()
    state["fc.weight_packed"] = np.zeros(packed, np.int32)
    state["fc.weight_shape"] = np.array(shape, np.int64)
    state["fc.weight_scale"] = np.full((1,), 0.01, np.float32)
    folder = _folder(tmp_path, state, _ct_packed(["Linear"]))
    for like in (None, _like()):
        with pytest.raises(_schemes.QuantizationError, match="fc.weight_shape: "):
            bridge.load(folder, like=like)


@pytest.mark.parametrize(
    "weight_shape",
    [
        np.array([[200, 256]], np.int64),
        np.array(200, np.int64),
        np.array([200.0, 256.0], np.float32),
    ],
    ids=["(1, 2)", "0-d", "float32"],
)
def test_weight_shape_that_is_not_two_integers_is_refused(tmp_path, weight_shape):
    """A `weight_shape` of shape (1, 2) or a 0-d one was a raw TypeError (`only
    0-dimensional arrays can be converted`, `iteration over a 0-d array`)."""
    state = _packed_int4()
    state["fc.weight_shape"] = weight_shape
    folder = _folder(tmp_path, state, _ct_packed(["Linear"]))
    for like in (None, _like()):
        with pytest.raises(
            _schemes.QuantizationError,
            match=rf"fc\.weight_shape: {weight_shape.dtype} of shape "
            + re.escape(str(weight_shape.shape))
            + ", expected 2 integers",
        ):
            bridge.load(folder, like=like)


@pytest.mark.parametrize("fmt", [["nvfp4-pack-quantized"], {"a": 1}])
def test_a_format_that_is_no_string_is_refused(tmp_path, fmt):
    """compressed-tensors' `format` as a list or an object was a raw `TypeError:
    unhashable type` on uint8 packed weights."""
    folder = _folder(tmp_path, nvfp4(), {**NVFP4, "format": fmt})
    for like in (None, _like()):
        with pytest.raises(
            _schemes.QuantizationError,
            match=r"fc\.weight_packed: uint8 packing of format .* is not supported",
        ):
            bridge.load(folder, like=like)
