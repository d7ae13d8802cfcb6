"""`bridge convert` keeps the order in which a file's model uses its arrays (the
metadata `order` that `bridge.save(path, model, example=...)` records), in every
format that holds metadata and through every change of layout, under the converted
names: the converted file still loads, by example, into a model with names of its
own. A msgpack file holds none: convert says so in one line, and `bridge.save`
refuses `example=` there rather than drop it. Each case failed on the old code
(the order was dropped by msgpack, a Hugging Face folder and every `--to-layout`)."""

import numpy as np
import pytest

import bridge
from bridge._cli import main
from bridge._io._read import open_checkpoint

from .helpers import requires
from .test_checkpoint_order import X, _mine, _theirs


pytestmark = requires("NNX")

USED = ("up", "up", "mid", "mid", "down", "down")  # the layer of each, in order
CONVERSIONS = {  # destination, options: the names the order gives, layer by layer
    "kept.safetensors": [],
    "kept_orbax": [],
    "kept.safetensors.index.json": [],
    "equinox.safetensors": ["--to-layout", "equinox"],
    "torch.safetensors": ["--to-layout", "torch"],
    "torch_folder": ["--to-layout", "torch"],
    "torch_shards": ["--to-layout", "torch", "--max-shard-size", "100"],
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    module, variables = _theirs()
    path = tmp_path_factory.mktemp("order") / "theirs.safetensors"
    bridge.save(path, (module, variables), example=(X,))
    return path, np.asarray(module.apply(variables, X))


def _order(path):
    with open_checkpoint(path) as contents:
        return contents.order


@pytest.mark.parametrize("dst", sorted(CONVERSIONS))
def test_convert_keeps_the_order_under_the_new_names(source, tmp_path, dst):
    path, want = source
    out = tmp_path / dst
    assert main(["convert", str(path), str(out), *CONVERSIONS[dst]]) == 0
    order = _order(out)
    assert tuple(name.split(".")[0] for name in order) == USED, order
    mine = bridge.load(out, like=_mine(), example=(X,))
    np.testing.assert_allclose(np.asarray(mine(X)), want, rtol=1e-6, atol=1e-6)


def test_a_change_of_layout_and_back_keeps_it(source, tmp_path):
    path, want = source
    eqx_file, flax_file = tmp_path / "e.safetensors", tmp_path / "f.safetensors"
    assert main(["convert", str(path), str(eqx_file), "--to-layout", "equinox"]) == 0
    assert main(["convert", str(eqx_file), str(flax_file), "--to-layout", "flax"]) == 0
    assert _order(flax_file) == _order(path)
    mine = bridge.load(flax_file, like=_mine(), example=(X,))
    np.testing.assert_allclose(np.asarray(mine(X)), want, rtol=1e-6, atol=1e-6)


def test_msgpack_says_it_drops_the_order(source, tmp_path, capsys):
    path, _ = source
    out = tmp_path / "theirs.msgpack"
    assert main(["convert", str(path), str(out)]) == 0
    printed = capsys.readouterr().out
    notes = [line for line in printed.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, printed
    assert (
        "holds no metadata, so the order in which the model uses its arrays"
        in (notes[0])
    )
    assert "write theirs.safetensors or an orbax directory to keep it" in notes[0]
    assert _order(out) == ()
    with pytest.raises(bridge.PortError, match="ambiguous"):
        bridge.load(out, like=_mine(), example=(X,))


def test_save_refuses_example_in_msgpack(tmp_path):
    module, variables = _theirs()
    with pytest.raises(ValueError, match="no metadata to record the order"):
        bridge.save(tmp_path / "t.msgpack", (module, variables), example=(X,))
    assert not list(tmp_path.iterdir())
    bridge.save(tmp_path / "t.msgpack", (module, variables))  # without: as before
