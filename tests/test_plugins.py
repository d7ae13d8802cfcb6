"""The plug-ins of `save` and `load` (`bridge._io._plugins`): a kind of stored weights
a layer above `_io` knows (quantized schemes: `bridge._quant`) is registered, and
`load`/`save` ask it at their steps. Toy plug-ins registered from inside the tests
show each capability is asked where the module's note says, and only then; the
walk of `load`'s `like` through the layers (`scripts/walk_layers.py`) stays short."""

import json
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from flax import nnx

import bridge
from bridge._io import _plugins
from bridge._io._plugins import Filled, Plugin, Quantizer, register_plugin
from bridge._lazy import LazyArray

from .helpers import script


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(_plugins, "_PLUGINS", dict(_plugins._PLUGINS))


def _doubled(contents, arrays, dtype):
    """A toy kind of weights: a file marked `{"toy": "halved"}` stores each array
    halved; a dense model holds it doubled back."""
    if contents.metadata.get("toy") != "halved":
        return None
    return {
        name: LazyArray(a.shape, a.dtype, a.order, lambda a=a: np.asarray(a.read()) * 2)
        for name, a in arrays.items()
    }


def test_the_quantized_plugin_is_registered_from_its_own_layer():
    names = [p.name for p in _plugins.plugins()]
    assert "quantized" in names
    found = _plugins.quantizer("fp8-block")
    assert found is not None and found.name == "fp8-block"


def test_a_plugin_reads_the_arrays_dense(tmp_path, registry):
    register_plugin(Plugin("toy", dense=_doubled))
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    kernel = np.asarray(model.kernel[...])
    marked, plain = tmp_path / "marked.safetensors", tmp_path / "plain.safetensors"
    bridge.save(marked, model, metadata={"toy": "halved"})
    bridge.save(plain, model)
    # without like: every array read now, the plug-in's way for its files only
    np.testing.assert_array_equal(bridge.load(marked).kernel, kernel * 2)
    np.testing.assert_array_equal(bridge.load(plain).kernel, kernel)
    # into another framework's model: ported, read lazily through the plug-in
    like = eqx.nn.Linear(2, 3, key=jax.random.key(1))
    np.testing.assert_array_equal(bridge.load(marked, like=like).weight, kernel.T * 2)
    np.testing.assert_array_equal(bridge.load(plain, like=like).weight, kernel.T)


def test_a_plugin_serving_an_option_is_asked_only_with_it(tmp_path, registry):
    asked = []

    def check(request):
        asked.append(("check", request.keep_quantized))

    def fill(contents, request):
        asked.append(("fill", request.keep_quantized))
        return Filled("filled by the toy", None, None)

    # after the quantized plug-in, which declines a file with nothing quantized
    register_plugin(Plugin("toy", option="keep_quantized", check=check, fill=fill))
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    path = tmp_path / "linear.safetensors"
    bridge.save(path, model)
    loaded = bridge.load(path, like=nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
    assert isinstance(loaded, nnx.Linear) and asked == []
    kept = bridge.load(
        path, like=nnx.Linear(2, 3, rngs=nnx.Rngs(1)), keep_quantized=True
    )
    assert kept == "filled by the toy"
    assert asked == [("check", True), ("fill", True)]


def test_a_plugin_checks_arguments_before_the_file_is_opened(tmp_path, registry):
    def check(request):
        raise TypeError("the toy refuses")

    register_plugin(Plugin("toy", option="keep_quantized", check=check))
    like = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="the toy refuses"):
        bridge.load(tmp_path / "missing.safetensors", like=like, keep_quantized=True)
    with pytest.raises(FileNotFoundError):
        bridge.load(tmp_path / "missing.safetensors", like=like)


def test_save_asks_each_plugin_and_takes_its_quantizer(tmp_path, registry):
    seen = []

    def check_save(path, tree):
        seen.append(Path(path).name)

    def state(state, linear):
        return {k: np.asarray(v) * 0 for k, v in state.items()}

    def config(folder):
        (folder / "toy.json").write_text(json.dumps({"toy": True}))

    toy = Quantizer("zeros", state, config)
    register_plugin(Plugin("toy", check_save=check_save, quantizers=(toy,)))
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    path = tmp_path / "linear.safetensors"
    bridge.save_quantized(path, model, "zeros")
    assert seen == ["linear.safetensors"]
    assert json.loads((tmp_path / "toy.json").read_text()) == {"toy": True}
    back = bridge.load(path)
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(back))
    with pytest.raises(ValueError, match=r"one of \('fp8-block', 'zeros'\)"):
        bridge.save_quantized(path, model, "ones")


def test_registry_refuses_a_second_plugin_of_a_name(registry):
    register_plugin(Plugin("toy"))
    with pytest.raises(ValueError, match="'toy' is registered already"):
        register_plugin(Plugin("toy"))
    with pytest.raises(TypeError, match="must be a Plugin"):
        register_plugin({"name": "x"})


def test_the_walk_of_a_kept_load_climbs_at_most_10_times(tmp_path):
    walk_layers = script("walk_layers")
    layer = walk_layers._layers(ROOT / "tests" / "test_imports.py")
    run, like = walk_layers.scenarios(tmp_path)["load, FP8 kept quantized"]
    run()
    walked = walk_layers.walk(run, like, layer)
    assert "bridge._quant._keep" in walked.rooms  # the walk sees the plug-in
    assert len(walked.climbs) <= 10, walked.stays
    # every call from _io into _quant is a capability a plug-in registered
    registered = {
        f"{fn.__module__}.{fn.__name__}"
        for p in _plugins.plugins()
        for fn in (p.check, p.dense, p.fill, p.check_save)
        if fn is not None
    }
    into_quant = {
        callee
        for caller, callee in walked.calls_up
        if caller.startswith("bridge._io.") and callee.startswith("bridge._quant.")
    }
    assert into_quant and into_quant <= registered
