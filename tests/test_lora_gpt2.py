"""LoRA on GPT-2 against PEFT: Hugging Face's `Conv1D` layers (weight `(in, out)`)
and the fused `c_attn`, which PEFT adapts whole (`lora_B (3E, r)`) while the JAX
model may hold it split into `query`/`key`/`value` layers (`from_torch(split=)`).
The oracle is PEFT's own forward pass on `transformers`' GPT-2 (logits within 1e-5),
for NNX and Equinox models, fused and split. Skipped without torch, transformers and
peft (`nox -s tests_torch`)."""

import copy
import json

import jax
import numpy as np
import pytest
import safetensors.numpy

import bridge

from .helpers import requires
from .test_torch_hf_gpt2 import FRAMEWORKS, IDS, PREFIX, SPLIT, _gpt2_forward, _hf


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.slow,
    requires("NNX"),
    # peft 0.21 asks transformers 5 for a deprecated attribute
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning"),
]

KEY = jax.random.key(3)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(IDS)).logits.numpy()


def _jax_logits(model, fw):
    _, call, logits = FRAMEWORKS[fw]
    return np.asarray(_gpt2_forward(model, call, logits)[1])


def _jax_gpt2(hf, fw, fused):
    make = FRAMEWORKS[fw][0]
    source = bridge.from_torch(hf, prefix=PREFIX, split=None if fused else SPLIT)
    return bridge.port(source, make(fused))


def _peft_gpt2(hf, directory):
    """A PEFT adapter on GPT-2's Conv1D layers (`c_attn` whole, both `c_proj`s),
    nonzero as after training, saved in `directory`."""
    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True
    )
    model = peft.get_peft_model(copy.deepcopy(hf), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora" in name:
                p.normal_(0.0, 0.1)
    model.eval().save_pretrained(directory)
    return model


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("fw", list(FRAMEWORKS))
def test_peft_gpt2_adapter_into_jax(tmp_path, fw, fused):
    """PEFT's GPT-2 adapter on a JAX GPT-2 whose `c_attn` is one Dense or three: the
    logits of PEFT's forward, and of its `merge_and_unload`; written again, the
    adapter is PEFT's own, tensor for tensor."""
    hf = _hf(transformers.GPT2LMHeadModel)
    model = _peft_gpt2(hf, tmp_path / "peft")
    base = _jax_gpt2(hf, fw, fused)
    adapted = bridge.load_peft(tmp_path / "peft", base, prefix=PREFIX, split=SPLIT)
    got = _jax_logits(adapted, fw)
    np.testing.assert_allclose(got, _logits(model), atol=1e-5, rtol=0)
    assert np.abs(_jax_logits(base, fw) - got).max() > 1e-2  # the adapter counts
    if not fused:  # c_attn's lora_A on each part, its lora_B cut in three
        tree = bridge.to_neutral(adapted)
        attn = tree.h[0].attn
        assert [attn[p].lora_b.shape[-2:] for p in ("query", "key", "value")] in (
            [(2, 32)] * 3,  # NNX: (r, E)
            [(32, 2)] * 3,  # Equinox: (E, r)
        )
    bridge.save_peft(tmp_path / "again", adapted, prefix=PREFIX, split=SPLIT)
    want = safetensors.numpy.load_file(tmp_path / "peft/adapter_model.safetensors")
    again = safetensors.numpy.load_file(tmp_path / "again/adapter_model.safetensors")
    assert want.keys() == again.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    config = json.loads((tmp_path / "again/adapter_config.json").read_text())
    assert (config["r"], config["fan_in_fan_out"]) == (2, True)
    merged = _jax_logits(bridge.merge_lora(adapted), fw)
    np.testing.assert_allclose(
        merged, _logits(model.merge_and_unload()), atol=1e-5, rtol=0
    )


def _perturbed(tree):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: (
            x + 0.3 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
            if "lora" in jax.tree_util.keystr(p)
            else x
        ),
        tree,
    )


@pytest.mark.parametrize("fw", list(FRAMEWORKS))
def test_jax_gpt2_adapters_load_in_peft(tmp_path, fw):
    """Adapters trained on the split `query` (rank 2, alpha 4) and `value` (rank 1,
    alpha 3) layers and on `c_fc`: written as one `c_attn` adapter of rank 3 (the
    missing `key` rows zero, `value`'s block scaled to `query`'s scaling) that
    `PeftModel.from_pretrained` runs with the JAX model's logits (any warning from
    PEFT, e.g. about `fan_in_fan_out`, fails the test)."""
    hf = _hf(transformers.GPT2LMHeadModel)
    base = _jax_gpt2(hf, fw, fused=False)
    tree = bridge.lora(base, ["query", "c_fc"], rank=2, alpha=4, key=KEY)
    tree = bridge.lora(tree, ["value"], rank=1, alpha=3, key=KEY)
    tree = _perturbed(bridge.to_neutral(tree))
    bridge.save_peft(tmp_path / "adapter", tree, prefix=PREFIX, split=SPLIT)
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert config["target_modules"] == ["c_attn", "c_fc"]
    assert config["rank_pattern"] == {f"{PREFIX}h.{i}.attn.c_attn": 3 for i in (0, 1)}
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter")
    got = _jax_logits(bridge.to_native(tree), fw)
    np.testing.assert_allclose(got, _logits(loaded.eval()), atol=1e-5, rtol=0)
    assert np.abs(_jax_logits(base, fw) - got).max() > 1e-2
