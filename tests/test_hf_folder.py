"""Hugging Face model folders written by `bridge.save_pretrained(folder, model,
max_shard_size=..., config=...)`, without torch: shard cutting and names as
`huggingface_hub` does them, the index, `{"format": "pt"}`, the configuration, byte
ranges of array shards cut along any axis, atomic as a whole (a save killed with
SIGKILL in the middle leaves the previous folder)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import bridge
from bridge._io import _hf_folder
from bridge._io._hf_folder import plan_folder, runs, shard_size

from .helpers import needs_devices, requires
from .hf_common import node
from .processes import checkout_env


pytestmark = requires("NNX")


class MLP(nnx.Module):
    def __init__(self, width=8, depth=4, seed=0):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List(
            [nnx.Linear(width, width, rngs=rngs) for _ in range(depth)]
        )
        self.norm = nnx.LayerNorm(width, rngs=rngs)


def _expected(model):
    """The model's arrays in PyTorch layout, as one safetensors file holds them."""
    return {
        k: np.asarray(v)
        for k, v in bridge._io._torch_layout.torch_state(bridge.from_nnx(model)).items()
    }


def _folder(folder):
    """Every array of a folder's shards, by name, and the shards' metadata."""
    arrays, metas = {}, []
    for file in sorted(folder.glob("*.safetensors")):
        with safetensors.safe_open(file, "np") as f:
            metas.append(f.metadata())
            arrays.update({k: f.get_tensor(k) for k in f.keys()})
    return arrays, metas


def test_sizes_as_save_pretrained_reads_them():
    assert shard_size("5GB") == 5 * 10**9
    assert shard_size(" 1.5 mb ") == 1_500_000
    assert shard_size(100) == 100
    for bad in ("5GiB", "GB", "-1KB", 0, "nanKB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            shard_size(bad)
    for bad in (True, 2.5, [1]):
        with pytest.raises(TypeError, match="max_shard_size"):
            shard_size(bad)


@pytest.mark.torch
def test_shards_cut_as_huggingface_hub_cuts_them():
    hub = pytest.importorskip("huggingface_hub")
    sizes = [40, 40, 16, 200, 8, 8, 40]  # bytes: one larger than the limit
    tensors = [(f"t{i}", (n // 4,), "float32") for i, n in enumerate(sizes)]
    split = hub.split_state_dict_into_shards_factory(
        {name: n for (name, _, _), n in zip(tensors, sizes)},
        get_storage_size=lambda n: n,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=100,
    )
    plan = plan_folder(tensors, 100)
    assert plan.index is not None
    assert plan.index["weight_map"] == split.tensor_to_filename
    assert plan.index["metadata"]["total_size"] == split.metadata["total_size"]
    assert list(plan.shards) == list(split.filename_to_tensors)
    one = plan_folder(tensors, "1MB")
    assert list(one.shards) == ["model.safetensors"] and one.index is None


def test_runs_of_blocks_cut_along_each_axis():
    full = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    for index in [
        (slice(None),) * 3,
        (slice(1, 2), slice(None), slice(None)),
        (slice(None), slice(1, 3), slice(None)),
        (slice(None), slice(None), slice(2, 4)),
        (slice(1, 2), slice(0, 2), slice(1, 3)),
    ]:
        flat = full.reshape(-1)
        got = np.concatenate(
            [flat[start : start + n] for start, n in runs(index, full.shape, 1)]
        )
        assert np.array_equal(got, full[index].reshape(-1)), index


def test_folder_holds_every_array_in_shards_with_index_and_config(tmp_path):
    model = MLP()
    config = {"model_type": "mlp", "hidden_size": 8}
    out = tmp_path / "out"
    bridge.save_pretrained(out, model, max_shard_size=400, config=config)
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert shards == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert names == sorted([*shards, "config.json", "model.safetensors.index.json"])
    assert json.loads((out / "config.json").read_text()) == config
    index = json.loads((out / "model.safetensors.index.json").read_text())
    arrays, metas = _folder(out)
    expected = _expected(model)
    assert set(arrays) == set(expected) == set(index["weight_map"])
    assert all(np.array_equal(arrays[k], expected[k]) for k in expected)
    assert all(m == {"format": "pt"} for m in metas)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in expected.values())
    # bridge reads it back (a sharded PyTorch-layout folder) into the model
    back = bridge.load(out, like=MLP(seed=1))
    assert np.array_equal(back.layers[3].kernel[...], model.layers[3].kernel[...])


@needs_devices(8)
def test_sharded_arrays_are_written_shard_by_shard(tmp_path):
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    model = MLP(width=16, depth=2)
    plain = tmp_path / "plain"
    bridge.save_pretrained(plain, model, max_shard_size=1200)
    specs = {  # every way of cutting a matrix and a vector
        ".layers[0].kernel": P("a", "b"),
        ".layers[1].kernel": P(None, "b"),
        ".layers[0].bias": P("a"),
        ".norm.scale": P("b"),
    }

    def place(path, x):
        spec = specs.get(jax.tree_util.keystr(path), P())
        return jax.device_put(x, NamedSharding(mesh, spec))

    tree = jax.tree_util.tree_map_with_path(place, bridge.from_nnx(model))
    assert not tree.layers[1].kernel.sharding.is_fully_replicated
    sharded = tmp_path / "sharded"
    written = _hf_folder.save_folder(sharded, tree, max_shard_size=1200)
    for file in plain.iterdir():
        assert (sharded / file.name).read_bytes() == file.read_bytes(), file.name
    assert written.nbytes == written.plan.index["metadata"]["total_size"]


def test_a_config_from_the_folder_the_weights_came_from(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "x"}\n')
    (source / "generation_config.json").write_text('{"max_length": 5}\n')
    out = tmp_path / "out"
    bridge.save_pretrained(out, MLP(), config=source)
    assert (out / "config.json").read_text() == '{"model_type": "x"}\n'
    assert (out / "generation_config.json").read_text() == '{"max_length": 5}\n'
    assert (out / "model.safetensors").is_file()  # one shard: no index
    assert not (out / "model.safetensors.index.json").exists()


def test_resaving_replaces_the_weights_and_keeps_other_files(tmp_path):
    out = tmp_path / "out"
    bridge.save_pretrained(out, MLP(), max_shard_size=300, config={"a": 1})
    (out / "tokenizer.json").write_text("{}")
    bridge.save_pretrained(out, MLP(seed=2))
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary
    arrays, _ = _folder(out)
    expected = _expected(MLP(seed=2))
    assert all(np.array_equal(arrays[k], expected[k]) for k in expected)


def test_errors_name_the_argument_and_the_fix(tmp_path):
    with pytest.raises(
        ValueError, match="save_pretrained writes a Hugging Face folder"
    ):
        bridge.save_pretrained(tmp_path / "a.safetensors", MLP(), max_shard_size="1GB")
    with pytest.raises(TypeError, match="unexpected keyword argument 'config'"):
        bridge.save_state_dict(tmp_path / "a.safetensors", MLP(), config={})
    with pytest.raises(ValueError, match="max_shard_size"):
        bridge.save_pretrained(tmp_path / "b", MLP(), max_shard_size="5 apples")
    with pytest.raises(TypeError, match="`config` must be a transformers"):
        bridge.save_pretrained(tmp_path / "c", MLP(), config=3)
    with pytest.raises(ValueError, match="holding config.json"):
        bridge.save_pretrained(tmp_path / "d", MLP(), config=tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a Hugging Face model folder"):
        bridge.save_pretrained(other, MLP())
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


_SLOW_SAVE = """
import sys, time
from flax import nnx
import bridge
from bridge._io import _hf_folder
from tests.test_hf_folder import MLP

write = _hf_folder.write_block
def slow(*args):
    time.sleep(0.05)
    return write(*args)
_hf_folder.write_block = slow
bridge.save_pretrained(sys.argv[1], MLP(seed=3), max_shard_size=300)
"""


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_folder(tmp_path):
    out = tmp_path / "out"
    bridge.save_pretrained(out, MLP(), max_shard_size=300, config={"a": 1})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    root = Path(bridge.__file__).parent.parent
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SAVE, str(out)], env=checkout_env(), cwd=root
    )
    tmp = tmp_path / ".out.bridge-tmp"
    deadline = time.monotonic() + 120
    while not (tmp.is_dir() and len(list(tmp.iterdir())) >= 2):
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)  # some array bytes written
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    back = bridge.load(out, like=MLP(seed=1))
    assert np.array_equal(back.layers[0].kernel[...], MLP().layers[0].kernel[...])
    bridge.save_pretrained(out, MLP(seed=4), max_shard_size=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing partial
    arrays, _ = _folder(out)
    expected = _expected(MLP(seed=4))
    assert set(arrays) == set(expected)
    assert all(np.array_equal(arrays[k], expected[k]) for k in expected)


def test_convert_writes_a_folder(tmp_path, capsys):
    from bridge._cli import main

    src = tmp_path / "mlp.safetensors"
    bridge.save(src, MLP())
    (tmp_path / "config.json").write_text('{"model_type": "mlp"}')
    out = tmp_path / "out"
    argv = ["convert", str(src), str(out), "--to-layout", "torch"]
    more = ["--max-shard-size", "300", "--config", str(tmp_path / "config.json")]
    assert main([*argv, *more]) == 0
    assert "Hugging Face folder" in capsys.readouterr().out
    assert (out / "config.json").read_text() == '{"model_type": "mlp"}'
    arrays, metas = _folder(out)
    expected = _expected(MLP())
    assert len(metas) == 5 and set(arrays) == set(expected)
    assert all(np.array_equal(arrays[k], expected[k]) for k in expected)
    with pytest.raises(SystemExit) as usage:
        main(["convert", str(src), str(tmp_path / "x.msgpack"), *more])
    assert usage.value.code == 2
    assert "apply only to a Hugging Face folder" in capsys.readouterr().err


def test_convert_to_a_folder_without_config_says_how_to_add_it(tmp_path, capsys):
    """A folder without config.json is one `from_pretrained` cannot open ("Should
    have a `model_type` key in its config.json"): the command says so, and names
    the folder the weights came from as the --config to pass."""
    from bridge._cli import main

    hub = tmp_path / "hub"  # a save_pretrained folder
    bridge.save_pretrained(hub, MLP(), config={"model_type": "mlp"})
    out = tmp_path / "out"
    assert main(["convert", str(hub), str(out), "--to-layout", "torch"]) == 0
    assert not (out / "config.json").exists()
    said = capsys.readouterr().out
    assert "no config.json" in said and "from_pretrained" in said
    assert f"--config {hub}" in said and "--overwrite" in said
    assert len(said.strip().splitlines()) == 2  # the summary and the note
    argv = ["convert", str(hub), str(out), "--to-layout", "torch", "--overwrite"]
    assert main([*argv, "--config", str(hub)]) == 0
    assert "config.json" not in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text()) == {"model_type": "mlp"}
    arrays, _ = _folder(out)
    expected = _expected(MLP())
    assert all(np.array_equal(arrays[k], expected[k]) for k in expected)


class Expert(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(8, 4, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(8, 4, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(4, 8, use_bias=False, rngs=rngs)


def MoE():
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def experts(rngs):
        return Expert(rngs)

    router = nnx.Linear(8, 4, use_bias=False, rngs=nnx.Rngs(1))
    return node(mlp=node(gate=router, experts=experts(nnx.Rngs(0))))


@needs_devices(8)
def test_packed_experts_from_sharded_stacks(tmp_path):
    model = MoE()
    plain = tmp_path / "plain"
    bridge.save_pretrained(plain, model, packed_experts="qwen2_moe")
    arrays, _ = _folder(plain)
    stack = model.mlp.experts
    gate, up = stack.gate_proj.kernel[...], stack.up_proj.kernel[...]  # (E, D, F)
    packed = np.concatenate([np.swapaxes(gate, 1, 2), np.swapaxes(up, 1, 2)], 1)
    assert np.array_equal(arrays["mlp.experts.gate_up_proj"], packed)
    down = np.swapaxes(stack.down_proj.kernel[...], 1, 2)
    assert np.array_equal(arrays["mlp.experts.down_proj"], down)
    # the expert axis and a later one sharded: each block written into its place
    mesh = jax.make_mesh((4, 2), ("e", "x"), axis_types=(AxisType.Auto,) * 2)
    tree = jax.tree_util.tree_map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P("e", "x"))),
        bridge.from_nnx(model),
    )
    sharded = tmp_path / "sharded"
    _hf_folder.save_folder(sharded, tree, packed_experts="qwen2_moe")
    assert (sharded / "model.safetensors").read_bytes() == (
        plain / "model.safetensors"
    ).read_bytes()
    with pytest.raises(ValueError, match="`packed_experts` must be one of"):
        bridge.save_pretrained(tmp_path / "x", model, packed_experts="gpt")


def test_read_runs_reads_only_those_bytes(tmp_path, monkeypatch):
    """The reads a process makes for its part of an array (the 2-process test reads
    whole folders this way): the elements of each run, in order, from those bytes
    alone; every dtype's elements, bfloat16 included."""
    from bridge._io import _read, _safetensors

    arrays = {
        "a": np.arange(60, dtype=np.float32).reshape(6, 10),
        "b": np.arange(24, dtype=np.int16).reshape(4, 6),
        "c": (np.arange(12, dtype=np.float32) / 7).astype(jax.numpy.bfloat16),
    }
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, path, metadata={"format": "pt"})
    read = []
    real = _safetensors.read_at

    def counted(fd, offset, count, into=None):
        read.append(count)
        return real(fd, offset, count, into)

    lazy = _read.lazy(_read.open_checkpoint(path))
    assert lazy is not None
    monkeypatch.setattr(_safetensors, "read_at", counted)
    for name, wanted in [
        ("a", [(0, 3), (10, 3), (57, 3)]),
        ("b", [(5, 7)]),
        ("c", [(11, 1)]),
    ]:
        read.clear()
        got = lazy[name].read_runs(wanted)
        flat = arrays[name].reshape(-1)
        want = np.concatenate([flat[s : s + n] for s, n in wanted])
        assert got.dtype == want.dtype and np.array_equal(got, want), name
        item = want.dtype.itemsize
        assert read == [n * item for _, n in wanted]  # only those bytes


def test_a_load_converts_like_to_a_tree_once(tmp_path, monkeypatch):
    """`bridge.load` makes `like`'s Tree to check the folder against and plans the
    port with that Tree: `like` is not converted a second time (~35 ms for the
    benchmarks' 14-layer Llama), and the model loaded is the same, bit for bit."""
    from bridge._adapters import _native

    source = MLP(seed=0)
    bridge.save_pretrained(tmp_path, source, max_shard_size=300)
    like = nnx.eval_shape(lambda: MLP(seed=1))
    converted = []
    adapter_of = _native.adapter_of

    def counted(obj):  # the adapter, its conversions to a Tree recorded
        adapter = adapter_of(obj)

        def to_tree(model):
            converted.append(type(model).__name__)
            return adapter.to_tree(model)

        return adapter._replace(to_tree=to_tree)

    monkeypatch.setattr(_native, "adapter_of", counted)
    loaded = bridge.load(tmp_path, like=like)
    assert converted == ["MLP"]
    for a, b in zip(
        jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(source))
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
