"""`bridge.load_peft` of adapter configs that lie (round 3 of the hostile-input
audit): `lora_alpha` NaN or Infinity (Python's json reads both) scaled every adapter
to NaN; `r: 10**12` allocated terabytes before its shapes were compared; an adapter
naming 20,000 missing layers gave a 1.6 MB message; control characters reached the
terminal. Each is one bounded `ValueError` naming the key."""

import json
import resource

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import bridge

from .helpers import skip_unless


class M(nnx.Module):
    def __init__(self):
        self.fc = nnx.Linear(4, 6, rngs=nnx.Rngs(0))


def _adapter(tmp_path, config_text, tensors=None):
    tensors = tensors or {
        "base_model.model.fc.lora_A.weight": np.ones((2, 4), np.float32),
        "base_model.model.fc.lora_B.weight": np.ones((6, 2), np.float32),
    }
    safetensors.numpy.save_file(tensors, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(config_text)
    return tmp_path


BASE = '{"r": 2, "target_modules": ["fc"], '


@pytest.mark.parametrize(
    "text, match",
    [
        (BASE + '"lora_alpha": NaN}', "lora_alpha is nan, not a finite number"),
        (BASE + '"lora_alpha": Infinity}', "lora_alpha is inf"),
        (BASE + '"lora_alpha": -Infinity}', "lora_alpha is -inf"),
        (
            BASE + '"lora_alpha": 4, "alpha_pattern": {"fc": NaN}}',
            "alpha_pattern is {'fc': nan}, not a map of names to finite numbers",
        ),
        (
            BASE + '"lora_alpha": 4, "lora_dropout": NaN}',
            "lora_dropout is nan",
        ),
    ],
)
def test_nan_and_infinite_settings_are_refused_by_name(tmp_path, text, match):
    skip_unless("NNX")
    with pytest.raises(ValueError, match=match):
        bridge.load_peft(_adapter(tmp_path, text), M())


@pytest.mark.parametrize(
    "config, shown",
    [
        ({"r": 10**12, "lora_alpha": 4, "target_modules": ["fc"]}, "r is 10"),
        ({"r": 2**62, "lora_alpha": 4, "target_modules": ["fc"]}, "r is 46"),
        (
            {
                "r": 2,
                "lora_alpha": 4,
                "target_modules": ["fc"],
                "rank_pattern": {"fc": 10**12},
            },
            "rank_pattern is {'fc': 10",
        ),
        (
            {
                "r": 2,
                "lora_alpha": 4,
                "target_modules": ["fc"],
                "rank_pattern": {"fc": 2**62},
            },
            "rank_pattern is {'fc': 46",
        ),
    ],
)
def test_a_huge_rank_allocates_nothing(tmp_path, config, shown):
    """`r: 10**12` was `MemoryError: Unable to allocate 3.64 TiB`; `r: 2**62` then
    NumPy's raw `ValueError: iterator is too large` (even the zero-strided views
    that compare shapes overflow). A rank above 2**31 - 1 is refused by name."""
    skip_unless("NNX")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(bridge.CheckpointError) as info:
        bridge.load_peft(_adapter(tmp_path, json.dumps(config)), M())
    message = str(info.value)
    assert f"adapter_config.json: {shown}" in message, message
    assert "below 2**31" in message, message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100 * 1024


def test_20000_missing_layers_give_a_bounded_message(tmp_path):
    skip_unless("NNX")
    tensors = {
        f"base_model.model.layer{i}.lora_{x}.weight": np.ones((1, 1), np.float32)
        for i in range(10_000)
        for x in "AB"
    }
    config = {"r": 1, "lora_alpha": 1, "target_modules": ["fc"]}
    with pytest.raises(ValueError) as info:
        bridge.load_peft(_adapter(tmp_path, json.dumps(config), tensors), M())
    message = str(info.value)
    assert "20001 problem(s)" in message and "... and 19981 more" in message
    assert len(message) < 5_000


def test_control_characters_are_escaped(tmp_path):
    skip_unless("NNX")
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["fc", "\x1b[2J\x07"]}
    with pytest.raises(ValueError) as info:
        bridge.load_peft(_adapter(tmp_path, json.dumps(config)), M())
    message = str(info.value)
    assert "\\x1b[2J\\x07" in message
    assert not any(ord(c) < 32 and c != "\n" for c in message)


class Two(nnx.Module):
    def __init__(self):
        self.fc = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
        self.g = nnx.Linear(6, 3, rngs=nnx.Rngs(1))


_PAIR = {
    "base_model.model.fc.lora_A.weight": np.ones((2, 4), np.float32),
    "base_model.model.fc.lora_B.weight": np.ones((6, 2), np.float32),
}


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            {"base_model.model.fc.lora_magnitude_vector": np.ones(6, np.float32)},
            r"fc\.lora_magnitude_vector: not a tensor of a LoRA adapter \(the layer's "
            r"adapter is base_model\.model\.fc\.lora_A\.weight and "
            r"base_model\.model\.fc\.lora_B\.weight; DoRA's",
        ),
        (
            {"base_model.model.fc.lora_A.default.weight": np.ones((2, 4), np.float32)},
            r"fc\.lora_A\.default\.weight: not a tensor of a LoRA adapter",
        ),
        (
            {
                "base_model.model.g.lora_A.weight": np.ones((2, 6), np.float32),
                "base_model.model.g.lora_B.weight": np.ones((3, 2), np.float32),
            },
            r"g\.lora_A\.weight: target_modules \['fc'\] leave out 'g', so its "
            r"adapter would be dropped: add it to target_modules",
        ),
    ],
    ids=["DoRA magnitude", "adapter name", "layer left out"],
)
def test_tensors_the_adapter_would_drop_are_refused(tmp_path, extra, match):
    """Tensors of a model's layer that the LoRA config does not read (DoRA's
    magnitude with use_dora false, PEFT's in-memory `.default` names, a layer that
    target_modules leaves out) were dropped without a word: the adapter loaded
    as if the file held only its lora_A and lora_B."""
    skip_unless("NNX")
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["fc"]}
    folder = _adapter(tmp_path, json.dumps(config), {**_PAIR, **extra})
    with pytest.raises(ValueError, match=match) as info:
        bridge.load_peft(folder, Two())
    assert "1 problem(s)" in str(info.value) or "2 problem(s)" in str(info.value)
    (tmp_path / "ok").mkdir()  # without the extra tensors: loads
    loaded = bridge.to_neutral(
        bridge.load_peft(_adapter(tmp_path / "ok", json.dumps(config)), Two())
    )
    assert np.array_equal(np.asarray(loaded.fc.lora_a), np.ones((4, 2)))
    assert np.array_equal(np.asarray(loaded.fc.lora_b), np.ones((2, 6)))


@pytest.mark.parametrize("dtype", ["int32", "int8", "bool"])
def test_tensors_of_integers_or_bools_are_refused_by_name(tmp_path, dtype):
    """An adapter whose `lora_A`/`lora_B` are integers or bools was applied as
    numbers it does not hold; `save_peft` wrote such adapters too. Both refuse,
    naming each tensor and its dtype."""
    skip_unless("NNX")
    tensors = {
        "base_model.model.fc.lora_A.weight": np.ones((2, 4), dtype),
        "base_model.model.fc.lora_B.weight": np.ones((6, 2), np.float32),
    }
    (tmp_path / "in").mkdir()
    (tmp_path / "ok").mkdir()
    adapter = _adapter(tmp_path / "in", BASE + '"lora_alpha": 4}', tensors)
    with pytest.raises(
        ValueError,
        match=rf"'base_model\.model\.fc\.lora_A\.weight' is {dtype}, not a "
        r"floating-point tensor",
    ):
        bridge.load_peft(adapter, M())
    model = bridge.load_peft(_adapter(tmp_path / "ok", BASE + '"lora_alpha": 4}'), M())
    model.fc.lora_a = type(model.fc.lora_a)(np.ones(model.fc.lora_a.shape, dtype))
    with pytest.raises(ValueError, match=rf"lora_A\.weight' is {dtype}, not a float"):
        bridge.save_peft(tmp_path / "out", model)
    assert not (tmp_path / "out").exists()
