"""The README's headline route, LoRA included (issue 52, item 3): a Hugging Face
BERT folder into an NNX model with names of its own, LoRA on its attention, the
adapters written as a PEFT folder that `peft.PeftModel.from_pretrained` opens on
the hub model. The oracle: PEFT's own forward equals the JAX model's. Without
`like=`/`example=`, `save_peft` named the adapters by the model's own layers
(`net.blocks.0.wq`), which PEFT refused (`NoMatchingPeftModuleError` when applied,
or nothing adapted)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

from .helpers import requires
from .torch_orders import NNXModel, bert_rewrite, bert_torch


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.torch,
    requires("NNX"),
    # peft's from_pretrained asks transformers 5 a deprecated question
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning"),
]

IDS = jnp.asarray(np.random.default_rng(1).integers(1, 64, (2, 6)))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hub") / "bert"
    torch.manual_seed(0)
    bert_torch(transformers, "eager").eval().save_pretrained(folder)
    return folder


def _adapted(hub):
    """The rewrite filled from the folder, LoRA on its query and value, the
    adapters' B nonzero (as after training) so that they count."""
    model = bridge.load(hub, like=NNXModel(bert_rewrite(), "qkv"), example=(IDS,))
    model = bridge.lora(model, r"\.w[qv]$", rank=2, alpha=4, key=jax.random.key(0))
    tree = bridge.from_nnx(model)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    tree = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            jax.random.normal(next(keys), x.shape) * 0.3
            if "lora_b" in jax.tree_util.keystr(p)
            else x
        ),
        tree,
    )
    return bridge.to_native(tree)


def test_a_rewrite_s_adapters_open_in_peft_on_the_hub_model(tmp_path, hub):
    model = _adapted(hub)
    out = tmp_path / "adapter"
    bridge.save_peft(out, model, like=hub, example=(IDS,))
    config = (out / "adapter_config.json").read_text()
    assert '"query"' in config and '"value"' in config and "wq" not in config
    base = transformers.AutoModel.from_pretrained(hub).eval()
    with_lora = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        hf = with_lora(torch.tensor(np.asarray(IDS)))
    hidden, pooled = model(IDS)
    np.testing.assert_allclose(hf.last_hidden_state, hidden, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(hf.pooler_output, pooled, rtol=1e-4, atol=1e-5)
    # the adapters count: the base model alone differs (PEFT adapted `base`)
    plain = transformers.AutoModel.from_pretrained(hub).eval()
    with torch.no_grad():
        plain = plain(torch.tensor(np.asarray(IDS))).last_hidden_state
    assert np.abs(np.asarray(plain) - np.asarray(hidden)).max() > 1e-2


def test_without_like_the_names_are_the_model_s_own(tmp_path, hub):
    """As before: the rewrite's own names, which the hub model does not have."""
    out = tmp_path / "adapter"
    bridge.save_peft(out, _adapted(hub))
    assert '"wq"' in (out / "adapter_config.json").read_text()


def test_like_needs_example_and_refuses_prefix(tmp_path, hub):
    model = _adapted(hub)
    with pytest.raises(TypeError, match="`like` and `example` go together"):
        bridge.save_peft(tmp_path / "a", model, like=hub)
    with pytest.raises(ValueError, match="`prefix` with `like`"):
        bridge.save_peft(tmp_path / "a", model, like=hub, example=(IDS,),
                         prefix="bert.")  # fmt: skip
    assert not (tmp_path / "a").exists()
