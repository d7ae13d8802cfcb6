"""Exports checked against the model they are for (issue 21): `save(...,
layout="torch", like=reference)` and `bridge convert --to-layout torch --like REF`
write only when every name and shape is the reference's (a transformers module,
built from its config on the `meta` device or not, its state dict, or a Hugging Face
folder); then transformers reads the result (`from_pretrained`, `load_state_dict(
strict=True)`) with the source model's logits. Anything else is refused listing
every difference, and nothing is written."""

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import bridge
from bridge._cli import main

from .helpers import export, requires
from .llamas import LAYERS, LlamaForCausalLM, llama_config, tokens


pytestmark = requires("NNX")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


def _llama(seed: int = 0):
    """An NNX Llama with Hugging Face's names, ported from a transformers model."""
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(llama_config()).eval()
    return bridge.port(hf, LlamaForCausalLM(nnx.Rngs(seed))), hf


def test_a_folder_checked_against_the_module_loads_with_from_pretrained(tmp_path):
    model, _ = _llama()
    ids = tokens()
    torch.manual_seed(1)
    reference = transformers.LlamaForCausalLM(llama_config())
    bridge.save_pretrained(
        tmp_path / "out", model, like=reference, config=llama_config()
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert np.max(np.abs(_logits(hf, ids) - np.asarray(model(ids)))) < 1e-5


def test_a_file_checked_against_a_meta_model_loads_strictly(tmp_path):
    """The reference built from the config on the `meta` device (no memory): its
    names and shapes are enough."""
    model, _ = _llama()
    ids = tokens()
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(llama_config())
    path = tmp_path / "model.safetensors"
    bridge.save_state_dict(path, model, like=reference)
    state = safetensors.numpy.load_file(str(path))
    hf = transformers.LlamaForCausalLM(llama_config()).eval()
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    assert np.max(np.abs(_logits(hf, ids) - np.asarray(model(ids)))) < 1e-5


def test_an_export_that_differs_from_the_reference_is_refused_writing_nothing(
    tmp_path,
):
    """A model with a layer more than the reference, and one whose MLP is wider:
    every difference listed, no file or folder left."""
    model, hf = _llama()
    small = llama_config()
    small.num_hidden_layers = LAYERS - 1
    small.intermediate_size = 8
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(small)
    last = LAYERS - 1
    for path in (tmp_path / "model.safetensors", tmp_path / "folder"):
        with pytest.raises(ValueError) as error:
            export(path, model, like=reference)
        text = str(error.value)
        assert f"unexpected: model.layers.{last}.self_attn.q_proj.weight" in text
        assert (
            "shape: model.layers.0.mlp.up_proj.weight would be written with (24, 16), "
            "the reference holds (8, 16)"
        ) in text
        assert "nothing was written" in text
        assert list(tmp_path.iterdir()) == []
    # a state dict as the reference: the same check
    state = {k: v for k, v in hf.state_dict().items() if "layers.0.mlp" not in k}
    with pytest.raises(ValueError, match=r"unexpected: model\.layers\.0\.mlp\.up_proj"):
        bridge.save_state_dict(tmp_path / "m.safetensors", model, like=state)
    assert list(tmp_path.iterdir()) == []


def test_a_stacked_tensor_under_a_linear_name_is_refused_writing_nothing(tmp_path):
    """Two query kernels stacked `(2, D, D)` under one name: alone, that reads as a
    Conv1d weight `(16, 16, 2)` (a valid PyTorch layer, so the layer-kind check
    lets it be); the reference says that name is a Linear `(16, 16)`: refused."""
    model, hf = _llama()
    q = bridge.to_neutral(model).model.layers[0].self_attn.q_proj.kernel
    variables = {"params": {"model": {"layers": {"0": {"self_attn": {"q_proj": {
        "kernel": jax.numpy.stack([q, q])}}}}}}}  # fmt: skip
    path = tmp_path / "model.safetensors"
    with pytest.raises(ValueError) as error:
        bridge.save_state_dict(path, variables, like=hf)
    assert (
        "shape: model.layers.0.self_attn.q_proj.weight would be written with "
        "(16, 16, 2), the reference holds (16, 16)"
    ) in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_convert_to_the_torch_layout_checked_against_a_folder(tmp_path, capsys):
    """`bridge convert --to-layout torch --like FOLDER`: a bridge checkpoint of the
    NNX Llama converts into a folder transformers reads; against a folder of another
    model it is refused, nothing written."""
    model, _ = _llama()
    ids = tokens()
    source = tmp_path / "llama.safetensors"
    bridge.save(source, model)
    torch.manual_seed(2)
    reference = tmp_path / "reference"
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(reference)
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(source), str(out), "--to-layout", "torch", "--like",
                 str(reference)]) == 0  # fmt: skip
    state = safetensors.numpy.load_file(str(out))
    hf = transformers.LlamaForCausalLM(llama_config()).eval()
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    assert np.max(np.abs(_logits(hf, ids) - np.asarray(model(ids)))) < 1e-5

    other = llama_config()
    other.num_hidden_layers = LAYERS + 1
    transformers.LlamaForCausalLM(other).save_pretrained(tmp_path / "other")
    before = sorted(tmp_path.iterdir())
    assert main(["convert", str(source), str(tmp_path / "bad"), "--to-layout",
                 "torch", "--like", str(tmp_path / "other")]) == 1  # fmt: skip
    assert f"missing: model.layers.{LAYERS}." in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == before
