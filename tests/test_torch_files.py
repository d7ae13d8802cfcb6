"""PyTorch-layout files without torch: safetensors files and sharded Hugging Face
checkpoints made with numpy, loaded into Flax models, inspected, converted, written
back; pickle files refused."""

import json

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import bridge
from bridge._cli import main

from .helpers import requires


pytestmark = requires("NNX")  # the targets are NNX models


R = np.random.default_rng(0)


def _state():
    """An `nn.Sequential(Linear(3, 4), LayerNorm(4), Linear(4, 2))` state dict, as
    PyTorch names and lays it out."""
    f = lambda *s: R.normal(size=s).astype("f4")  # noqa: E731
    return {
        "0.weight": f(4, 3),
        "0.bias": f(4),
        "1.weight": f(4),
        "1.bias": f(4),
        "2.weight": f(2, 4),
        "2.bias": f(2),
    }


class Net(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.layers = nnx.List(
            [
                nnx.Linear(3, 4, rngs=rngs),
                nnx.LayerNorm(4, epsilon=1e-5, rngs=rngs),
                nnx.Linear(4, 2, rngs=rngs),
            ]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _reference(sd, x):
    """PyTorch's definitions: y = x W^T + b, LayerNorm with eps 1e-5."""
    h = x @ sd["0.weight"].T + sd["0.bias"]
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    h = h * sd["1.weight"] + sd["1.bias"]
    return h @ sd["2.weight"].T + sd["2.bias"]


def _shards(tmp_path, sd, split=2):
    names = list(sd)
    files = {}
    for i in range(0, len(names), split):
        file = f"model-{i // split + 1:05d}.safetensors"
        part = {n: sd[n] for n in names[i : i + split]}
        safetensors.numpy.save_file(part, tmp_path / file, metadata={"format": "pt"})
        files.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": files}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


def test_file_into_nnx(tmp_path):
    sd = _state()
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(sd, path, metadata={"format": "pt"})
    x = R.normal(size=(2, 3)).astype("f4")
    model = bridge.load(path, like=Net())
    np.testing.assert_allclose(model(x), _reference(sd, x), rtol=1e-5, atol=1e-5)
    tree = bridge.load(path)
    assert bridge.roles(tree)[0].weight == "params"
    back = bridge.to_torch(tree)
    assert back.keys() == sd.keys()
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k])


@pytest.mark.parametrize("where", ["directory", "index"])
def test_sharded(tmp_path, where):
    sd = _state()
    folder = _shards(tmp_path, sd)
    path = folder if where == "directory" else folder / "model.safetensors.index.json"
    x = R.normal(size=(2, 3)).astype("f4")
    model = bridge.load(path, like=Net())
    np.testing.assert_allclose(model(x), _reference(sd, x), rtol=1e-5, atol=1e-5)
    tree = bridge.load(path)
    assert set(bridge.to_torch(tree)) == set(sd)


def test_sharded_index_errors(tmp_path):
    sd = _state()
    folder = _shards(tmp_path, sd)
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["0.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a file name in the index's directory"):
        bridge.load(folder)
    data["weight_map"]["0.weight"] = "model-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(
        ValueError, match=r"maps 1 name\(s\) to model-00002.*'0\.weight'"
    ):
        bridge.load(index)


def test_pickle_refused(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"not read")
    with pytest.raises(ValueError, match="(?s)never unpickles.*weights_only=True"):
        bridge.load(path)


def test_inspect_and_convert_round_trip(tmp_path, capsys):
    sd = _state()
    folder = _shards(tmp_path, sd)
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "torch layout" in out and "2.weight" in out
    flax_file, back = tmp_path / "flax.safetensors", tmp_path / "back.safetensors"
    assert main(["convert", str(folder), str(flax_file), "--to-layout", "flax"]) == 0
    flax = safetensors.numpy.load_file(flax_file)
    np.testing.assert_array_equal(flax["0.kernel"], sd["0.weight"].T)
    np.testing.assert_array_equal(flax["1.scale"], sd["1.weight"])
    assert main(["convert", str(flax_file), str(back), "--to-layout", "torch"]) == 0
    again = safetensors.numpy.load_file(back)
    assert again.keys() == sd.keys()
    for k in sd:
        np.testing.assert_array_equal(again[k], sd[k])


def test_save_torch_layout_and_reload(tmp_path):
    model = Net()
    path = tmp_path / "out.safetensors"
    bridge.save_state_dict(path, model, rules={r"\[(\d+)\]": r".layers[\1]"})
    saved = safetensors.numpy.load_file(path)
    assert set(saved) == set(_state())
    np.testing.assert_array_equal(
        saved["0.weight"], np.asarray(model.layers[0].kernel).T
    )
    x = R.normal(size=(2, 3)).astype("f4")
    np.testing.assert_allclose(_reference(saved, x), model(x), rtol=1e-5, atol=1e-5)


def test_save_layout_errors(tmp_path):
    model = Net()
    with pytest.raises(ValueError, match='`layout` must be "torch"'):
        bridge.save(tmp_path / "a.safetensors", model, layout="flax")
    with pytest.raises(ValueError, match="is a safetensors file"):
        bridge.save_state_dict(tmp_path / "a.msgpack", model)
    with pytest.raises(ValueError, match="cannot be read backwards"):
        bridge.save_state_dict(
            tmp_path / "a.safetensors", model, rules={r".*": ".layers[0]"}
        )
    with pytest.raises(ValueError, match="would all be written as"):
        bridge.save_state_dict(
            tmp_path / "a.safetensors", model, rules={r"\.layers\[2\]": ".layers[0]"}
        )
    assert not (tmp_path / "a.safetensors").exists()
