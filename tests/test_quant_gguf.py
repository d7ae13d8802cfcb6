"""GGUF files written by `gguf`'s own writer, quantized by `gguf.quants.quantize`
(Q8_0, Q4_0) or holding K-quant blocks (Q4_K, Q6_K: gguf-py quantizes no K-quant, so
their blocks are random bytes with finite scales), read by bridge: each tensor equal
to `gguf.quants.dequantize`'s, lazily, into NNX and Equinox models."""

import json

import numpy as np
import pytest


gguf = pytest.importorskip("gguf")

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bridge  # noqa: E402
from bridge._io._read import open_checkpoint  # noqa: E402

from . import quant_llama as ql  # noqa: E402


Q = gguf.GGMLQuantizationType
# a type per tensor kind: both gguf-py quantizers and two K-quants
TYPES = {
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q6_K,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q4_K,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_0,
    "token_embd": Q.Q8_0,
    "output": Q.Q6_K,
}


def _k_blocks(rows, cols, qtype, rng):
    """Random K-quant blocks with finite float16 scales (`d`, `dmin`)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    if qtype == Q.Q6_K:  # d is its last 2 bytes
        data[..., -2:] = scale
    else:  # Q4_K, Q5_K: d, dmin first
        data[..., 0:2] = scale
        data[..., 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def gguf_state(dense: dict[str, np.ndarray], seed=0):
    """`{gguf name: (stored array, ggml type)}` of dense float32 GGUF-named
    tensors: 2-D weights quantized by their kind's type, the rest F32."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, array in dense.items():
        kind = name.split(".")[-2]
        qtype = TYPES.get(kind) if array.ndim == 2 else None
        if qtype is None:
            out[name] = (array.astype(np.float32), Q.F32)
        elif qtype in (Q.Q4_K, Q.Q6_K):
            out[name] = (_k_blocks(*array.shape, qtype, rng), qtype)
        else:
            out[name] = (gguf.quants.quantize(array.astype(np.float32), qtype), qtype)
    return out


def write_gguf(path, stored, c: ql.Config = ql.Config(), heads=True):
    """A GGUF file of `stored` with llama's key-values (the head counts if
    `heads`), by gguf's writer."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(c.layers)
    writer.add_embedding_length(c.dim)
    if heads:
        writer.add_head_count(c.heads)
        writer.add_head_count_kv(c.kv_heads)
    writer.add_token_list(["a", "b"])  # an array key-value: left out of metadata
    for name, (array, qtype) in stored.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized(stored):
    """Each tensor as `gguf.quants.dequantize` gives it."""
    return {
        n: gguf.quants.dequantize(a, t).astype(np.float32)
        for n, (a, t) in stored.items()
    }


def _dense(c: ql.Config = ql.Config(), seed=0):
    """Random GGUF-named float32 Llama tensors."""
    rng = np.random.default_rng(seed)
    head_dim = c.dim // c.heads
    shapes = {
        "token_embd.weight": (c.vocab, c.dim),
        "output_norm.weight": (c.dim,),
        "output.weight": (c.vocab, c.dim),
    }
    for i in range(c.layers):
        shapes.update(
            {
                f"blk.{i}.attn_q.weight": (c.heads * head_dim, c.dim),
                f"blk.{i}.attn_k.weight": (c.kv_heads * head_dim, c.dim),
                f"blk.{i}.attn_v.weight": (c.kv_heads * head_dim, c.dim),
                f"blk.{i}.attn_output.weight": (c.dim, c.heads * head_dim),
                f"blk.{i}.ffn_gate.weight": (c.hidden, c.dim),
                f"blk.{i}.ffn_up.weight": (c.hidden, c.dim),
                f"blk.{i}.ffn_down.weight": (c.dim, c.hidden),
                f"blk.{i}.attn_norm.weight": (c.dim,),
                f"blk.{i}.ffn_norm.weight": (c.dim,),
            }
        )
    return {
        n: (rng.normal(size=s) * 0.05).astype(np.float32) for n, s in shapes.items()
    }


@pytest.fixture(scope="module")
def file(tmp_path_factory):
    stored = gguf_state(_dense())
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, stored)
    return path, dequantized(stored)


def test_gguf_into_equinox_equals_gguf_dequantize(file):
    path, want = file
    target = eqx.filter_eval_shape(lambda: ql.make(ql.eqx_layers(), ql.GGUF))
    model = bridge.load(path, like=target)
    for i, block in enumerate(model.blk):
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_down"):
            weight = getattr(block, kind).weight
            assert np.array_equal(np.asarray(weight), want[f"blk.{i}.{kind}.weight"])
    embedding = np.asarray(model.token_embd.weight)
    assert np.array_equal(embedding, want["token_embd.weight"])
    got = ql.forward(ql.eqx_layers(), ql.GGUF, model, jnp.asarray([[1, 2, 3]]))
    assert got.shape == (1, 3, 64) and np.isfinite(np.asarray(got)).all()


def test_gguf_without_like_header_and_inspect(file, capsys):
    path, want = file
    with open_checkpoint(path) as contents:
        assert contents.format == "gguf"
        assert contents.metadata["general.architecture"] == "llama"
        assert "tokenizer.ggml.tokens" not in contents.metadata
        shapes = {s.key: s.shape for s in contents.tensors}
    assert shapes["blk.0.ffn_down.weight"] == (256, 384)  # PyTorch's (out, in)
    tree = bridge.load(path, dtype=jnp.bfloat16)
    weight = tree.blk[1].attn_k.weight
    assert weight.dtype == jnp.bfloat16
    expected = want["blk.1.attn_k.weight"].astype(jnp.bfloat16)
    assert np.array_equal(np.asarray(weight), expected)
    from bridge._cli import main

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Q4_K" in out and "Q6_K" in out and "dequantized" in out
    # each tensor with the type it is stored in, and its bytes as stored
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    held = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    name = "blk.0.ffn_down.weight"
    row = next(line for line in out.splitlines() if f" {name} " in line)
    assert f"{kinds[name]} (read as float32)" in row, row
    assert "96.0 KiB" not in row  # not the dequantized 256 x 384 x 4 bytes
    assert main(["inspect", str(path), "--json"]) == 0
    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)["arrays"]}
    quantized = [n for n, k in kinds.items() if k not in ("F32", "F16", "BF16")]
    assert len(set(kinds[n] for n in quantized)) >= 2  # several types to tell apart
    for n in quantized:
        assert (listed[n]["stored"], listed[n]["bytes"]) == (kinds[n], held[n])
        assert listed[n]["dtype"] == "float32"


def test_gguf_is_not_written(tmp_path):
    # the format stores no dtype: refused before anything is written
    with pytest.raises(
        ValueError, match=r"reads gguf files \(\.gguf\) but writes none"
    ):
        bridge.save(tmp_path / "x.gguf", {"params": {"a": jnp.ones(2)}})


def test_gguf_into_hugging_face_names_without_head_count_refused(tmp_path):
    """Hugging Face's names need the q/k rows un-permuted, by head counts the file
    must give: without them, refused before anything is read."""
    stored = gguf_state(_dense())
    path = tmp_path / "no-heads.gguf"
    write_gguf(path, stored, heads=False)
    target = eqx.filter_eval_shape(lambda: ql.make(ql.eqx_layers(), ql.HF))
    with pytest.raises(bridge.CheckpointError) as info:
        bridge.load(path, like=target)
    message = str(info.value)
    assert "`like` has Hugging Face's Llama names (lm_head)" in message
    assert "attn_q.weight: its rows are permuted, but no llama.attention." in message
    # the file's own names need no head count
    model = bridge.load(
        path, like=eqx.filter_eval_shape(lambda: ql.make(ql.eqx_layers(), ql.GGUF))
    )
    assert model.blk[0].attn_q.weight.shape == (256, 256)


@pytest.mark.parametrize("heads", ["1" * 5000, "-4", "4 ", "\x1b[2J"])
def test_gguf_head_count_that_is_no_count_refused_by_name(tmp_path, heads):
    """A GGUF `llama.attention.head_count` of 5,000 digits raised Python's
    `ValueError: Exceeds the limit (4300 digits) for integer string conversion`;
    any value that is no count of heads is refused naming the key, shown
    shortened and escaped."""
    path = tmp_path / "heads.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("llama.attention.head_count", heads)
    writer.add_string("llama.attention.head_count_kv", heads)
    for name, (array, qtype) in gguf_state(_dense()).items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    target = eqx.filter_eval_shape(lambda: ql.make(ql.eqx_layers(), ql.HF))
    with pytest.raises(
        bridge.CheckpointError,
        match=r"no llama\.attention\.head_count(_kv)? says by how many heads \(it "
        r"is '",
    ) as info:
        bridge.load(path, like=target)
    assert "\x1b" not in str(info.value) and len(str(info.value)) < 500
