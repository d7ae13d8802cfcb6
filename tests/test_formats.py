"""The format registry and the safetensors dtype table: every dtype, every format."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from flax import serialization

import bridge
from bridge import _cli
from bridge._io import _format, _read, _safetensors
from bridge._io._contents import Contents, encode
from bridge._lazy import LazyArray
from bridge._paths import canonical
from bridge._tree import native_order

from . import models
from .helpers import requires


FORMATS = ["m.safetensors", "m.msgpack", "ckpt"]
# safetensors releases before TensorSpec (the floor, 0.4.3) know fewer dtype codes
RECENT = hasattr(safetensors, "TensorSpec")
CLASSIC = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"} | {
    "F16",
    "BF16",
    "F32",
    "F64",
    "F8_E4M3",
    "F8_E5M2",
}


def bits(dtype: str, n: int = 8) -> np.ndarray:
    """`n` values of `dtype` with varied bit patterns (valid ones for bool and 4-bit
    types, whose other bits do not round trip by design)."""
    dt = jnp.dtype(dtype)
    raw = np.random.default_rng(0).integers(0, 256, n * dt.itemsize, np.uint8)
    if dtype == "bool":
        raw = raw % 2
    if dtype == "float4_e2m1fn":
        raw = raw % 16
    return raw.view(dt).reshape(2, n // 2)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# codes safetensors' own reader knows from 0.8.0 (bridge stores them with any)
_NEWER = {"C64", "F4", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0"}
CODES = [
    pytest.param(c, marks=requires("safetensors.TensorSpec")) if c in _NEWER else c
    for c in sorted(_safetensors.DTYPES)
]


@pytest.mark.parametrize("code", CODES)
def test_every_safetensors_dtype_round_trips_bits(tmp_path, code):
    dtype = _safetensors.DTYPES[code]
    variables = {"params": {"x": bits(dtype)}}
    path = tmp_path / "m.safetensors"
    bridge.save(path, variables)
    assert same_bits(bridge.load(path).x, variables["params"]["x"])
    back = bridge.load(path, like=variables)
    assert same_bits(back["params"]["x"], variables["params"]["x"])
    if not (RECENT or code in CLASSIC):
        return  # the installed safetensors cannot read this code: no oracle here
    # safetensors' own reader agrees on the code and shape it finds in the file
    with safetensors.safe_open(path, framework="numpy") as f:
        piece = f.get_slice("x")
        assert piece.get_dtype() == code and piece.get_shape() == [2, 4]
        if code in safetensors.numpy._TYPES:
            assert same_bits(f.get_tensor("x"), variables["params"]["x"])


@requires("safetensors.TensorSpec")
@pytest.mark.parametrize("code", sorted(_safetensors.DTYPES))
def test_files_written_by_safetensors_are_read_exactly(tmp_path, code):
    """safetensors' own writer as the oracle: its file, every dtype, read by bridge."""
    if not RECENT:
        pytest.skip("this safetensors has no TensorSpec writer")
    dtype = _safetensors.DTYPES[code]
    array = bits(dtype)
    stored = _safetensors._to_bytes(array)  # F4: packed two per byte
    shape = [2, 2] if code == "F4" else [2, 4]  # safetensors counts F4 pairs (x2)
    spec = safetensors.TensorSpec(
        dtype="float4_e2m1fn_x2" if code == "F4" else dtype,
        shape=shape,
        data_ptr=stored.ctypes.data,
        data_len=stored.nbytes,
    )
    path = tmp_path / "theirs.safetensors"
    safetensors.serialize_file({"w": spec}, path)
    assert same_bits(bridge.load(path).w, array)


def test_float4_is_packed_low_nibble_first(tmp_path):
    path = tmp_path / "m.safetensors"
    x = np.array([0.5, 1.0, 6.0, -0.5], jnp.float4_e2m1fn)  # codes 1, 2, 7, 9
    bridge.save(path, {"params": {"x": x}})
    data = path.read_bytes()
    assert data[-2:] == bytes([0x21, 0x97])
    with pytest.raises(ValueError, match=r"x: float4_e2m1fn arrays .* even number"):
        bridge.save(path, {"params": {"x": x[:3]}})


@pytest.mark.parametrize("name", FORMATS)
def test_complex64_round_trips_in_every_format(tmp_path, name):
    x = np.array([1 + 2j, -3.5j, np.inf - 1j], np.complex64)
    bridge.save(tmp_path / name, {"params": {"z": x}})
    assert same_bits(bridge.load(tmp_path / name).z, x)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", ["int64", "uint64", "float64"])
def test_64_bit_leaves_are_never_truncated(tmp_path, name, dtype):
    x = np.array([2**40 + 1, 2**62], np.uint64).view(dtype)
    variables = {"params": {"w": x}}
    bridge.save(tmp_path / name, variables)
    back = bridge.load(tmp_path / name, like=variables)["params"]["w"]
    assert same_bits(back, x)
    assert same_bits(bridge.load(tmp_path / name).w, x)


def test_unknown_dtype_code_is_named(tmp_path):
    path = tmp_path / "m.safetensors"
    header = json.dumps(
        {"x": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}
    ).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(
        bridge.CheckpointError,
        match=r"m\.safetensors is not a readable safetensors checkpoint: tensor 'x' "
        r"has dtype code 'F99', which is not a safetensors dtype \(known: BOOL",
    ):
        bridge.load(path)


def test_save_refuses_a_dtype_the_format_cannot_store(tmp_path):
    variables = {"params": {"z": np.ones(2, np.complex128), "k": np.ones(2, "int4")}}
    with pytest.raises(
        ValueError,
        match=r"(?s)safetensors format cannot store z \(complex128\), k \(int4\)\. .*"
        r"save to a format that stores them: msgpack, orbax",
    ):
        bridge.save(tmp_path / "m.safetensors", variables)
    assert list(tmp_path.iterdir()) == []


# --- the registry ---------------------------------------------------------------------


def _toy_format() -> _format.Format:
    """A whole format in a few lines: JSON of the metadata and the arrays as lists."""

    def save(path, contents, arrays):
        arrays = {k: np.asarray(v).tolist() for k, v in arrays.items()}
        path.write_text(json.dumps({"meta": encode(contents), "arrays": arrays}))

    def metadata(path):
        from bridge._io._contents import decode

        data = json.loads(path.read_text())
        return decode(path, "toy", data["meta"], None, data["arrays"])

    def restore(contents: Contents, shardings):
        for s in contents.tensors:
            yield s.key, np.asarray(contents.source[s.key], s.dtype).reshape(s.shape)

    return _format.Format(
        "toy", (".toy.json",), "*.toy.json: JSON lists", save, metadata, restore
    )


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(_format, "_FORMATS", dict(_format._FORMATS))


def test_a_format_is_one_registration(tmp_path, registry, capsys):
    _format.register_format(_toy_format())
    variables = {"params": {"Dense_0": {"kernel": np.ones((2, 3), np.float32)}}}
    path = tmp_path / "m.toy.json"
    bridge.save(path, variables, metadata={"step": "3"})
    back = bridge.load(path, like=variables)
    assert same_bits(back["params"]["Dense_0"]["kernel"], np.ones((2, 3), np.float32))
    assert _cli.main(["convert", str(path), str(tmp_path / "m.safetensors")]) == 0
    assert _cli.main(["inspect", str(path)]) == 0
    assert "*.toy.json: JSON lists" in " ".join(_cli.parser().format_help().split())
    assert _format.format_of(tmp_path / "m.json").name == "orbax"  # suffix is whole


def _capable_toy_format(reads: list[str]) -> _format.Format:
    """The toy format with capabilities of its own: it reads lazily (each read
    recorded in `reads`), finds `model.toy.json` in a directory, holds no training
    state."""

    def lazy(contents):
        def read(s):
            reads.append(s.key)
            return np.asarray(contents.source[s.key], s.dtype).reshape(s.shape)

        return {
            s.key: LazyArray(s.shape, s.dtype, 0, lambda s=s: read(s))
            for s in contents.tensors
        }

    def probe(directory):
        path = directory / "model.toy.json"
        return path if path.is_file() else None

    return _toy_format()._replace(lazy=lazy, probe=probe, training=False)


def test_a_format_states_what_it_can_do(tmp_path, registry, capsys):
    reads: list[str] = []
    _format.register_format(_capable_toy_format(reads))
    source, x = models.equinox_mlp(seed=3), models.mlp_input()
    path = tmp_path / "model.toy.json"
    bridge.save(path, source)
    # another framework's model filled from it: ported, read array by array
    model = bridge.load(path, like=models.nnx_mlp())
    expected = bridge.port(source, models.nnx_mlp())
    assert same_bits(model(x), expected(x))
    assert sorted(reads) == sorted(s.key for s in _read.open_checkpoint(path).tensors)
    # a directory holding its file is a checkpoint of it
    assert _read.open_checkpoint(tmp_path).format == "toy"
    weight = source.layers[0].weight
    assert same_bits(bridge.load(tmp_path).layers[0].weight, weight)
    assert _cli.main(["inspect", str(tmp_path)]) == 0
    assert "(toy, equinox, equinox layout)" in " ".join(capsys.readouterr().out.split())
    assert _cli.main(["convert", str(path), str(tmp_path / "m.safetensors")]) == 0
    back = bridge.load(tmp_path / "m.safetensors", like=models.equinox_mlp())
    assert same_bits(jax.vmap(back)(x), jax.vmap(source)(x))
    # no training state, and no plain PyTorch-layout file
    with pytest.raises(ValueError, match="a toy checkpoint holds arrays only"):
        bridge.save_training(tmp_path / "t.toy.json", source, None, step=3)
    with pytest.raises(ValueError, match="a PyTorch-layout file is a safetensors file"):
        bridge.save_state_dict(tmp_path / "t.toy.json", source)
    assert not (tmp_path / "t.toy.json").exists()


def test_registry_refuses_clashes(registry):
    toy = _toy_format()
    _format.register_format(toy)
    with pytest.raises(ValueError, match="named 'toy' is registered already"):
        _format.register_format(toy)
    with pytest.raises(ValueError, match="suffix '.toy.json' is the 'toy' format's"):
        _format.register_format(toy._replace(name="other"))
    with pytest.raises(ValueError, match="'dir' and 'orbax' would both be directory"):
        _format.register_format(toy._replace(name="dir", suffixes=()))
    with pytest.raises(TypeError, match="`fmt` must be a Format, got dict"):
        _format.register_format({"name": "x"})


def test_longest_suffix_wins(registry):
    toy = _toy_format()._replace(name="index", suffixes=(".index.safetensors",))
    _format.register_format(toy)
    assert _format.format_of(_format.Path("a.index.safetensors")).name == "index"
    assert _format.format_of(_format.Path("a.safetensors")).name == "safetensors"
    assert {"safetensors", "msgpack", "orbax"} <= {f.name for f in _format.formats()}


def test_help_lists_every_registered_format(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps at the terminal's width
    text = " ".join(_cli.parser().format_help().split())
    for fmt in _format.formats():
        assert " ".join(fmt.summary.split()) in text


# --- msgpack keeps the order the file holds ------------------------------------------


class Unsorted(nn.Module):
    """Linen params whose creation order is not sorted: z, a, m, Dense_0..Dense_10."""

    @nn.compact
    def __call__(self, x):
        for name in ["z", "a", "m"]:
            x = nn.Dense(2, name=name)(x)
        for _ in range(11):
            x = nn.Dense(2)(x)
        return x


def test_msgpack_keeps_the_creation_order_reading_and_writing(tmp_path):
    variables = Unsorted().init(jax.random.key(0), jnp.ones((1, 2)))
    order = list(variables["params"])
    assert order != sorted(order)  # the test can fail
    path = tmp_path / "flax.msgpack"
    path.write_bytes(serialization.to_bytes(variables))  # flax's own writer
    tree = bridge.load(path)
    assert list(bridge.to_native(tree)["params"]) == order
    assert native_order(tree)[()] == tuple(order)  # the Tree's own order: canonical
    assert tuple(tree) == canonical(order)
    back = bridge.load(path, like=variables)
    assert list(back["params"]) == order
    bridge.save(tmp_path / "bridge.msgpack", back)  # and bridge's writer
    data = serialization.msgpack_restore((tmp_path / "bridge.msgpack").read_bytes())
    assert list(data["params"]) == order
    assert list(data["params"]["z"]) == list(variables["params"]["z"])
