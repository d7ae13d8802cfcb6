"""Quantized checkpoints made by the reference tools (transformers' FP8 quantizer,
compressed-tensors' compressors, a GPTQ packer written from AutoGPTQ's published
layout, AutoAWQ's packing and dequantization code) load into NNX and Equinox
models: each weight equal to the reference dequantization bit for bit, a tiny
Llama's logits equal to transformers' with the same dequantized weights; and FP8
written out reads back."""

import json
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
    for i, block in enumerate(model.model.layers):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
            kernel = ql._get(block, part).kernel[...]
            ref = want[f"model.layers.{i}.{part}.weight"].view(torch.int16).numpy()
            assert kernel.dtype == jnp.bfloat16
            assert np.array_equal(_bits(kernel).T, ref.view(np.uint16))


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


def _compressed_folder(tmp_path, scheme_args, fmt, dtype=torch.bfloat16):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

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
        if args.strategy == "group":
            grouped = tensor.reshape(rows, -1, args.group_size)
        else:
            grouped = tensor.reshape(rows, 1, -1)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module = {"weight": tensor, "weight_scale": scale.to(dtype)}
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
    ],
    ids=["int4-group", "int4-asymmetric", "int8-channel"],
)
def test_compressed_tensors_bit_equal_and_logits(tmp_path, scheme, fmt):
    folder, want = _compressed_folder(tmp_path, {"type": "int", **scheme}, fmt)
    layers = ql.nnx_layers(jnp.bfloat16)
    model = bridge.load(folder, like=_target(layers, dtype=jnp.bfloat16))
    kernel = model.model.layers[1].self_attn.v_proj.kernel[...]
    ref = want["model.layers.1.self_attn.v_proj.weight"]
    assert np.array_equal(
        _bits(kernel).T, ref.view(torch.int16).numpy().view(np.uint16)
    )
    dense = {k: v.float() for k, v in want.items()}
    f32 = ql.eqx_layers()
    model = bridge.load(folder, like=_target(f32), dtype=jnp.float32)
    got = ql.forward(f32, ql.HF, model, jnp.asarray(TOKENS))
    # float32 of bfloat16 weights: the reference's own rounding, then float32 math
    np.testing.assert_allclose(np.asarray(got), _logits(dense), rtol=1e-4, atol=1e-4)


# --- GPTQ ---------------------------------------------------------------------------


def _gptq_pack(weight, bits, group_size):
    """`(qweight, qzeros, scales, g_idx, dequantized)` of a float32 `(out, in)` weight:
    asymmetric min-max quantization per group of input rows, packed in AutoGPTQ's
    published layout (value `j` of a word at bit `bits * j`; `qweight` packs
    consecutive input rows, `qzeros` consecutive output columns, zeros stored minus
    one), element by element; dequantized as AutoGPTQ's forward does it
    (`scales * (q - (zeros + 1))` in float16)."""
    w = weight.T.numpy().astype(np.float32)  # (in, out)
    rows, cols = w.shape
    groups = rows // group_size
    maxq = 2**bits - 1
    g = w.reshape(groups, group_size, cols)
    lo, hi = np.minimum(g.min(1), 0), np.maximum(g.max(1), 0)
    scales = ((hi - lo) / maxq).astype(np.float16)
    scales[scales == 0] = 1
    zeros = np.clip(np.round(-lo / scales.astype(np.float32)), 0, maxq).astype(np.int64)
    g_idx = np.arange(rows, dtype=np.int32) // group_size
    q = np.clip(
        np.round(w / scales[g_idx].astype(np.float32)) + zeros[g_idx], 0, maxq
    ).astype(np.int64)
    per = 32 // bits
    qweight = np.zeros((rows // per, cols), np.uint32)
    for r in range(rows):
        qweight[r // per] |= (q[r] << (bits * (r % per))).astype(np.uint32)
    qzeros = np.zeros((groups, cols // per), np.uint32)
    for c in range(cols):
        qzeros[:, c // per] |= ((zeros[:, c] - 1) << (bits * (c % per))).astype(
            np.uint32
        )
    tq, tz = torch.from_numpy(q).to(torch.int16), torch.from_numpy(zeros)
    ts = torch.from_numpy(scales)
    deq = ts[g_idx] * (tq - tz[g_idx]).to(torch.int16)  # float16, as AutoGPTQ's
    return (
        torch.from_numpy(qweight.view(np.int32)),
        torch.from_numpy(qzeros.view(np.int32)),
        ts,
        torch.from_numpy(g_idx),
        deq.T.contiguous(),
    )


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_bit_equal_and_logits(tmp_path, bits):
    hf = _hf()
    state, want = {}, {}
    for name, tensor in hf.state_dict().items():
        if not _linear(name):
            state[name] = want[name] = tensor
            continue
        prefix = name.removesuffix("weight")
        qweight, qzeros, scales, g_idx, deq = _gptq_pack(tensor, bits, 32)
        state.update(
            {
                prefix + "qweight": qweight,
                prefix + "qzeros": qzeros,
                prefix + "scales": scales,
                prefix + "g_idx": g_idx,
            }
        )
        want[name] = deq
    config = {"quant_method": "gptq", "bits": bits, "group_size": 32, "sym": False}
    folder = tmp_path / "gptq"
    _write(folder, hf, state, config)
    layers = ql.eqx_layers()
    model = bridge.load(folder, like=_target(layers), dtype=jnp.float16)
    weight = model.model.layers[0].mlp.gate_proj.weight
    ref = want["model.layers.0.mlp.gate_proj.weight"].numpy()
    assert weight.dtype == jnp.float16 and np.array_equal(_bits(weight), _bits(ref))
    model = bridge.load(folder, like=_target(layers), dtype=jnp.float32)
    got = ql.forward(layers, ql.HF, model, jnp.asarray(TOKENS))
    dense = {k: v.float() for k, v in want.items()}
    np.testing.assert_allclose(np.asarray(got), _logits(dense), rtol=1e-4, atol=1e-4)


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
    hf = _hf()
    state, want = {}, {}
    for name, tensor in hf.state_dict().items():
        if not _linear(name):
            state[name] = want[name] = tensor
            continue
        w, scales, zeros = _awq_pseudo_quantize_tensor(tensor.half(), 4, group_size)
        scales, zeros = scales.t().contiguous(), zeros.t().contiguous()
        qweight, qzeros, scales = _awq_from_linear(w, 4, group_size, scales, zeros)
        prefix = name.removesuffix("weight")
        state.update(
            {
                prefix + "qweight": qweight,
                prefix + "qzeros": qzeros,
                prefix + "scales": scales,
            }
        )
        deq = _awq_dequantize_gemm(qweight, qzeros, scales, 4, group_size)
        want[name] = deq.T.contiguous()
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
    for i, block in enumerate(model.model.layers):
        for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            weight = ql._get(block, part).weight
            ref = want[f"model.layers.{i}.{part}.weight"].numpy()
            assert weight.dtype == jnp.float16
            assert np.array_equal(_bits(weight), _bits(ref)), (i, part)
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
        bad = tmp_path / "bad"
        _write(bad, _hf(), state, quantization)
        with pytest.raises(bridge.CheckpointError) as info:
            bridge.load(bad, like=target)
        for fragment in ("nothing was loaded", *fragments):
            assert fragment in str(info.value), (fragment, str(info.value))

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
    bridge.save(
        folder / "model.safetensors", model, layout="torch", quantize="fp8-block"
    )
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
    bridge.save(again / "model.safetensors", back, layout="torch", quantize="fp8-block")
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


def test_gguf_llama_logits_equal_transformers(tmp_path):
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
