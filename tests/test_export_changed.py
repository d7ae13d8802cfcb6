"""A Hugging Face BERT brought into a JAX model with names of its own and a new head,
then exported back (issue 52, items 1 and 2). The oracle: transformers'
`from_pretrained` of what is written, its outputs against the JAX model's.

- Exported beside a `config.json` alone (no `like`), the rewrite's own names
  (`net.blocks.0.wq.weight`) were written next to BERT's config, which
  `AutoModel.from_pretrained` opened with every weight random: refused now, naming
  `like=` the folder and `example=` as the fix; nothing is written.
- With `like=` the folder and `example=`, the body goes back without the new head
  under `strict=False` (or a rule `{r"\\.classifier": None}`), and `AutoModel` opens
  it; with `like=` a `BertForSequenceClassification` folder, the head goes too."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires
from .torch_orders import BERT_EPS, D, NNXModel, bert_rewrite, bert_torch


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.torch, requires("NNX")]

CLASSES = 3
IDS = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 7)))


class Classifier(nnx.Module):
    """The rewrite with a new head on its pooled output."""

    def __init__(self, rngs):
        self.body = NNXModel(bert_rewrite(), "qkv")
        self.classifier = nnx.Linear(D, CLASSES, rngs=rngs)

    def __call__(self, ids):
        _, pooled = self.body(ids)
        return self.classifier(pooled)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """`bert`: a BertModel's folder; `cls`: a BertForSequenceClassification of the
    same sizes, 3 labels (the export's reference when the head goes too)."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    hf = bert_torch(transformers, "eager").eval()
    hf.save_pretrained(root / "bert")
    config = hf.config.to_dict() | {"num_labels": CLASSES, "id2label": None}
    config.pop("label2id", None)
    heads = transformers.BertForSequenceClassification(
        transformers.BertConfig(**config)
    )
    heads.save_pretrained(root / "cls")
    assert hf.config.layer_norm_eps == BERT_EPS
    return root


@pytest.fixture(scope="module")
def model(folders):
    """The rewrite filled from the BERT folder by both forward passes, its head new."""
    like = Classifier(nnx.Rngs(0))
    return bridge.load(folders / "bert", like=like, example=(IDS,), strict=False)


def _hidden(model):
    return [np.asarray(y) for y in model.body(IDS)]


def _torch(out, cls=None):
    cls = cls or transformers.AutoModel
    hf = cls.from_pretrained(out).eval()
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(IDS)))


def test_own_names_beside_a_config_alone_are_refused(tmp_path, folders, model):
    out = tmp_path / "out"
    with pytest.raises(ValueError) as refused:
        bridge.save_pretrained(out, model.body, config=folders / "bert")
    text = str(refused.value)
    assert "none of the 39 name(s) the export would write is\none of the" in text
    assert "BertModel, the model its config.json names" in text
    assert "net.words.weight" in text and "embeddings.word_embeddings.weight" in text
    folder = repr(str(folders / "bert"))
    assert f"config={folder}, like={folder},\nexample=(x,))" in text
    assert not out.exists()


def test_a_config_object_or_dict_is_checked_alike(tmp_path, folders, model):
    config = transformers.AutoConfig.from_pretrained(folders / "bert")
    for given in (config, config.to_dict()):
        with pytest.raises(ValueError, match="BertModel, the model its config.json"):
            bridge.save_pretrained(tmp_path / "out", model.body, config=given)
    assert not (tmp_path / "out").exists()


def test_the_fix_the_refusal_names_opens_with_from_pretrained(tmp_path, folders, model):
    out = tmp_path / "out"
    bridge.save_pretrained(
        out, model.body, config=folders / "bert", like=folders / "bert", example=(IDS,)
    )
    hf = _torch(out)
    hidden, pooled = _hidden(model)
    np.testing.assert_allclose(hf.last_hidden_state, hidden, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(hf.pooler_output, pooled, rtol=1e-4, atol=1e-5)


def test_hugging_face_names_beside_their_config_pass_the_check(tmp_path, folders):
    """A model with BERT's own names (a `BertModel` itself) is written as before."""
    hf = transformers.AutoModel.from_pretrained(folders / "bert")
    out = tmp_path / "out"
    bridge.save_pretrained(out, bridge.from_torch(hf), config=folders / "bert")
    assert _torch(out).last_hidden_state.shape == (2, 7, D)


def test_a_new_head_is_refused_strictly_naming_both_fixes(tmp_path, folders, model):
    out = tmp_path / "out"
    with pytest.raises(bridge.PortError) as refused:
        bridge.save_pretrained(
            out, model, config=folders / "bert", like=folders / "bert", example=(IDS,)
        )
    assert refused.value.problems == [
        "unexpected: .classifier of the model pairs with no layer of `like`; give "
        "the model `like`'s layers, or give `like` the model's, or leave it out: "
        "rules={r'\\.classifier': None}, or strict=False for every such layer"
    ]
    assert not out.exists()


@pytest.mark.parametrize(
    "leave_out", [dict(strict=False), dict(rules={r"\.classifier": None})]
)
def test_the_body_without_the_new_head_opens_with_automodel(
    tmp_path, folders, model, leave_out, caplog
):
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="bridge"):
        bridge.save_pretrained(
            out,
            model,
            config=folders / "bert",
            like=folders / "bert",
            example=(IDS,),
            **leave_out,
        )
    told = caplog.text
    if "strict" in leave_out:
        assert "pair with no layer of `like`: ['.classifier']" in told
    else:
        assert "Left out by rules: ['.classifier']" in told
    hf = _torch(out)
    hidden, pooled = _hidden(model)
    np.testing.assert_allclose(hf.last_hidden_state, hidden, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(hf.pooler_output, pooled, rtol=1e-4, atol=1e-5)


def test_the_body_and_its_head_open_as_sequence_classification(
    tmp_path, folders, model
):
    out = tmp_path / "out"
    bridge.save_pretrained(
        out, model, config=folders / "cls", like=folders / "cls", example=(IDS,)
    )
    hf = _torch(out, transformers.BertForSequenceClassification)
    np.testing.assert_allclose(hf.logits, model(IDS), rtol=1e-4, atol=1e-5)


def test_names_that_fit_but_for_a_head_are_written_with_strict_false(
    tmp_path, folders, caplog
):
    """Without example inputs: a model of BERT's own names and a classifier BertModel
    has not; `strict=False` writes the body and says what it left out."""
    hf = transformers.AutoModel.from_pretrained(folders / "bert")
    tree = bridge.from_torch({**hf.state_dict(), "classifier.weight": torch.ones(3, D)})
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"unexpected: classifier.weight \(3, 32\)"):
        bridge.save_pretrained(out, tree, config=folders / "bert")
    with caplog.at_level(logging.WARNING, logger="bridge"):
        bridge.save_pretrained(out, tree, config=folders / "bert", strict=False)
    assert "1 array(s) of the model that BertModel" in caplog.text
    assert "classifier.weight (3, 32)" in caplog.text
    assert _torch(out).last_hidden_state.shape == (2, 7, D)
