"""A Hugging Face folder loaded by example inputs where torch or transformers is not
installed: the folder's model cannot be built to trace it, and the refusal says so
in one line with the install command, in place of the ambiguous pairings that trace
would have decided (two ~900-character paragraphs blaming 'arrays without their
model')."""

import json
import sys

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import bridge

from .helpers import requires


pytestmark = requires("NNX")


class Rewrite(nnx.Module):
    """Two layers of one shape under names of its own, used in the other order."""

    def __init__(self, rngs):
        self.second = nnx.Linear(4, 4, rngs=rngs)
        self.first = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.second(self.first(x))


@pytest.mark.parametrize(
    "absent", ["torch", pytest.param("transformers", marks=pytest.mark.torch)]
)
def test_a_folder_load_by_example_without_torch_says_so_in_one_line(
    tmp_path, monkeypatch, absent
):
    rng = np.random.default_rng(0)
    f = lambda *s: rng.normal(size=s).astype("float32")  # noqa: E731
    state = {f"encoder.{n}.{w}": f(4, 4) if w == "weight" else f(4)
             for n in ("up", "down") for w in ("weight", "bias")}  # fmt: skip
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    if absent == "transformers":  # the first missing package is named
        pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, absent, None)  # as if not installed
    x = np.ones((1, 4), np.float32)
    with pytest.raises(bridge.PortError) as error:
        bridge.load(tmp_path, like=Rewrite(nnx.Rngs(0)), example=(x,))
    assert error.value.problems == [
        f"The PyTorch side of this Tree could not be traced: {absent} is not "
        "installed (pip install torch transformers): the PyTorch side cannot be "
        "built from config.json. Without the source's trace, example= cannot pair "
        "its layers whose names differ."
    ]
