"""`bridge.save` / `bridge.load`: every format, dtype, error, atomicity, sharding."""

import json
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors
import safetensors.numpy
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import bridge
from bridge._io import _contents, _model, _safetensors
from bridge._tree import kind

from . import models
from .helpers import needs_devices, requires


FORMATS = ["model.safetensors", "model_dir"]


def by_path(obj):
    """`{keystr: leaf}` of a model's Tree (PRNG keys as key data)."""
    flat = jax.tree_util.tree_flatten_with_path(bridge.to_neutral(obj))[0]
    out = {}
    for p, x in flat:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[jax.tree_util.keystr(p)] = x
    return out


def same_bits(a, b) -> bool:
    fa, fb = by_path(a), by_path(b)
    return fa.keys() == fb.keys() and all(
        fa[k].dtype == fb[k].dtype
        and np.asarray(fa[k]).tobytes() == np.asarray(fb[k]).tobytes()
        for k in fa
    )


class Mixed(nnx.Module):
    """Every dtype the issue names, and an RNG stream (typed key + counter)."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.lin = nnx.Linear(2, 3, param_dtype=jnp.bfloat16, rngs=rngs)
        self.half = nnx.Param(jax.random.normal(rngs.params(), (3,), jnp.float16))
        self.codes = nnx.Param(jnp.arange(-2, 2, dtype=jnp.int8) * (seed + 1))


class Keys(eqx.Module):
    fry: jax.Array
    rbg: jax.Array


# --- round trips --------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    "make", [models.nnx_cnn, models.equinox_cnn, models.nnx_block, models.nnx_mlp]
)
def test_round_trip_bits(tmp_path, name, make):
    model, other = make(0), make(1)
    assert not same_bits(model, other)
    bridge.save(tmp_path / name, model)
    back = bridge.load(tmp_path / name, like=other)
    assert type(back) is type(other)
    assert same_bits(back, model)


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_outputs_nnx(tmp_path, name):
    model = models.nnx_block(0)
    bridge.save(tmp_path / name, model)
    back = bridge.load(tmp_path / name, like=models.nnx_block(1))
    ids = models.tokens()
    np.testing.assert_array_equal(back(ids), model(ids))


@pytest.mark.parametrize("name", FORMATS + ["model.msgpack"])
def test_round_trip_linen_kinds(tmp_path, name):
    module, variables = models.linen_cnn(0)
    _, other = models.linen_cnn(1)
    bridge.save(tmp_path / name, (module, variables))
    x = models.cnn_input()
    as_dict = bridge.load(tmp_path / name, like=other)
    assert type(as_dict) is dict and same_bits(as_dict, variables)
    pair = bridge.load(tmp_path / name, like=(module, other))
    assert pair[0] is module
    np.testing.assert_array_equal(module.apply(pair[1], x), module.apply(variables, x))
    bound = bridge.load(tmp_path / name, like=module.bind(other))
    np.testing.assert_array_equal(bound(x), module.apply(variables, x))
    tree = bridge.load(tmp_path / name, like=bridge.from_linen(other, module))
    assert isinstance(tree, bridge.Tree) and same_bits(tree, variables)


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_equinox_state_outputs(tmp_path, name):
    model, state = models.equinox_cnn(0)
    bridge.save(tmp_path / name, (model, state))
    back, back_state = bridge.load(tmp_path / name, like=models.equinox_cnn(1))
    x = models.cnn_input()[0]
    infer, back_infer = eqx.nn.inference_mode(model), eqx.nn.inference_mode(back)
    np.testing.assert_array_equal(back_infer(x, back_state)[0], infer(x, state)[0])


@requires("NNX")
@pytest.mark.parametrize("name", FORMATS)
def test_every_dtype_and_prng_keys(tmp_path, name):
    model = Mixed(0)
    bridge.save(tmp_path / name, model)
    back = bridge.load(tmp_path / name, like=Mixed(1))
    assert same_bits(back, model)
    assert back.lin.kernel.dtype == jnp.bfloat16
    assert back.half.dtype == jnp.float16 and back.codes.dtype == jnp.int8
    key = back.drop.rngs.key[...]
    assert jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(key) == jax.random.key_impl(model.drop.rngs.key[...])
    tree = bridge.load(tmp_path / name)  # without `like`: typed keys too
    assert jnp.issubdtype(tree.drop.rngs.key.dtype, jax.dtypes.prng_key)
    assert tree.lin.kernel.dtype == jnp.bfloat16


@pytest.mark.parametrize("name", FORMATS)
def test_prng_impls_survive(tmp_path, name):
    keys = Keys(jax.random.key(3), jax.random.key(4, impl="rbg"))
    bridge.save(tmp_path / name, keys)
    back = bridge.load(tmp_path / name, like=Keys(jax.random.key(0), keys.rbg))
    assert str(jax.random.key_impl(back.rbg)) == "rbg"
    assert str(jax.random.key_impl(back.fry)) == "threefry2x32"
    np.testing.assert_array_equal(
        jax.random.key_data(back.fry), jax.random.key_data(keys.fry)
    )


@pytest.mark.parametrize("name", FORMATS + ["model.msgpack"])
def test_load_without_like_keeps_paths_and_roles(tmp_path, name):
    model = models.nnx_cnn()
    bridge.save(tmp_path / name, model)
    tree = bridge.load(tmp_path / name)
    assert isinstance(tree, bridge.Tree)
    roles = bridge.roles(tree)
    assert roles.bn.mean == "batch_stats" and roles.conv.kernel == "params"
    np.testing.assert_array_equal(tree.conv.kernel, model.conv.kernel[...])


def test_flax_file_without_like_is_linen_variables(tmp_path):
    model = models.nnx_cnn()
    bridge.save(tmp_path / "m.safetensors", model)
    variables = bridge.to_native(bridge.load(tmp_path / "m.safetensors"))
    assert sorted(variables) == ["batch_stats", "params"]
    np.testing.assert_array_equal(
        variables["batch_stats"]["bn"]["mean"], model.bn.mean[...]
    )


def test_equinox_file_without_like_is_a_skeleton(tmp_path):
    model = models.equinox_mlp()
    bridge.save(tmp_path / "m.safetensors", model)
    tree = bridge.load(tmp_path / "m.safetensors")
    assert kind(tree.layers[0]) is eqx.nn.Linear
    skeleton = bridge.to_native(tree)
    assert skeleton.layers[0].in_features == models.D_IN
    np.testing.assert_array_equal(skeleton.layers[0].weight, model.layers[0].weight)
    with pytest.raises(TypeError, match=r"(?s)skeleton of equinox.*like=model"):
        skeleton(jnp.ones(models.D_IN))


FRAMEWORKS = {
    "linen": {"mlp": models.linen_mlp, "cnn": models.linen_cnn},
    "nnx": {"mlp": models.nnx_mlp, "cnn": models.nnx_cnn},
    "equinox": {"mlp": models.equinox_mlp, "cnn": models.equinox_cnn},
}
INPUTS = {"mlp": models.mlp_input, "cnn": models.cnn_input}


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
@pytest.mark.parametrize(
    "source, target",
    [(s, t) for s in FRAMEWORKS for t in FRAMEWORKS if s != t],
)
def test_load_across_frameworks(tmp_path, arch, source, target):
    model = FRAMEWORKS[source][arch](0)
    other = FRAMEWORKS[target][arch](1)
    x = INPUTS[arch]()
    assert bridge.compare(model, other, x) > 1e-3
    bridge.save(tmp_path / "m.safetensors", model)
    loaded = bridge.load(tmp_path / "m.safetensors", like=other)
    assert type(loaded) is type(other)
    assert bridge.compare(model, loaded, x) < 1e-5


def test_load_across_frameworks_orbax_block(tmp_path):
    model, other = models.equinox_block(0), models.nnx_block(1)
    bridge.save(tmp_path / "ckpt", model)
    loaded = bridge.load(tmp_path / "ckpt", like=other)
    assert bridge.compare(model, loaded, models.tokens()) < 1e-5


def test_load_across_frameworks_error_names_the_file(tmp_path):
    bridge.save(tmp_path / "m.safetensors", models.equinox_mlp())
    with pytest.raises(bridge.PortError) as info:
        bridge.load(tmp_path / "m.safetensors", like=models.nnx_cnn())
    assert "while porting" in "".join(info.value.__notes__)
    assert "m.safetensors" in "".join(info.value.__notes__)


def test_safetensors_keys_and_metadata(tmp_path):
    path = tmp_path / "m.safetensors"
    bridge.save(path, models.nnx_cnn(), metadata={"step": "7"})
    with safetensors.safe_open(path, framework="numpy") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert "conv.kernel" in keys and "bn.mean" in keys
    tensors = json.loads(meta["tensors"])
    assert tensors["bn.mean"]["role"] == "batch_stats"
    assert tensors["conv.kernel"]["role"] == "params"
    assert meta["framework"] == "nnx" and meta["layout"] == "flax"
    assert meta["bridge_version"] == bridge.__version__ and meta["step"] == "7"
    bridge.save(path, models.equinox_mlp())
    meta = safetensors.safe_open(path, framework="numpy").metadata()
    assert meta["framework"] == "equinox" and meta["layout"] == "equinox"
    assert "layers.0.weight" in json.loads(meta["tensors"])


def test_plain_safetensors_file_loads(tmp_path):
    path = tmp_path / "plain.safetensors"
    arrays = {"encoder.0.w": np.ones((2, 3), np.float32), "head": np.zeros(2, np.int8)}
    safetensors.numpy.save_file(arrays, path)
    tree = bridge.load(path)
    np.testing.assert_array_equal(tree.encoder[0].w, arrays["encoder.0.w"])
    assert bridge.roles(tree).head == "params"


# --- sharding -----------------------------------------------------------------------


def sharded_model():
    # explicit axis types: jax < 0.9 warns when they are left to the default
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    model = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
    sharded = jax.device_put(model.kernel[...], NamedSharding(mesh, P(None, "x")))
    model.kernel = nnx.Param(sharded)
    return model, mesh


@needs_devices(8)
@requires("NNX")
def test_orbax_keeps_sharding(tmp_path):
    model, mesh = sharded_model()
    bridge.save(tmp_path / "ckpt", model)
    tree = bridge.load(tmp_path / "ckpt")
    assert tree.kernel.sharding == NamedSharding(mesh, P(None, "x"))
    np.testing.assert_array_equal(tree.kernel, model.kernel[...])


@needs_devices(8)
@requires("NNX")
@pytest.mark.parametrize("name", FORMATS)
def test_load_takes_the_sharding_of_like(tmp_path, name):
    model, mesh = sharded_model()
    bridge.save(tmp_path / name, nnx.Linear(4, 16, rngs=nnx.Rngs(1)))
    back = bridge.load(tmp_path / name, like=model)
    assert back.kernel[...].sharding == NamedSharding(mesh, P(None, "x"))
    assert not np.array_equal(back.kernel[...], model.kernel[...])


# --- atomicity ----------------------------------------------------------------------


def failing(*args, **kwargs):
    raise OSError("disk full (injected)")


def test_safetensors_failure_keeps_earlier_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    first = models.nnx_mlp(0)
    bridge.save(path, first)

    calls = []

    def fail_midway(array):  # the header and the first array are written by then
        calls.append(array)
        return to_bytes(array) if len(calls) < 2 else failing()

    to_bytes = _safetensors._to_bytes
    monkeypatch.setattr(_safetensors, "_to_bytes", fail_midway)
    with pytest.raises(OSError, match="injected"):
        bridge.save(path, models.nnx_mlp(1))
    assert os.listdir(tmp_path) == ["m.safetensors"]
    assert same_bits(bridge.load(path, like=models.nnx_mlp(2)), first)


def test_orbax_failure_keeps_earlier_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    first = models.nnx_mlp(0)
    bridge.save(path, first)

    def half_save(self, directory, *args, **kwargs):
        os.makedirs(directory)
        (directory / "partial").write_bytes(b"\x00")
        failing()

    monkeypatch.setattr(ocp.Checkpointer, "save", half_save)
    with pytest.raises(OSError, match="injected"):
        bridge.save(path, models.nnx_mlp(1))
    assert os.listdir(tmp_path) == ["ckpt"]
    assert same_bits(bridge.load(path, like=models.nnx_mlp(2)), first)


def test_orbax_replaces_a_checkpoint_but_not_other_directories(tmp_path):
    bridge.save(tmp_path / "ckpt", models.nnx_mlp(0))
    bridge.save(tmp_path / "ckpt", models.nnx_mlp(1))
    assert same_bits(bridge.load(tmp_path / "ckpt"), models.nnx_mlp(1))
    assert os.listdir(tmp_path) == ["ckpt"]
    (tmp_path / "photos").mkdir()
    with pytest.raises(FileExistsError, match="is not a checkpoint directory"):
        bridge.save(tmp_path / "photos", models.nnx_mlp())


# --- bad files ----------------------------------------------------------------------


def test_truncated_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    bridge.save(path, models.nnx_mlp())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(
        ValueError, match=r"m\.safetensors is not a readable.*truncated"
    ):
        bridge.load(path)


def test_garbage_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"m\.safetensors is not a readable"):
        bridge.load(path)


def test_metadata_disagreeing_with_tensors(tmp_path):
    path = tmp_path / "m.safetensors"
    meta = _contents.encode(_model.describe(bridge.from_nnx(models.nnx_mlp()), None)[0])
    safetensors.numpy.save_file({"x": np.ones(2, np.float32)}, path, metadata=meta)
    with pytest.raises(ValueError, match="describes other arrays than the file holds"):
        bridge.load(path)


def test_truncated_msgpack(tmp_path):
    path = tmp_path / "m.msgpack"
    bridge.save(path, models.nnx_mlp())
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match=r"m\.msgpack is not a readable msgpack"):
        bridge.load(path)


def test_corrupted_orbax(tmp_path):
    path = tmp_path / "ckpt"
    bridge.save(path, models.nnx_mlp())
    (path / "bridge" / "metadata").write_text("{not json")
    with pytest.raises(ValueError, match=r"ckpt is not a readable orbax checkpoint"):
        bridge.load(path)


def test_nothing_is_imported_on_load(tmp_path):
    path = tmp_path / "m.safetensors"
    tree = bridge.from_equinox(models.equinox_mlp())
    contents, arrays = _model.describe(tree, None)
    meta = _contents.encode(contents)
    modules = [[[], "antigravity:Module", {}], [["layers"], "os:system", {}]]
    meta["modules"] = json.dumps(modules)
    safetensors.numpy.save_file(
        {k: np.asarray(v) for k, v in arrays.items()}, path, metadata=meta
    )
    assert "antigravity" not in sys.modules
    loaded = bridge.load(path)
    assert "antigravity" not in sys.modules
    assert kind(loaded) is None and kind(loaded.layers) is None


def test_missing_and_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors: no such file"):
        bridge.load(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty is a directory but not a checkpoint"):
        bridge.load(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="unknown checkpoint format '.txt'"):
        bridge.load(tmp_path / "notes.txt")


def test_save_errors(tmp_path):
    model = models.nnx_mlp()
    with pytest.raises(ValueError, match=r"keys \['tensors', 'layout'\] are reserved"):
        metadata = {"tensors": "x", "layout": "y", "step": "1"}
        bridge.save(tmp_path / "m.safetensors", model, metadata=metadata)
    with pytest.raises(TypeError, match="must map strings to strings"):
        bridge.save(tmp_path / "m.safetensors", model, metadata={"step": 3})
    with pytest.raises(FileNotFoundError, match="no such directory"):
        bridge.save(tmp_path / "a" / "m.safetensors", model)
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory"):
        bridge.save(tmp_path / "d.safetensors", model)
    tree = bridge.from_nnx(model)
    spec = jax.tree_util.tree_map(lambda _: True, tree)
    with pytest.raises(TypeError, match=r"\.layers\[0\]\.kernel is a bool"):
        bridge.save(tmp_path / "m.safetensors", spec)


# --- like: strict ---------------------------------------------------------------------


class Wider(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.layers = nnx.List(
            [nnx.Linear(3, 7, rngs=rngs), nnx.Linear(7, 5, rngs=rngs)]
        )
        self.extra = nnx.Linear(5, 2, rngs=rngs)


@pytest.mark.parametrize("name", FORMATS)
def test_like_mismatch_lists_every_problem(tmp_path, name):
    bridge.save(tmp_path / name, models.nnx_mlp())
    with pytest.raises(ValueError) as info:
        bridge.load(tmp_path / name, like=Wider())
    message = str(info.value)
    assert "does not fit the model given as `like`" in message
    assert r"missing .extra.kernel" in message
    assert "unexpected 'layers.2.kernel'" in message
    assert r".layers[0].kernel: shape (3, 5) in the file, (3, 7) in `like`" in message
    assert r".layers[1].bias: shape (5,) in the file, (5,)" not in message


@requires("NNX")
def test_like_dtype_mismatch(tmp_path):
    bridge.save(tmp_path / "m.safetensors", nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    like = nnx.Linear(2, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError, match=r"\.kernel: dtype float32 in the file, bfloat16 in `like`"
    ):
        bridge.load(tmp_path / "m.safetensors", like=like)


@requires("NNX")
def test_loaded_arrays_do_not_alias_the_file(tmp_path):
    path = tmp_path / "m.safetensors"
    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    bridge.save(path, model)
    tree = bridge.load(path)
    with open(path, "r+b") as f:  # overwrite the last float in place
        f.seek(-4, os.SEEK_END)
        f.write(np.float32(123.0).tobytes())
    assert not same_bits(bridge.load(path), model)  # the file did change
    assert same_bits(tree, model)  # the arrays loaded before did not


def test_saved_file_has_the_usual_permissions(tmp_path):
    (tmp_path / "plain").touch()
    bridge.save(tmp_path / "m.safetensors", models.nnx_mlp())
    mode = (tmp_path / "plain").stat().st_mode
    assert (tmp_path / "m.safetensors").stat().st_mode == mode


def test_dotted_names_that_collide(tmp_path):
    variables = {"params": {"a.b": {"c": jnp.ones(2)}, "a": {"b.c": jnp.ones(2)}}}
    with pytest.raises(ValueError, match=r"same dotted name.*\['a.b'\]\.c and"):
        bridge.save(tmp_path / "m.safetensors", variables)


@requires("NNX")
@pytest.mark.parametrize("field, value", [("dtype", "float99"), ("prng_impl", "nope")])
def test_metadata_naming_unknown_types(tmp_path, field, value):
    path = tmp_path / "m.safetensors"
    bridge.save(path, nnx.Dropout(0.5, rngs=nnx.Rngs(0)))
    with safetensors.safe_open(path, framework="numpy") as f:
        meta, arrays = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors = json.loads(meta["tensors"])
    tensors["rngs.key"][field] = value
    meta["tensors"] = json.dumps(tensors)
    safetensors.numpy.save_file(arrays, path, metadata=meta)
    with pytest.raises(ValueError, match=r"m\.safetensors is not a readable"):
        bridge.load(path)
