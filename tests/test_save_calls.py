"""One call per job (issue 50): `save` (a bridge checkpoint), `save_training`,
`save_pretrained` (a Hugging Face folder), `save_state_dict` (one PyTorch-layout
file), `save_quantized`; each takes only that job's keywords. `bridge.save`'s earlier
spellings of the other jobs still work, with a `BridgeDeprecationWarning` naming the
call, and write what that call writes."""

import inspect
import json

import numpy as np
import optax
import pytest
import safetensors.numpy

import bridge


VARIABLES = {"params": {"Dense_0": {"kernel": np.ones((2, 3), np.float32)}}}


def _files(path):
    """What a save wrote: a file's bytes, or each file of a folder by name."""
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return path.read_bytes()


@pytest.mark.parametrize(
    "old, new, call",
    [
        (
            lambda p: bridge.save(p / "m.safetensors", VARIABLES, layout="torch"),
            lambda p: bridge.save_state_dict(p / "m.safetensors", VARIABLES),
            "save_state_dict",
        ),
        (
            lambda p: bridge.save(p / "out", VARIABLES, layout="torch",
                                  max_shard_size="1KB", config={"a": 1}),
            lambda p: bridge.save_pretrained(p / "out", VARIABLES,
                                             max_shard_size="1KB", config={"a": 1}),
            "save_pretrained",
        ),
        (
            lambda p: bridge.save(p / "m.safetensors", VARIABLES, layout="torch",
                                  quantize="fp8-block"),
            lambda p: bridge.save_quantized(p / "m.safetensors", VARIABLES,
                                            "fp8-block"),
            "save_quantized",
        ),
        (
            lambda p: bridge.save(p / "m.safetensors", VARIABLES, step=3,
                                  opt_state=optax.sgd(0.1).init(VARIABLES)),
            lambda p: bridge.save_training(p / "m.safetensors", VARIABLES,
                                           optax.sgd(0.1).init(VARIABLES), step=3),
            "save_training",
        ),
    ],
)  # fmt: skip
def test_an_earlier_spelling_warns_naming_the_call_and_writes_the_same(
    tmp_path, old, new, call
):
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    with pytest.warns(
        bridge.BridgeDeprecationWarning, match=rf"call bridge\.{call}\("
    ) as told:
        old(tmp_path / "old")
    assert told[0].filename == __file__  # the warning points at the caller
    new(tmp_path / "new")
    written = {p.name: _files(p) for p in sorted((tmp_path / "old").iterdir())}
    assert written == {p.name: _files(p) for p in sorted((tmp_path / "new").iterdir())}


def test_the_warning_is_a_deprecation_warning():
    """Shown where the call is made in `__main__` (a script, a notebook), hidden
    in a library's own modules, as Python treats `DeprecationWarning`."""
    assert issubclass(bridge.BridgeDeprecationWarning, DeprecationWarning)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda p: bridge.save(p / "m.safetensors", VARIABLES, metdata={}),
            TypeError,
            "save\\(\\) got an unexpected keyword argument 'metdata'",
        ),
        (
            lambda p: bridge.save(p / "m.safetensors", VARIABLES, layout="flax"),
            ValueError,
            '(?s)`layout` must be "torch".*bridge.save_pretrained',
        ),
        (
            lambda p: bridge.save(p / "m.safetensors", VARIABLES, config={}),
            ValueError,
            "`config` apply to a PyTorch-layout export only: call "
            "bridge.save_pretrained",
        ),
        (
            lambda p: bridge.save(p / "m.safetensors", VARIABLES, layout="torch",
                                  config={}),
            ValueError,
            "`config` apply to a Hugging Face folder only: call "
            "bridge.save_pretrained",
        ),
        (
            lambda p: bridge.save(p / "m.safetensors", VARIABLES, layout="torch",
                                  step=3),
            ValueError,
            "holds the model's arrays only: save the training state with\n"
            "bridge.save_training",
        ),
        (
            lambda p: bridge.save_pretrained(p / "m.safetensors", VARIABLES),
            ValueError,
            "save_pretrained writes a Hugging Face folder: give a path without a\n"
            "suffix. For one PyTorch-layout file, call bridge.save_state_dict",
        ),
        (
            lambda p: bridge.save_state_dict(p / "out", VARIABLES),
            ValueError,
            "name it \\*.safetensors. For a\nHugging Face folder",
        ),
        (
            lambda p: bridge.save_state_dict(p / "m.safetensors", VARIABLES,
                                             strict="no"),
            TypeError,
            "`strict` must be True or False",
        ),
    ],
)  # fmt: skip
def test_a_spelling_of_no_job_is_refused_naming_the_call(tmp_path, call, error, match):
    with pytest.raises(error, match=match):
        call(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_each_call_takes_its_job_s_keywords_alone():
    """`help(bridge.save)` showed 18 keywords whatever the job."""
    keywords = {
        name: [
            p.name
            for p in inspect.signature(getattr(bridge, name)).parameters.values()
            if p.kind is p.KEYWORD_ONLY
        ]
        for name in ("save", "save_training", "save_pretrained", "save_state_dict")
    }
    assert keywords["save"] == ["metadata", "example", "example_kwargs", "progress"]
    assert "config" not in keywords["save_state_dict"]
    assert "opt_state" not in keywords["save_pretrained"]
    assert max(len(k) for k in keywords.values()) <= 13


def test_a_state_dict_reads_back_as_pytorch_writes_it(tmp_path):
    bridge.save_state_dict(tmp_path / "m.safetensors", VARIABLES)
    state = safetensors.numpy.load_file(tmp_path / "m.safetensors")
    assert state["Dense_0.weight"].shape == (3, 2)  # (out, in)
    bridge.save_pretrained(tmp_path / "out", VARIABLES, config={"model_type": "x"})
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {
        "model_type": "x"
    }
