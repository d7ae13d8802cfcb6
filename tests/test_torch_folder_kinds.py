"""A Hugging Face folder's 2-D `weight` alone reads as an `Embed` or a `Dense` by its
shape; its traced module (built from `config.json`) decides (issue 37). A weight
that a product first uses is a `Dense`, so that it groups with the other side's
`Dense` layers of its shape (a grouped-query attention's `k_proj` beside `v_proj`:
`tests/test_torch_orders.py`, `llama-gqa-*-folder`). A table looked up and later
contracted under the same name (DeBERTa-v2's LM head reads
`word_embeddings.weight` itself) stays an `Embed`: here it pairs with the module's
`nn.Embedding`, and the ported module gives the folder's model's logits. The
head's bias, added after `torch.matmul`, is a bias too (`Uses.added`), not a
norm's."""

import numpy as np
import pytest

import bridge

from .hf_common import perturb


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch

IDS = np.array([[1, 5, 9, 3, 7, 2]])


def _deberta(seed: int):
    config = transformers.DebertaV2Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        legacy=False,  # the head multiplies by `word_embeddings.weight` itself
    )
    torch.manual_seed(seed)
    return transformers.DebertaV2ForMaskedLM(config).eval()


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.numpy()


def test_a_table_looked_up_and_contracted_stays_an_embed(tmp_path):
    source = perturb(_deberta(0), torch)  # the head's bias, added after
    # `torch.matmul`, is a bias (was read as a norm's without scale)
    source.save_pretrained(tmp_path / "hf")
    target = _deberta(1)
    state = bridge.port(bridge.load(tmp_path / "hf"), target, example=(IDS,))
    target.load_state_dict(state, strict=True)
    np.testing.assert_allclose(_logits(target), _logits(source), rtol=1e-5, atol=1e-5)
