"""Quantized checkpoints made by the reference tools (transformers' FP8 quantizer,
compressed-tensors' compressors, a GPTQ packer written from AutoGPTQ's published
layout, AutoAWQ's packing and dequantization code) load into NNX and Equinox
models: each weight equal to the reference dequantization bit for bit, a tiny
Llama's logits equal to transformers' with the same dequantized weights; and FP8
written out reads back."""

import json
import math
import types

import numpy as np
import pytest


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import safetensors.torch  # noqa: E402
from flax import nnx  # noqa: E402

import bridge  # noqa: E402

from . import quant_llama as ql  # noqa: E402


TOKENS = np.array([[1, 5, 9, 3, 7, 2, 8, 4]])


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Torch on one thread: on 2 shared cores its intra-op threads spin, and this
    file's small tensor ops take ~14x longer (9.9 s against 0.7 s to build the GPTQ
    folder, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_MADE: dict = {}


def _hf():
    """One tiny transformers Llama (made once: construction is slow on a busy
    machine), copied."""
    if "hf" not in _MADE:
        torch.manual_seed(0)
        config = ql.Config().hf(transformers)
        _MADE["hf"] = transformers.LlamaForCausalLM(config).eval()
    hf = _MADE["hf"]
    copy = transformers.LlamaForCausalLM(hf.config).eval()
    copy.load_state_dict(hf.state_dict())
    return copy


def _logits(state):
    """transformers' logits with `state` (dense float32 tensors) loaded strictly."""
    ref = _hf()
    ref.load_state_dict(state, strict=True)
    with torch.no_grad():
        return ref(torch.from_numpy(TOKENS)).logits.numpy()


def _target(layers, names=ql.HF, dtype=jnp.float32):
    """The Llama as an abstract target (no initialisation) made with the
    constructors of `layers`' framework."""
    if layers.seq is list:
        return eqx.filter_eval_shape(lambda: ql.make(ql.eqx_layers(), names))
    return nnx.eval_shape(lambda: ql.make(ql.nnx_layers(dtype), names))


def _write(folder, hf, state, quantization_config):
    folder.mkdir(exist_ok=True)
    state = {k: v.contiguous() for k, v in state.items()}
    safetensors.torch.save_file(
        state, folder / "model.safetensors", metadata={"format": "pt"}
    )
    hf.config.quantization_config = quantization_config
    hf.config.save_pretrained(folder)


def _assert_refused(tmp_path, target, state, quantization_config, *fragments):
    """Loading `state` with `quantization_config` into `target` (float32) raises a
    `CheckpointError` saying nothing was loaded, with each of `fragments`."""
    bad = tmp_path / "bad"
    _write(bad, _hf(), state, quantization_config)
    with pytest.raises(bridge.CheckpointError) as info:
        bridge.load(bad, like=target, dtype=jnp.float32)
    for fragment in ("nothing was loaded", *fragments):
        assert fragment in str(info.value), (fragment, str(info.value))


PROJECTIONS = tuple(ql.HF[k] for k in ("q", "k", "v", "o", "gate", "up", "down"))


def _assert_bit_equal(model, want, dtype):
    """Every linear weight of the loaded Llama `model` (NNX: `kernel`, transposed;
    Equinox: `weight`) is `dtype` and has the bits of `want`'s (a state dict)."""
    count = 0
    for i, block in enumerate(model.model.layers):
        for part in PROJECTIONS:
            layer = ql._get(block, part)
            got = layer.kernel[...].T if hasattr(layer, "kernel") else layer.weight
            ref = want[f"model.layers.{i}.{part}.weight"]
            ref = ref.view(getattr(torch, f"int{8 * ref.element_size()}")).numpy()
            assert got.dtype == dtype, (i, part, got.dtype)
            assert np.array_equal(_bits(got), ref.view(_bits(got).dtype)), (i, part)
            count += 1
    assert count == 14


def _linear(name):
    return name.endswith("proj.weight")


def _bits(array):
    array = np.asarray(array)
    return array.view(f"u{array.dtype.itemsize}")


# --- FP8 block-scaled ----------------------------------------------------------------


def _fp8_folder(tmp_path, block=(128, 128), dtype=torch.float32):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    hf = _hf().to(dtype)
    config = FineGrainedFP8Config(weight_block_size=block)
    quantizer = types.SimpleNamespace(quantization_config=config)
    state = {}
    for name, tensor in hf.state_dict().items():
        if _linear(name):
            state.update(Fp8Quantize(quantizer).convert({name: tensor}))
        else:
            state[name] = tensor
    folder = tmp_path / "fp8"
    _write(folder, hf, state, config.to_dict())

    def dequantized(dtype):
        return {
            k: Fp8Dequantize(quantizer)._dequantize_one(
                v, state[k + "_scale_inv"], output_dtype=dtype
            )
            if k + "_scale_inv" in state
            else v.to(dtype)
            for k, v in state.items()
            if not k.endswith("_scale_inv")
        }

    return folder, dequantized


def test_fp8_block_into_nnx_bfloat16_bit_equal(tmp_path):
    # as published: bfloat16 norms and embeddings, config.json's dtype bfloat16
    folder, dequantized = _fp8_folder(tmp_path, dtype=torch.bfloat16)
    want = dequantized(torch.bfloat16)
    layers = ql.nnx_layers(jnp.bfloat16)
    model = bridge.load(folder, like=_target(layers, dtype=jnp.bfloat16))
    _assert_bit_equal(model, want, jnp.bfloat16)


def test_fp8_block_llama_logits_nnx_and_equinox(tmp_path):
    folder, dequantized = _fp8_folder(tmp_path, block=(64, 128))
    want = _logits(dequantized(torch.float32))
    for layers in (ql.nnx_layers(), ql.eqx_layers()):
        model = bridge.load(folder, like=_target(layers))
        got = ql.forward(layers, ql.HF, model, jnp.asarray(TOKENS))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_fp8_block_without_like_and_inspect(tmp_path):
    folder, dequantized = _fp8_folder(tmp_path)
    tree = bridge.load(folder)
    weight = tree.model.layers[1].mlp.up_proj.weight
    ref = dequantized(torch.float32)["model.layers.1.mlp.up_proj.weight"].numpy()
    assert weight.dtype == jnp.float32 and np.array_equal(np.asarray(weight), ref)
    assert "weight_scale_inv" not in str(tree)
    from bridge._cli import main

    assert main(["inspect", str(folder)]) == 0


# --- compressed-tensors ---------------------------------------------------------------


# compressed-tensors' NVFP4A16 and MXFP4A16 presets (quantization/quant_scheme.py)
_NVFP4 = dict(
    num_bits=4,
    type="float",
    strategy="tensor_group",
    group_size=16,
    scale_dtype=torch.float8_e4m3fn,
)
_MXFP4 = dict(
    num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8
)


def _compressed_folder(tmp_path, scheme_args, fmt, dtype=torch.bfloat16):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.utils import (
        calculate_qparams,
        generate_gparam,
    )

    args = QuantizationArgs(**scheme_args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.load_from_registry(fmt)
    hf = _hf().to(dtype)
    state, want = {}, {}
    for name, tensor in hf.state_dict().items():
        if not _linear(name):
            state[name] = want[name] = tensor
            continue
        rows = tensor.shape[0]
        if args.strategy in ("group", "tensor_group"):
            grouped = tensor.reshape(rows, -1, args.group_size)
        else:
            grouped = tensor.reshape(rows, 1, -1)
        module = {"weight": tensor}
        if args.strategy == "tensor_group":  # NVFP4: a global scale
            module["weight_global_scale"] = generate_gparam(
                tensor.amin(), tensor.amax()
            )
        scale, zero = calculate_qparams(
            grouped.amin(-1),
            grouped.amax(-1),
            args,
            global_scale=module.get("weight_global_scale"),
        )
        # integer scales in the model's dtype; FP4 ones as its compressor stores them
        module["weight_scale"] = scale.to(dtype) if args.type == "int" else scale
        if not args.symmetric:
            module["weight_zero_point"] = zero
        prefix = name.removesuffix("weight")
        compressed = compressor.compress(module, scheme)
        state.update({prefix + k: v for k, v in compressed.items()})
        want[name] = compressor.decompress(compressed, scheme)["weight"]
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt)
    folder = tmp_path / fmt
    _write(folder, hf, state, config.model_dump(mode="json"))
    return folder, want


@pytest.mark.parametrize(
    "scheme, fmt",
    [
        (dict(num_bits=4, strategy="group", group_size=32), "pack-quantized"),
        (
            dict(num_bits=4, strategy="group", group_size=64, symmetric=False),
            "pack-quantized",
        ),
        (dict(num_bits=8, strategy="channel"), "int-quantized"),
        (_NVFP4, "nvfp4-pack-quantized"),
        (_MXFP4, "mxfp4-pack-quantized"),
    ],
    ids=["int4-group", "int4-asymmetric", "int8-channel", "nvfp4", "mxfp4"],
)
def test_compressed_tensors_bit_equal_and_logits(tmp_path, scheme, fmt):
    folder, want = _compressed_folder(tmp_path, {"type": "int", **scheme}, fmt)
    layers = ql.nnx_layers(jnp.bfloat16)
    model = bridge.load(folder, like=_target(layers, dtype=jnp.bfloat16))
    _assert_bit_equal(model, want, jnp.bfloat16)
    dense = {k: v.float() for k, v in want.items()}
    f32 = ql.eqx_layers()
    model = bridge.load(folder, like=_target(f32), dtype=jnp.float32)
    got = ql.forward(f32, ql.HF, model, jnp.asarray(TOKENS))
    # float32 of bfloat16 weights: the reference's own rounding, then float32 math
    np.testing.assert_allclose(np.asarray(got), _logits(dense), rtol=1e-4, atol=1e-4)


def test_fp4_inspect_and_malformed_refused(tmp_path, capsys):
    folder, _ = _compressed_folder(tmp_path, _NVFP4, "nvfp4-pack-quantized")
    from bridge._cli import main

    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "nvfp4 group 16, 4-bit: 14 weights," in out
    assert f"{983040 * 2:,} bytes dequantized" in out  # bfloat16
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    state = safetensors.torch.load_file(folder / "model.safetensors")
    target = _target(ql.eqx_layers())
    q = "model.layers.0.self_attn.q_proj."

    def refused(state, quantization, *fragments):
        _assert_refused(tmp_path, target, state, quantization, *fragments)

    missing = {k: v for k, v in state.items() if k != q + "weight_global_scale"}
    refused(
        missing,
        config,
        f"{q}weight_packed: nvfp4-pack-quantized without weight_global_scale",
    )
    wrong = dict(state, **{q + "weight_scale": state[q + "weight_scale"][:, :8]})
    refused(
        wrong,
        config,
        f"{q}weight_scale: float8_e4m3fn (256, 8), but a nvfp4-pack-quantized "
        "weight (256, 256) needs float8_e4m3fn (256, 16)",
    )
    other = json.loads(json.dumps(config))
    other["format"] = "mxfp8-quantized"
    refused(state, other, "uint8 packing of format 'mxfp8-quantized' is not supported")
    other["format"] = "nvfp4-pack-quantized"
    other["config_groups"]["group_0"]["weights"]["group_size"] = 32
    refused(state, other, "nvfp4-pack-quantized with group_size 32, expected 16")


def _mxfp4_state(prefix, experts=2, hidden=64, intermediate=32, seed=0):
    """gpt-oss's MXFP4 experts under `prefix`: random FP4 bytes (every byte is two
    valid codes) and E8M0 exponents near 2**-4, beside a dense bfloat16 router."""
    rng = np.random.default_rng(seed)
    state = {"router.weight": torch.randn(experts, hidden).bfloat16()}
    for name, (rows, cols) in {
        "gate_up_proj": (2 * intermediate, hidden),
        "down_proj": (hidden, intermediate),
    }.items():
        blocks = rng.integers(0, 256, (experts, rows, cols // 32, 16), dtype=np.uint8)
        scales = rng.integers(118, 128, (experts, rows, cols // 32), dtype=np.uint8)
        state[f"{prefix}{name}_blocks"] = torch.from_numpy(blocks)
        state[f"{prefix}{name}_scales"] = torch.from_numpy(scales)
    return state


def _mxfp4_folder(folder, state, config):
    folder.mkdir()
    safetensors.torch.save_file(
        state, folder / "model.safetensors", metadata={"format": "pt"}
    )
    (folder / "config.json").write_text(json.dumps({"dtype": "bfloat16", **config}))
    return folder


def test_mxfp4_blocks_equal_transformers(tmp_path, capsys):
    """gpt-oss's packing, dequantized as transformers' `convert_moe_packed_tensors`
    does it, in bfloat16 and float32 (under a module name bridge's packed-experts
    reading leaves alone: gpt-oss's own `mlp.experts` is refused, below)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = _mxfp4_state("moe.")
    mxfp4 = {"quantization_config": {"quant_method": "mxfp4"}}
    folder = _mxfp4_folder(tmp_path / "mxfp4", state, mxfp4)
    for dtype, jdtype in ((torch.bfloat16, None), (torch.float32, jnp.float32)):
        tree = bridge.load(folder, dtype=jdtype)
        for name in ("gate_up_proj", "down_proj"):
            want = convert_moe_packed_tensors(
                state[f"moe.{name}_blocks"], state[f"moe.{name}_scales"], dtype=dtype
            )
            got = getattr(tree.moe, name)
            assert got.shape == tuple(want.shape)  # (experts, in, out)
            assert got.dtype == jnp.dtype(str(dtype).removeprefix("torch."))
            want = want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
            assert np.array_equal(_bits(got), want.numpy().view(_bits(got).dtype))
    assert tree.moe.gate_up_proj.shape == (2, 64, 64)
    assert tree.moe.down_proj.shape == (2, 32, 64)
    from bridge._cli import main

    assert main(["inspect", str(folder)]) == 0
    assert "mxfp4-blocks group 32, 4-bit: 2 weights," in capsys.readouterr().out
    plain = _mxfp4_folder(tmp_path / "plain", state, {})
    with pytest.raises(bridge.CheckpointError, match="quant_method 'mxfp4'"):
        bridge.load(plain)
    experts = _mxfp4_state("model.layers.0.mlp.experts.")
    gpt_oss = _mxfp4_folder(tmp_path / "gpt-oss", experts, mxfp4)
    with pytest.raises(bridge.CheckpointError, match="gpt-oss's MXFP4 experts are not"):
        bridge.load(gpt_oss)


# compressed-tensors 0.20 no longer reads activation order (`actorder: group`, removed
# 2026-08-27), but checkpoints made with it (`weight_g_idx`) are published. The
# reference is compressed-tensors 0.10.2's dequantization (`dequantize(x_q, scale,
# zero_point, g_idx=...)`, quantization/lifecycle/forward.py `_process_quantization`
# group branch and `_dequantize`), copied here for the symmetric case it decompressed.


def _ct_0_10_dequantize(x_q, scale, g_idx, group_size):
    dtype = scale.dtype
    columns = x_q.shape[1]
    is_column_order = g_idx is None or -1 in g_idx
    if not is_column_order:
        perm = torch.argsort(g_idx)
        x_q = x_q[:, perm]
    x_q = torch.reshape(
        x_q, (x_q.shape[0], math.ceil(columns / group_size), group_size)
    )
    scale = scale.unsqueeze(-1)
    output = x_q.to(scale.dtype) * scale  # `_dequantize`, no zero point
    output = torch.reshape(output, (output.shape[0], output.shape[1] * output.shape[2]))
    output = output.to(dtype)
    if not is_column_order:
        output = output[:, torch.argsort(perm)]
    return output


def _ct_actorder_folder(tmp_path, fmt, bits, group_size=32, dtype=torch.bfloat16):
    """Weights quantized per group of columns in a random (activation) order by
    compressed-tensors' own `calculate_qparams`, `quantize` and `pack_to_int32`,
    stored with `weight_g_idx` as llm-compressor's GPTQ with `actorder: group` did."""
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=bits, strategy="group", group_size=group_size)
    generator = torch.Generator().manual_seed(0)

    def pack(name, weight):
        weight = weight.to(dtype)
        rows, columns = weight.shape
        perm = torch.randperm(columns, generator=generator)
        g_idx = (torch.argsort(perm) // group_size).to(torch.int32)
        ordered = weight[:, perm]
        grouped = ordered.reshape(rows, -1, group_size)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        scale = scale.to(dtype)
        q = quantize(ordered, scale, zero, args, dtype=torch.int8)[
            :, torch.argsort(perm)
        ]
        parts = {"weight": q, "weight_scale": scale, "weight_g_idx": g_idx}
        if fmt == "pack-quantized":
            del parts["weight"]
            packed = pack_to_int32(q, bits)
            q = unpack_from_int32(packed, bits, torch.Size(weight.shape))
            parts["weight_packed"] = packed
            parts["weight_shape"] = torch.tensor(weight.shape)
        return parts, _ct_0_10_dequantize(q, scale, g_idx, group_size)

    hf, state, want = _quantized_state(pack)
    hf = hf.to(dtype)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    want = {k: v.to(dtype) for k, v in want.items()}  # as the folder holds them
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt)
    config = config.model_dump(mode="json")
    config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    folder = tmp_path / "actorder"
    _write(folder, hf, state, config)
    return folder, state, want


@pytest.mark.parametrize("fmt, bits", [("pack-quantized", 4), ("int-quantized", 8)])
def test_compressed_tensors_activation_order_bit_equal_and_logits(tmp_path, fmt, bits):
    folder, state, want = _ct_actorder_folder(tmp_path, fmt, bits)
    g_idx = state["model.layers.1.mlp.up_proj.weight_g_idx"]
    assert (g_idx[1:] < g_idx[:-1]).any()  # not in column order
    layers = ql.nnx_layers(jnp.bfloat16)
    model = bridge.load(folder, like=_target(layers, dtype=jnp.bfloat16))
    _assert_bit_equal(model, want, jnp.bfloat16)
    plain = {k: v.float() for k, v in want.items()}
    f32 = ql.eqx_layers()
    model = bridge.load(folder, like=_target(f32), dtype=jnp.float32)
    got = ql.forward(f32, ql.HF, model, jnp.asarray(TOKENS))
    np.testing.assert_allclose(np.asarray(got), _logits(plain), rtol=1e-4, atol=1e-4)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    q = "model.layers.0.self_attn.q_proj."
    bad = tmp_path / "bad"
    missing = {k: v for k, v in state.items() if k != q + "weight_g_idx"}
    _write(bad, _hf(), missing, config)
    with pytest.raises(
        bridge.CheckpointError, match="actorder 'group', but no weight_g_idx"
    ):
        bridge.load(bad, like=_target(f32))
    wrong = dict(state)
    wrong[q + "weight_g_idx"] = state[q + "weight_g_idx"][:-1]
    _write(bad, _hf(), wrong, config)
    with pytest.raises(
        bridge.CheckpointError,
        match=r"weight_g_idx: int32 \(255,\), expected integers \(256,\)",
    ):
        bridge.load(bad, like=_target(f32))


# --- GPTQ ---------------------------------------------------------------------------
# AutoGPTQ's own code (github.com/AutoGPTQ/AutoGPTQ at 9f7d370), copied: it needs its
# CUDA extension to import. Packing: auto_gptq/nn_modules/qlinear/qlinear_cuda.py
# `QuantLinear.pack` (2, 3, 4, 8 bits, any g_idx); dequantization: the same class's
# `forward` without CUDA (its `wf` shifts, the 3-bit words stitched, then
# `scales[g_idx] * (weight - zeros[g_idx])`). The quantizer is GPTQ's min-max one
# (auto_gptq/quantization/quantizer.py `find_params`, per channel, asymmetric) taking
# the columns in activation order with `desc_act` (gptq.py `fasterquant`: `perm`,
# `g_idx = [perm position // group_size]`), without GPTQ's error feedback.


def _gptq_quantize(weight, bits, group_size, perm):
    """`(Q, scale, zero, g_idx)`: `weight` (out, in) quantized per group of
    `group_size` columns taken in the order `perm`, as `fasterquant` returns them."""
    maxq = 2**bits - 1
    w = weight.float()[:, perm]
    scales, zeros, q = [], [], torch.zeros_like(w)
    for i in range(0, w.shape[1], group_size):
        x = w[:, i : i + group_size]
        tmp = torch.zeros(x.shape[0])
        xmin = torch.minimum(x.min(1)[0], tmp)
        xmax = torch.maximum(x.max(1)[0], tmp)
        tmp = (xmin == 0) & (xmax == 0)
        xmin[tmp], xmax[tmp] = -1, +1
        scale = ((xmax - xmin) / maxq).unsqueeze(1)
        zero = torch.round(-xmin.unsqueeze(1) / scale)
        qx = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
        q[:, i : i + group_size] = scale * (qx - zero)
        scales.append(scale)
        zeros.append(zero)
    invperm = torch.argsort(perm)
    g_idx = torch.tensor(
        [i // group_size for i in range(w.shape[1])], dtype=torch.int32
    )
    return q[:, invperm], torch.cat(scales, 1), torch.cat(zeros, 1), g_idx[invperm]


def _autogptq_pack(W, scales, zeros, g_idx, bits):
    """`QuantLinear.pack` of a float16 linear of weight `W`: `(qweight, qzeros,
    scales)`."""
    infeatures = W.shape[1]
    scales = scales.t().contiguous()
    zeros = zeros.t().contiguous()
    scale_zeros = zeros * scales
    scales = scales.clone().to(dtype=W.dtype)
    intweight = []
    for idx in range(infeatures):
        intweight.append(
            torch.round((W[:, idx] + scale_zeros[g_idx[idx]]) / scales[g_idx[idx]]).to(
                torch.int
            )[:, None]
        )
    intweight = torch.cat(intweight, dim=1)
    intweight = intweight.t().contiguous()
    intweight = intweight.numpy().astype(np.uint32)
    i = 0
    row = 0
    qweight = np.zeros(
        (intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32
    )
    while row < qweight.shape[0]:
        if bits in [2, 4, 8]:
            for j in range(i, i + (32 // bits)):
                qweight[row] |= intweight[j] << (bits * (j - i))
            i += 32 // bits
            row += 1
        elif bits == 3:
            for j in range(i, i + 10):
                qweight[row] |= intweight[j] << (3 * (j - i))
            i += 10
            qweight[row] |= intweight[i] << 30
            row += 1
            qweight[row] |= (intweight[i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                qweight[row] |= intweight[j] << (3 * (j - i) + 1)
            i += 10
            qweight[row] |= intweight[i] << 31
            row += 1
            qweight[row] |= (intweight[i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                qweight[row] |= intweight[j] << (3 * (j - i) + 2)
            i += 10
            row += 1
    qweight = qweight.astype(np.int32)
    zeros -= 1
    zeros = zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i = 0
    col = 0
    while col < qzeros.shape[1]:
        if bits in [2, 4, 8]:
            for j in range(i, i + (32 // bits)):
                qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
            i += 32 // bits
            col += 1
        elif bits == 3:
            for j in range(i, i + 10):
                qzeros[:, col] |= zeros[:, j] << (3 * (j - i))
            i += 10
            qzeros[:, col] |= zeros[:, i] << 30
            col += 1
            qzeros[:, col] |= (zeros[:, i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                qzeros[:, col] |= zeros[:, j] << (3 * (j - i) + 1)
            i += 10
            qzeros[:, col] |= zeros[:, i] << 31
            col += 1
            qzeros[:, col] |= (zeros[:, i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                qzeros[:, col] |= zeros[:, j] << (3 * (j - i) + 2)
            i += 10
            col += 1
    qzeros = qzeros.astype(np.int32)
    return torch.from_numpy(qweight), torch.from_numpy(qzeros), scales


def _autogptq_dequantize(qweight, qzeros, scales, g_idx, bits):
    """`QuantLinear.forward`'s weights without CUDA: `(in, out)` in the scales'
    dtype."""
    if bits in [2, 4, 8]:
        wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
        zeros = torch.bitwise_right_shift(
            torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits),
            wf.unsqueeze(0),
        ).to(torch.int16 if bits == 8 else torch.int8)
        zeros = torch.bitwise_and(zeros, (2**bits) - 1)
        zeros = zeros + 1
        zeros = zeros.reshape(scales.shape)
        weight = torch.bitwise_right_shift(
            torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1),
            wf.unsqueeze(-1),
        ).to(torch.int16 if bits == 8 else torch.int8)
        weight = torch.bitwise_and(weight, (2**bits) - 1)
    else:
        wf = torch.tensor(
            [
                [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 0],
                [0, 1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31],
                [0, 2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 0],
            ],
            dtype=torch.int32,
        ).reshape(1, 3, 12)
        zeros = qzeros.reshape(qzeros.shape[0], qzeros.shape[1] // 3, 3, 1).expand(
            -1, -1, -1, 12
        )
        zeros = zeros >> wf.unsqueeze(0)
        zeros[:, :, 0, 10] = (zeros[:, :, 0, 10] & 0x3) | (
            (zeros[:, :, 1, 0] << 2) & 0x4
        )
        zeros[:, :, 1, 11] = (zeros[:, :, 1, 11] & 0x1) | (
            (zeros[:, :, 2, 0] << 1) & 0x6
        )
        zeros = zeros & 0x7
        zeros = torch.cat(
            [zeros[:, :, 0, :11], zeros[:, :, 1, 1:12], zeros[:, :, 2, 1:11]], dim=2
        )
        zeros = zeros + 1
        zeros = zeros.reshape(scales.shape)
        weight = qweight.reshape(qweight.shape[0] // 3, 3, 1, qweight.shape[1]).expand(
            -1, -1, 12, -1
        )
        weight = (weight >> wf.unsqueeze(-1)) & 0x7
        weight[:, 0, 10] = (weight[:, 0, 10] & 0x3) | ((weight[:, 1, 0] << 2) & 0x4)
        weight[:, 1, 11] = (weight[:, 1, 11] & 0x1) | ((weight[:, 2, 0] << 1) & 0x6)
        weight = weight & 0x7
        weight = torch.cat(
            [weight[:, 0, :11], weight[:, 1, 1:12], weight[:, 2, 1:11]], dim=1
        )
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    return scales[g_idx.long()] * (weight - zeros[g_idx.long()])


def _quantized_state(pack):
    """`(hf, state, want)`: the tiny Llama's state with each linear weight replaced
    by the tensors `pack(name, weight)` returns (`{part: tensor}`, the reference
    dequantization), `want` the dense state."""
    hf = _hf()
    state, want = {}, {}
    for name, tensor in hf.state_dict().items():
        if not _linear(name):
            state[name] = want[name] = tensor
            continue
        parts, dense = pack(name, tensor)
        prefix = name.removesuffix("weight")
        state.update({prefix + k: v for k, v in parts.items()})
        want[name] = dense
    return hf, state, want


def _gptq_folder(tmp_path, bits, desc_act, group_size=32):
    generator = torch.Generator().manual_seed(bits)

    def pack(name, weight):
        columns = weight.shape[1]
        if desc_act:
            perm = torch.randperm(columns, generator=generator)
        else:
            perm = torch.arange(columns)
        q, scale, zero, g_idx = _gptq_quantize(weight, bits, group_size, perm)
        qweight, qzeros, scales = _autogptq_pack(q.half(), scale, zero, g_idx, bits)
        dense = _autogptq_dequantize(qweight, qzeros, scales, g_idx, bits)
        parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
        return parts, dense.T.contiguous()

    hf, state, want = _quantized_state(pack)
    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": False,
    }
    folder = tmp_path / "gptq"
    _write(folder, hf, state, config)
    return folder, state, want


@pytest.mark.parametrize(
    "bits, desc_act", [(4, False), (8, False), (3, True), (4, True)]
)
def test_gptq_bit_equal_and_logits(tmp_path, bits, desc_act):
    folder, state, want = _gptq_folder(tmp_path, bits, desc_act)
    g_idx = state["model.layers.0.mlp.gate_proj.g_idx"]
    assert bool((g_idx[1:] < g_idx[:-1]).any()) == desc_act  # out of order
    layers = ql.eqx_layers()
    model = bridge.load(folder, like=_target(layers), dtype=jnp.float16)
    _assert_bit_equal(model, want, jnp.float16)
    model = bridge.load(folder, like=_target(layers), dtype=jnp.float32)
    got = ql.forward(layers, ql.HF, model, jnp.asarray(TOKENS))
    dense = {k: v.float() for k, v in want.items()}
    np.testing.assert_allclose(np.asarray(got), _logits(dense), rtol=1e-4, atol=1e-4)


def test_gptq_malformed_refused(tmp_path):
    folder, state, _ = _gptq_folder(tmp_path, 3, True)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    target = _target(ql.eqx_layers())
    q = "model.layers.0.self_attn.q_proj."

    def refused(state, quantization, *fragments):
        _assert_refused(tmp_path, target, state, quantization, *fragments)

    no_g_idx = {k: v for k, v in state.items() if k != q + "g_idx"}
    refused(no_g_idx, config, f"{q}qweight: desc_act (activation order), but no")
    wrong = dict(state)
    wrong[q + "g_idx"] = state[q + "g_idx"] + 1  # one past the last group
    refused(wrong, config, f"{q}g_idx: group indices from 1 to 8, expected 0 to 7")
    wrong[q + "g_idx"] = state[q + "g_idx"][:100]
    refused(wrong, config, f"{q}g_idx: int32 (100,), expected integers (256,)")
    refused(state, dict(config, bits=5), f"{q}qweight: GPTQ with 5 bits")


# --- AWQ ----------------------------------------------------------------------------
# AutoAWQ's own code (github.com/casper-hansen/AutoAWQ at 88e4c76), copied: it needs
# CUDA kernels or triton to import. Quantization: awq/quantize/quantizer.py
# `pseudo_quantize_tensor` (zero_point) and `_apply_quant` (GEMM: scales and zeros
# transposed); packing: awq/modules/linear/gemm.py `WQLinear_GEMM.from_linear`;
# dequantization: awq/utils/packing_utils.py `unpack_awq`, `reverse_awq_order`,
# `dequantize_gemm`.

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def _awq_pseudo_quantize_tensor(w, w_bit, group_size):
    org_w_shape = w.shape
    w = w.reshape(-1, group_size)
    max_val = w.amax(dim=1, keepdim=True)
    min_val = w.amin(dim=1, keepdim=True)
    max_int = 2**w_bit - 1
    min_int = 0
    scales = (max_val - min_val).clamp(min=1e-5) / max_int
    zeros = (-torch.round(min_val / scales)).clamp_(min_int, max_int)
    w = (
        torch.clamp(torch.round(w / scales) + zeros, min_int, max_int) - zeros
    ) * scales
    zeros = zeros.view(org_w_shape[0], -1)
    scales = scales.view(org_w_shape[0], -1)
    w = w.reshape(org_w_shape)
    return w, scales, zeros


def _awq_from_linear(weight, w_bit, group_size, scales, zeros):
    in_features, out_features = weight.shape[1], weight.shape[0]
    scale_zeros = zeros * scales
    scales = scales.clone().half()
    pack_num = 32 // w_bit
    intweight = []
    for idx in range(in_features):
        intweight.append(
            torch.round(
                (weight[:, idx] + scale_zeros[idx // group_size])
                / scales[idx // group_size]
            ).to(torch.int)[:, None]
        )
    intweight = torch.cat(intweight, dim=1)
    intweight = intweight.t().contiguous()
    intweight = intweight.to(dtype=torch.int32)
    qweight = torch.zeros(
        (intweight.shape[0], intweight.shape[1] // 32 * w_bit), dtype=torch.int32
    )
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight_col = intweight[:, col * pack_num + order_map[i]]
            qweight[:, col] |= qweight_col << (i * w_bit)
    zeros = zeros.to(dtype=torch.int32)
    qzeros = torch.zeros(
        (zeros.shape[0], zeros.shape[1] // 32 * w_bit), dtype=torch.int32
    )
    for col in range(zeros.shape[1] // pack_num):
        for i in range(pack_num):
            qzero_col = zeros[:, col * pack_num + order_map[i]]
            qzeros[:, col] |= qzero_col << (i * w_bit)
    assert out_features == scales.shape[1]
    return qweight, qzeros, scales


def _awq_unpack_awq(qweight, qzeros, bits):
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(
        torch.int8
    )
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(
        torch.int8
    )
    izeros = izeros.view(izeros.shape[0], -1)
    return iweights, izeros


def _awq_reverse_awq_order(iweights, izeros, bits):
    reverse_order_tensor = torch.arange(iweights.shape[-1], dtype=torch.int32)
    reverse_order_tensor = reverse_order_tensor.view(-1, 32 // bits)
    reverse_order_tensor = reverse_order_tensor[:, AWQ_REVERSE_ORDER]
    reverse_order_tensor = reverse_order_tensor.view(-1)
    izeros = izeros[:, reverse_order_tensor]
    iweights = iweights[:, reverse_order_tensor]
    return iweights, izeros


def _awq_dequantize_gemm(qweight, qzeros, scales, bits, group_size):
    iweight, izeros = _awq_unpack_awq(qweight, qzeros, bits)
    iweight, izeros = _awq_reverse_awq_order(iweight, izeros, bits)
    iweight = torch.bitwise_and(iweight, (2**bits) - 1)
    izeros = torch.bitwise_and(izeros, (2**bits) - 1)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    iweight = (iweight - izeros) * scales
    return iweight


def _awq_folder(tmp_path, group_size=32):
    """A tiny Llama quantized and packed by AutoAWQ's code, and its reference
    dequantization (float16, PyTorch layout)."""

    def pack(name, weight):
        w, scales, zeros = _awq_pseudo_quantize_tensor(weight.half(), 4, group_size)
        scales, zeros = scales.t().contiguous(), zeros.t().contiguous()
        qweight, qzeros, scales = _awq_from_linear(w, 4, group_size, scales, zeros)
        dense = _awq_dequantize_gemm(qweight, qzeros, scales, 4, group_size)
        parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
        return parts, dense.T.contiguous()

    hf, state, want = _quantized_state(pack)
    config = {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    folder = tmp_path / "awq"
    _write(folder, hf, state, config)
    return folder, want


def test_awq_bit_equal_and_logits(tmp_path, capsys):
    folder, want = _awq_folder(tmp_path)
    layers = ql.eqx_layers()
    model = bridge.load(folder, like=_target(layers), dtype=jnp.float16)
    _assert_bit_equal(model, want, jnp.float16)
    model = bridge.load(folder, like=_target(layers), dtype=jnp.float32)
    got = ql.forward(layers, ql.HF, model, jnp.asarray(TOKENS))
    dense = {k: v.float() for k, v in want.items()}
    np.testing.assert_allclose(np.asarray(got), _logits(dense), rtol=1e-4, atol=1e-4)
    from bridge._cli import main

    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "awq group 32, 4-bit: 14 weights," in out
    dense_bytes = 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 384) * 4
    assert f"{dense_bytes:,} bytes dequantized" in out


def test_awq_malformed_refused(tmp_path):
    folder, _ = _awq_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    state = safetensors.torch.load_file(folder / "model.safetensors")
    target = _target(ql.eqx_layers())

    def refused(state, quantization, *fragments):
        _assert_refused(tmp_path, target, state, quantization, *fragments)

    q = "model.layers.0.self_attn.q_proj."
    gemv = dict(config["quantization_config"], version="gemv")
    refused(state, gemv, f"{q}qweight: AWQ version 'gemv' is not supported")
    three = dict(config["quantization_config"], bits=3)
    refused(state, three, f"{q}qweight: AWQ with 3 bits is not supported")
    wrong = dict(state)
    wrong[q + "scales"] = state[q + "scales"][:4]
    refused(
        wrong,
        config["quantization_config"],
        f"{q}scales: shape (4, 256), but a qweight (256, 32) in groups of 32 "
        "needs (8, 256)",
    )
    missing = {k: v for k, v in state.items() if k != q + "qzeros"}
    refused(
        missing,
        config["quantization_config"],
        f"{q}qweight: GPTQ/AWQ-packed without qzeros",
    )


# --- FP8 out ------------------------------------------------------------------------


def test_fp8_out_matches_transformers_quantizer_and_round_trips(tmp_path):
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    hf = _hf()
    layers = ql.nnx_layers()
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    model = bridge.port(bridge.from_torch(state), _target(layers))
    folder = tmp_path / "out"
    folder.mkdir()
    bridge.save_quantized(folder / "model.safetensors", model, "fp8-block")
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    written = safetensors.torch.load_file(folder / "model.safetensors")
    quantizer = types.SimpleNamespace(
        quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128))
    )
    name = "model.layers.0.mlp.down_proj.weight"
    ref = Fp8Quantize(quantizer).convert({name: hf.state_dict()[name]})
    assert written[name].dtype == torch.float8_e4m3fn
    assert torch.equal(written[name].view(torch.uint8), ref[name].view(torch.uint8))
    assert torch.equal(written[name + "_scale_inv"], ref[name + "_scale_inv"])
    # unquantized: embeddings, norms, the head
    assert written["model.embed_tokens.weight"].dtype == torch.float32
    assert written["lm_head.weight"].dtype == torch.float32
    back = bridge.load(folder, like=_target(layers))
    got = ql.forward(layers, ql.HF, back, jnp.asarray(TOKENS))
    with torch.no_grad():
        want = hf(torch.from_numpy(TOKENS)).logits.numpy()
    assert np.abs(np.asarray(got) - want).max() < 0.1 * np.abs(want).max()
    # a model already FP8 (dequantized from this file) is written with the same bits
    again = tmp_path / "again"
    again.mkdir()
    bridge.save_quantized(again / "model.safetensors", back, "fp8-block")
    rewritten = safetensors.torch.load_file(again / "model.safetensors")
    for k, v in written.items():
        if v.dtype == torch.float8_e4m3fn:
            assert torch.equal(rewritten[k].view(torch.uint8), v.view(torch.uint8)), k
        else:
            assert torch.equal(rewritten[k], v), k


# --- GGUF -----------------------------------------------------------------------------


def _permute(w, heads):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (each head's rotary
    halves interleaved)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w, heads):
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _gguf_llama(tmp_path):
    """`(path, {GGUF name: HF name}, {GGUF name: (stored, type)})`: the tiny Llama
    written as llama.cpp's converter does (GGUF names, q/k rows permuted) by gguf's
    writer, each 2-D weight quantized by its kind's type."""
    from . import test_quant_gguf as tg

    c = ql.Config()
    hf = {k: v.numpy() for k, v in _hf().state_dict().items()}
    to_gguf = {}
    for name in hf:
        out = name
        for role, hf_name in ql.HF.items():
            out = out.replace(hf_name + ".", ql.GGUF[role] + ".")
        to_gguf[name] = out
    dense = {}
    for name, w in hf.items():
        g = to_gguf[name]
        if ".attn_q." in g:
            w = _permute(w, c.heads)
        elif ".attn_k." in g:
            w = _permute(w, c.kv_heads)
        dense[g] = w
    stored = tg.gguf_state(dense)
    path = tmp_path / "llama.gguf"
    tg.write_gguf(path, stored)
    return path, to_gguf, stored


def test_gguf_llama_logits_equal_transformers(tmp_path):
    from . import test_quant_gguf as tg

    c = ql.Config()
    path, to_gguf, stored = _gguf_llama(tmp_path)
    reference = tg.dequantized(stored)  # gguf's own dequantization
    state = {}
    for name, g in to_gguf.items():
        w = reference[g]
        if ".attn_q." in g:
            w = _unpermute(w, c.heads)
        elif ".attn_k." in g:
            w = _unpermute(w, c.kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    want = _logits(state)
    layers = ql.eqx_layers()
    model = bridge.load(path, like=_target(layers, ql.GGUF))
    got = ql.forward(layers, ql.GGUF, model, jnp.asarray(TOKENS))
    # float32 through other summation orders, on logits up to ~100 (the K-quant
    # blocks are random bytes)
    atol = 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=atol)


def test_gguf_into_hugging_face_names_equals_transformers(tmp_path):
    """A GGUF Llama loads into a model with Hugging Face's names, each tensor equal
    to what transformers' `load_gguf_checkpoint` reads from the same file (renamed,
    q/k rows un-permuted), the logits to `LlamaForCausalLM`'s with those tensors."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, _, _ = _gguf_llama(tmp_path)
    want = load_gguf_checkpoint(path, return_tensors=True, model_to_load=_hf())
    want = want["tensors"]
    assert len(want) == 2 + 2 * 9 + 1  # every tensor, under Hugging Face's names
    layers = ql.eqx_layers()
    model = bridge.load(path, like=_target(layers))
    for i, block in enumerate(model.model.layers):
        for part in ql.HF.values():
            if "." in part and not part.startswith("model."):
                got = np.asarray(ql._get(block, part).weight)
                ref = want[f"model.layers.{i}.{part}.weight"].numpy()
                assert np.array_equal(_bits(got), _bits(ref)), (i, part)
    ref = want["model.embed_tokens.weight"].numpy()
    assert np.array_equal(np.asarray(model.model.embed_tokens.weight), ref)
    got = ql.forward(layers, ql.HF, model, jnp.asarray(TOKENS))
    logits = _logits({k: v.float() for k, v in want.items()})
    atol = 1e-5 * np.abs(logits).max()  # float32 in other orders, logits up to ~100
    np.testing.assert_allclose(np.asarray(got), logits, rtol=1e-4, atol=atol)
    nnx_model = bridge.load(path, like=_target(ql.nnx_layers()))
    kernel = nnx_model.model.layers[1].self_attn.k_proj.kernel[...]
    ref = want["model.layers.1.self_attn.k_proj.weight"].numpy()
    assert np.array_equal(np.asarray(kernel).T, ref)
    # GGUF-named models still load the file as it is
    gguf_model = bridge.load(path, like=_target(layers, ql.GGUF))
    assert gguf_model.blk[0].attn_q.weight.shape == (256, 256)


def test_gguf_llama_unpermute_equals_transformers():
    """Weights and biases (llama.cpp permutes a q/k bias's rows too)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from bridge._families import _gguf_llama

    reverse = LlamaTensorProcessor(config={})._reverse_permute_weights
    for shape in [(16,), (16, 3)]:
        w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        for heads in (1, 2, 4):
            want = reverse(w, heads, heads)
            assert np.array_equal(_gguf_llama.unpermute(w, heads), want)
    assert _gguf_llama.hf_name("blk.2.attn_k.bias") == (
        "model.layers.2.self_attn.k_proj.bias",
        "attention.head_count_kv",
    )
    assert _gguf_llama.hf_name("rope_freqs.weight") is None
