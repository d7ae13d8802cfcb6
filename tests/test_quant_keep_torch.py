"""`keep_quantized=True` on checkpoints made by the reference tools (compressed-tensors'
compressors, AutoGPTQ's and AutoAWQ's packers, in test_quant_torch.py): each kept
weight, dequantized inside `jax.jit`, equals the reference library's dequantization
bit for bit (and the dequantizing load's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import bridge  # noqa: E402

from . import quant_llama as ql, test_quant_torch as qt  # noqa: E402
from .test_quant_torch import _one_torch_thread  # noqa: E402, F401  (a fixture)


def _folder(kind, tmp_path):
    """`(folder, {name: reference dense tensor}, dtype)`."""
    if kind == "int4-group":
        scheme = dict(type="int", num_bits=4, strategy="group", group_size=32)
        return (*qt._compressed_folder(tmp_path, scheme, "pack-quantized"), "bfloat16")
    if kind == "int4-asymmetric":
        scheme = dict(
            type="int", num_bits=4, strategy="group", group_size=64, symmetric=False
        )
        return (*qt._compressed_folder(tmp_path, scheme, "pack-quantized"), "bfloat16")
    if kind == "int8-channel":
        scheme = dict(type="int", num_bits=8, strategy="channel")
        return (*qt._compressed_folder(tmp_path, scheme, "int-quantized"), "bfloat16")
    if kind == "int4-actorder":
        folder, _, want = qt._ct_actorder_folder(tmp_path, "pack-quantized", 4)
        return folder, want, "bfloat16"
    if kind.startswith("gptq"):
        desc_act = kind.endswith("act")
        folder, _, want = qt._gptq_folder(tmp_path, int(kind[4]), desc_act)
        return folder, want, "float16"
    folder, want = qt._awq_folder(tmp_path)
    return folder, want, "float16"


KINDS = [
    "int4-group",
    "int4-asymmetric",
    "int8-channel",
    "int4-actorder",
    "gptq4",
    "gptq8",
    "gptq4-act",
    "awq",
]


@pytest.mark.parametrize("kind", KINDS)
def test_kept_weights_dequantize_as_the_reference(tmp_path, kind):
    folder, want, dtype = _folder(kind, tmp_path)
    layers = ql.eqx_layers()
    like = qt._target(layers)
    kept = bridge.load(folder, like=like, dtype=dtype, keep_quantized=True)
    dense = bridge.load(folder, like=like, dtype=dtype)
    run = jax.jit(bridge.dequantize)
    out = run(kept)
    for i in range(len(kept.model.layers)):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
            q = ql._get(kept.model.layers[i], part).weight
            assert isinstance(q, bridge.QuantizedArray), (kind, part)
            got = ql._get(out.model.layers[i], part).weight
            ref = want[f"model.layers.{i}.{part}.weight"]
            ref = ref.view(torch.int16).numpy().view(np.uint16)
            assert got.dtype == jnp.dtype(dtype)
            assert np.array_equal(qt._bits(got), ref), (kind, i, part)
    for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(out), strict=True):
        assert np.array_equal(qt._bits(a), qt._bits(b))
    # qwix's QArray where it holds the weight exactly: int8 (qwix's own dequantize,
    # in bfloat16, as the oracle); the packed schemes are refused by name
    q = kept.model.layers[0].mlp.up_proj.weight
    if kind == "int8-channel":
        qwix = pytest.importorskip("qwix")
        got = qwix.dequantize(q.to_qwix()).astype(q.dtype)
        assert np.array_equal(qt._bits(got), qt._bits(q.dequantize()))
    else:
        with pytest.raises(ValueError, match="cannot be a qwix QArray exactly"):
            q.to_qwix()


def test_kept_nnx_kernel_is_the_transposed_reference(tmp_path):
    folder, want, dtype = _folder("gptq4-act", tmp_path)
    like = qt._target(ql.nnx_layers(jnp.float16), dtype=jnp.float16)
    kept = bridge.load(folder, like=like, dtype=dtype, keep_quantized=True)
    kernel = kept.model.layers[1].mlp.up_proj.kernel[...]
    assert isinstance(kernel, bridge.QuantizedArray) and kernel.shape == (256, 384)
    got = jax.jit(lambda q: q.dequantize())(kernel)
    ref = want["model.layers.1.mlp.up_proj.weight"].view(torch.int16).numpy()
    assert np.array_equal(qt._bits(got).T, ref.view(np.uint16))


def test_three_bit_gptq_is_not_kept(tmp_path):
    folder, _, _ = qt._gptq_folder(tmp_path, 3, True)
    like = qt._target(ql.eqx_layers())
    with pytest.raises(ValueError, match=r"gptq group 32, 3-bit is not kept quantized"):
        bridge.load(folder, like=like, keep_quantized=True)
