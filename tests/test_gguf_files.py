"""GGUF files read as llama.cpp reads them: the header checked before any tensor is
read (extents in order, aligned, within the file; counts and lengths bounded by the
file's size; types the `gguf` package dequantizes), every value equal to what the
`gguf` package's own reader gives, each tensor read with positioned reads (a file
truncated while it is read is an error, not a SIGBUS), only bridge's own errors."""

import os
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest


gguf = pytest.importorskip("gguf")

import bridge  # noqa: E402
from bridge import _cli  # noqa: E402
from bridge._io._read import open_checkpoint  # noqa: E402
from bridge._quant import _gguf  # noqa: E402

from .corpus import gguf as hostile  # noqa: E402


Q = gguf.GGMLQuantizationType
DENSE = {
    "f32": (np.float32, Q.F32),
    "f16": (np.float16, Q.F16),
    "f64": (np.float64, Q.F64),
    "i8": (np.int8, Q.I8),
    "i16": (np.int16, Q.I16),
    "i32": (np.int32, Q.I32),
    "i64": (np.int64, Q.I64),
}


def _write(path, tensors, kvs=True):
    """A file by gguf's own writer: `tensors` as `{name: (array, ggml type)}`."""
    writer = gguf.GGUFWriter(path, "llama")
    if kvs:
        writer.add_block_count(2)
        writer.add_name("tiny")
        writer.add_float32("x.eps", 1e-5)
        writer.add_bool("x.flag", True)
        writer.add_int64("x.big", -(2**40))
        writer.add_float64("x.f64", 0.1)
        writer.add_token_list(["a", "bb", "ccc"])
        writer.add_array("x.numbers", [1, 2, 3])
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _valid(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        f"{k}.weight": (
            (rng.normal(size=(3, 4)) * 100).astype(dtype),
            qtype,
        )
        for k, (dtype, qtype) in DENSE.items()
    }
    w = rng.normal(size=(4, 64)).astype(np.float32)
    tensors["q8.weight"] = (gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0)
    tensors["q4.weight"] = (gguf.quants.quantize(w, Q.Q4_0), Q.Q4_0)
    bf = rng.normal(size=(2, 32)).astype(np.float32)
    tensors["bf16.weight"] = (gguf.quants.quantize(bf, Q.BF16), Q.BF16)
    return _write(tmp_path / "m.gguf", tensors), tensors


def test_every_value_equals_the_gguf_readers(tmp_path):
    """Metadata and each tensor (dense of every NumPy type, BF16, Q8_0, Q4_0) as
    gguf's GGUFReader reads them (its arrays dequantized by gguf.quants)."""
    path, _ = _valid(tmp_path)
    reader = gguf.GGUFReader(path)
    want_meta = {
        k: v if isinstance(v := f.contents(), str) else repr(v)
        for k, f in reader.fields.items()
        if not k.startswith("GGUF.") and len(f.types) == 1
    }
    with open_checkpoint(path) as contents:
        assert contents.metadata == want_meta
        for t in reader.tensors:
            got = _gguf.read_one(contents, t.name)
            if t.tensor_type in (Q.Q8_0, Q.Q4_0, Q.BF16):
                want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
                got = np.asarray(got, np.float32)
            else:
                want = np.asarray(t.data)
            assert got.dtype == want.dtype, t.name
            assert got.shape == tuple(reversed(t.shape.tolist())), t.name
            assert np.array_equal(got, want), t.name
    tree = bridge.load(path)  # I8...F64 were a raw NotImplementedError
    assert np.asarray(tree["i64"]["weight"]).dtype == np.int64
    assert np.asarray(tree["f64"]["weight"]).dtype == np.float64


@pytest.mark.parametrize("case", hostile.cases(), ids=lambda c: c.name)
def test_hostile_gguf_is_refused_naming_the_tensor(tmp_path, case, capsys):
    (tmp_path / "in").mkdir()
    path = case.make(tmp_path / "in")
    named = case.name.rpartition(": ")[2]
    for call in (lambda: bridge.load(path), lambda: open_checkpoint(path).close()):
        with pytest.raises(bridge.CheckpointError) as info:
            call()
        message = str(info.value)
        assert path.name in message and named in message, message
        assert len(message) < 1_000, message
    for argv in (
        ["inspect", str(path)],
        ["convert", str(path), str(tmp_path / "x.safetensors")],
    ):
        assert _cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"bridge {argv[0]}: error: ") and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["in"]


def test_gguf_readers_accept_what_bridge_refuses(tmp_path):
    """Why bridge checks the extents itself: gguf's reader reads a tensor at
    another's offset, or (offset 2**64-1) wrapped into the header, without a word."""
    path = hostile._file(hostile._two(2**64 - 1))(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # its offset overflows
        reader = gguf.GGUFReader(path)
    assert reader.tensors[1].data_offset < reader.data_offset  # in the header
    path = hostile._file(hostile._two(0))(tmp_path)
    assert (
        gguf.GGUFReader(path).tensors[1].data_offset
        == gguf.GGUFReader(path).tensors[0].data_offset
    )
    with pytest.raises(bridge.CheckpointError, match="another tensor's"):
        bridge.load(path)


def test_a_long_array_key_value_is_skipped_not_read(tmp_path):
    """10**6 numbers in an array key-value: skipped in constant time (gguf's reader
    builds one NumPy array a number: about 10 s)."""
    numbers = np.arange(10**6, dtype=np.float32).tobytes()
    kvs = [("tokenizer.ggml.scores", hostile.ARRAY, (hostile.FLOAT32, numbers, 10**6))]
    path = hostile._file(hostile.gguf_bytes(kvs, [hostile.T("a.weight", (8,))]))(
        tmp_path
    )
    start = time.perf_counter()
    tree = bridge.load(path)
    assert time.perf_counter() - start < 2.0
    assert np.array_equal(np.asarray(tree["a"]["weight"]), np.arange(8.0))


_TRUNCATED = """
import os, sys
import bridge
from bridge._io._read import open_checkpoint
from bridge._quant import _gguf
path = sys.argv[1]
with open_checkpoint(path) as contents:
    os.truncate(path, 64)
    try:
        _gguf.read_one(contents, "b.weight")
    except bridge.CheckpointError as e:
        print("refused:", e)
"""

_LOCALS = """
import sys, traceback
import bridge
try:
    bridge.load(sys.argv[1])
except Exception as e:
    text = "".join(traceback.TracebackException(
        type(e), e, e.__traceback__, capture_locals=True).format())
    print(text)
"""


def _run(script, path):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def test_a_file_truncated_while_loading_is_an_error_not_a_sigbus(tmp_path):
    tensors = {n: (np.ones(4096, np.float32), Q.F32) for n in ("a.weight", "b.weight")}
    path = _write(tmp_path / "m.gguf", tensors, kvs=False)
    done = _run(_TRUNCATED, path)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "refused:" in done.stdout and "m.gguf" in done.stdout
    assert "changed while it was read" in done.stdout, done.stdout


def test_printing_a_gguf_errors_locals_does_not_crash(tmp_path):
    """A verbose traceback (pytest's --showlocals, IPython's) prints the locals of
    the frames a load failed in: none may be a view of a closed mapping."""
    path = hostile._file(hostile.gguf_bytes([], [hostile.T("a.weight", (32,), 9)]))(
        tmp_path
    )
    done = _run(_LOCALS, path)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "Q8_1" in done.stdout


@pytest.mark.slow
def test_load_time_is_linear_in_the_tensor_count(tmp_path):
    """40,000 tensors take under 16x the time of 5,000 (8x as many: the square would
    be 64x; main took 1.5 s and 11.5 s for 5,000 and 20,000, 38 s for 50,000)."""
    times = []
    for n in (5_000, 40_000):
        tensors = [hostile.T(f"t{i}.weight", (8,)) for i in range(n)]
        (tmp_path / str(n)).mkdir()
        path = hostile._file(hostile.gguf_bytes([], tensors))(tmp_path / str(n))
        start = time.perf_counter()
        bridge.load(path)
        times.append(time.perf_counter() - start)
    assert times[1] < 16 * times[0], times


def test_inspect_clips_a_long_string(tmp_path, capsys):
    """A 200,000-character value is shown as its first 1,000 (a GGUF chat template
    or a hostile file may hold megabytes); `--json` keeps it whole."""
    kvs = [("general.name", hostile.STRING, "x" * 200_000 + "\x1b[2J")]
    path = hostile._file(hostile.gguf_bytes(kvs, [hostile.T("a.weight", (8,))]))(
        tmp_path
    )
    assert _cli.main(["inspect", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "(200,004 characters; --json shows all)" in shown
    assert len(shown) < 5_000 and "\x1b" not in shown


@pytest.mark.parametrize(
    "qtype, dims", [("Q8_0", (0, 3)), ("Q4_K", (0,)), ("Q4_K", (256, 0))]
)
def test_a_quantized_tensor_with_a_dimension_of_0_is_empty(tmp_path, qtype, dims):
    """A quantized tensor with a dimension of 0 (llama.cpp allows it) was
    `gguf.quants.dequantize`'s raw `ValueError: cannot reshape array of size 0`:
    it is an empty float32 array of the declared shape (dims innermost first),
    the other tensors as written."""
    content = hostile.gguf_bytes(
        [], [hostile.T("a.weight", (8,)), hostile.T("b.weight", dims, Q[qtype])]
    )
    path = tmp_path / "m.gguf"
    path.write_bytes(content)
    tree = bridge.load(path)
    empty = np.asarray(tree["b"]["weight"])
    assert empty.shape == dims[::-1] and empty.dtype == np.float32
    assert np.array_equal(np.asarray(tree["a"]["weight"]), np.arange(8.0))
    with open_checkpoint(path) as contents:
        shapes = {s.key: s.shape for s in contents.tensors}
    assert shapes == {"a.weight": (8,), "b.weight": dims[::-1]}
