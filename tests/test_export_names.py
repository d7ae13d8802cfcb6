"""The names a PyTorch-layout export (`bridge.save_pretrained`) gives a
Linen model's list elements (issue #37, harness A's ResNet export): Linen's `setup`
names `self.layers = [A(), B()]` `layers_0`, `layers_1`, PyTorch's `nn.ModuleList`
`layers.0`, `layers.1`; a module holding its list under its own name (Flax
ResNet's `layer.layer_0`) takes the reference's `layer.0` when `like` is given.
Without torch: the names are asserted as `nn.ModuleList` gives them (the PyTorch
side of this, `from_pretrained` reading a Linen BERT's export, is
`tests/test_torch_hf.py::test_bert_files_sharded_and_export[linen]`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import linen as nn

import bridge
from bridge._io._torch_layout import fitted


X = jnp.ones((1, 4))


class Listed(nn.Module):
    """A list in `setup`, beside a compact-named child."""

    def setup(self):
        self.layers = [nn.Dense(4), nn.Dense(4)]
        self.head = nn.Dense(2)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Compact(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.Dense(4)(x))


class Collection(nn.Module):
    """Holds its list under its own name (transformers' Flax ResNet
    `FlaxResNetBasicLayerCollection`)."""

    def setup(self):
        self.layer = [nn.Dense(4), nn.Dense(4)]

    def __call__(self, x):
        for layer in self.layer:
            x = layer(x)
        return x


class Wrapped(nn.Module):
    def setup(self):
        self.layer = Collection()

    def __call__(self, x):
        return self.layer(x)


def _saved(tmp_path, module, **options):
    variables = module.init(jax.random.key(0), X)
    path = tmp_path / "model.safetensors"
    bridge.save_state_dict(path, (module, variables), **options)
    return variables["params"], safetensors.numpy.load_file(path)


def _entries(*layers):
    return [f"{layer}.{entry}" for layer in layers for entry in ("bias", "weight")]


def test_a_setup_list_is_written_as_a_module_list(tmp_path):
    params, written = _saved(tmp_path, Listed())
    assert sorted(written) == _entries("head", "layers.0", "layers.1")
    np.testing.assert_array_equal(
        written["layers.1.weight"], params["layers_1"]["kernel"].T
    )


def test_compact_auto_names_stay(tmp_path):
    _, written = _saved(tmp_path, Compact())
    assert sorted(written) == _entries("Dense_0", "Dense_1")


def test_a_list_under_its_own_name_takes_the_reference_s_names(tmp_path):
    """`layer.layer_0` is `layer.layer.0` alone, `layer.0` with a reference that
    names it so (its values checked: the kernel transposed)."""
    _, alone = _saved(tmp_path, Wrapped())
    assert sorted(alone)[:2] == ["layer.layer.0.bias", "layer.layer.0.weight"]
    like = {
        f"layer.{i}.{entry}": np.zeros(shape, np.float32)
        for i in range(2)
        for entry, shape in (("weight", (4, 4)), ("bias", (4,)))
    }
    params, written = _saved(tmp_path, Wrapped(), like=like)
    assert sorted(written) == sorted(like)
    kernel = params["layer"]["layer_1"]["kernel"]
    np.testing.assert_array_equal(written["layer.1.weight"], kernel.T)


def test_a_name_that_fits_several_stays_and_is_refused(tmp_path):
    """Two written names alike once normalised: neither is renamed (no guess), and
    the reference check lists them."""
    known = ["blocks.0.weight", "blocks.0.bias"]
    names = ["blocks.blocks.0", "blocks_blocks.0"]
    assert fitted(names, "", known) == names
    assert fitted(["blocks.blocks.0"], "", known) == ["blocks.0"]
    assert fitted(["blocks.blocks.0"], "", None) == ["blocks.blocks.0"]
    like = {"layer.0.weight": np.zeros((4, 4), np.float32)}
    with pytest.raises(ValueError, match=r"differ from the reference"):
        _saved(tmp_path, Wrapped(), like=like)
