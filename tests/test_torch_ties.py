"""One PyTorch tensor under several names (a tie: an embedding and the head that
reads it transposed, T5's `shared` looked up by its encoder and its decoder) ported
into a model that holds one array per layer, and back. Each name of the tie is a
layer of its own, read as its module reads it (`nn.Linear`: `(out, in)`); the
layers of a tie that the forward pass uses pair in the order of their uses. Back
into a tied model, the arrays filling one tensor must be equal to the bit, else
the port is refused. Outputs compared with PyTorch's own."""

import jax.numpy as jnp
import numpy as np
import pytest

import bridge

from .helpers import requires


torch = pytest.importorskip("torch")
pytestmark = requires("NNX")

V, D = 11, 4
IDS = np.array([[1, 5, 9, 3], [4, 0, 10, 6]], np.int32)


class TiedHead(torch.nn.Module):
    """An embedding, a layer, and a head that reads the embedding (tied)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.mid = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def _nnx_head():
    from flax import nnx

    class Head(nnx.Module):  # its own names, one array per layer
        def __init__(self, rngs):
            self.tokens = nnx.Embed(V, D, rngs=rngs)
            self.hidden = nnx.Linear(D, D, rngs=rngs)
            self.logits = nnx.Linear(D, V, use_bias=False, rngs=rngs)

        def __call__(self, ids):
            return self.logits(jnp.tanh(self.hidden(self.tokens(ids))))

    return Head(nnx.Rngs(0))


def _torch_out(model, ids=IDS):
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).numpy()


def test_tied_head_fills_two_arrays():
    torch.manual_seed(0)
    source = TiedHead().eval()
    plan = bridge.port_plan(source, _nnx_head(), example=(IDS,))
    assert set(plan.tied) <= {
        ".embed.weight -> .tokens, .logits",
        ".embed.weight -> .logits, .tokens",
    }
    assert plan.tied, plan
    assert not plan.problems, plan
    ported = bridge.port(source, _nnx_head(), example=(IDS,))
    np.testing.assert_allclose(
        np.asarray(ported(IDS)), _torch_out(source), rtol=1e-6, atol=1e-6
    )
    weight = source.embed.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(ported.tokens.embedding[...]), weight)
    np.testing.assert_array_equal(np.asarray(ported.logits.kernel[...]), weight.T)


def test_equal_arrays_fill_one_tied_tensor():
    torch.manual_seed(0)
    source = bridge.port(TiedHead().eval(), _nnx_head(), example=(IDS,))
    target = TiedHead().eval()
    plan = bridge.port_plan(source, target, example=(IDS,))
    assert any(
        line.startswith(".tokens, .logits -> .embed.weight") for line in plan.tied
    ), plan
    state = bridge.port(source, target, example=(IDS,))
    target.load_state_dict(state, strict=True)
    assert target.head.weight is target.embed.weight  # still one tensor
    np.testing.assert_allclose(
        _torch_out(target), np.asarray(source(IDS)), rtol=1e-6, atol=1e-6
    )


def test_unequal_arrays_into_one_tied_tensor_refused():
    source = _nnx_head()  # its embedding and head differ (two random arrays)
    with pytest.raises(bridge.PortError) as error:
        bridge.port(source, TiedHead().eval(), example=(IDS,))
    message = str(error.value)
    assert "tied: the target holds .embed.weight once for .embed, .head" in message
    assert "the source's arrays for them differ (.tokens and .logits" in message


class Shared(torch.nn.Module):
    """T5's way: `shared` is never called, its tensor is looked up by `first` and
    `last`; an untied embedding of the same shape is used between them."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Embedding(V, D)
        self.first = torch.nn.Embedding(V, D)
        self.first.weight = self.shared.weight
        self.other = torch.nn.Embedding(V, D)
        self.last = torch.nn.Embedding(V, D)
        self.last.weight = self.shared.weight

    def forward(self, ids):
        a = self.first(ids)
        b = self.other((ids + 1) % V)
        return torch.tanh(a) * 2 + b * 3 + self.last(ids * 3 % V)


def _nnx_three():
    from flax import nnx

    class Three(nnx.Module):  # created in another order than used, other names
        def __init__(self, rngs):
            self.z = nnx.Embed(V, D, rngs=rngs)
            self.y = nnx.Embed(V, D, rngs=rngs)
            self.x = nnx.Embed(V, D, rngs=rngs)

        def __call__(self, ids):
            a = self.y(ids)
            b = self.z((ids + 1) % V)
            return jnp.tanh(a) * 2 + b * 3 + self.x(ids * 3 % V)

    return Three(nnx.Rngs(0))


def test_tie_uses_pair_in_order_of_use():
    torch.manual_seed(0)
    source = Shared().eval()
    with pytest.raises(bridge.PortError, match="unexpected: source layer .shared"):
        bridge.port(source, _nnx_three())  # no example: four names, three layers
    plan = bridge.port_plan(source, _nnx_three(), example=(IDS,))
    assert not plan.problems, plan
    assert ".shared.weight -> .x, .y" in plan.tied, plan
    ported = bridge.port(source, _nnx_three(), example=(IDS,))
    np.testing.assert_allclose(
        np.asarray(ported(IDS)), _torch_out(source), rtol=1e-6, atol=1e-6
    )


# --- a tie inside the JAX model: its embedding read again as the head ------------


class Untied(TiedHead):
    """`TiedHead` with a head of its own (`tie_word_embeddings=False`)."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(D, V, bias=False)


def _jax_tied(name):
    """A JAX model whose head reads its embedding (one array, two layers), and
    its forward pass on a batch of ids."""
    import jax

    if name == "linen":
        import flax.linen as nn

        class Linen(nn.Module):
            @nn.compact
            def __call__(self, ids):
                table = nn.Embed(V, D, name="wte")
                return table.attend(jnp.tanh(nn.Dense(D, name="mlp")(table(ids))))

        module = Linen()
        model = (module, module.init(jax.random.key(1), IDS))
        return model, lambda m, ids: module.apply(m[1], ids), ".wte.embedding"
    if name == "nnx":
        from flax import nnx

        class NNX(nnx.Module):
            def __init__(self, rngs):
                self.wte = nnx.Embed(V, D, rngs=rngs)
                self.mlp = nnx.Linear(D, D, rngs=rngs)

            def __call__(self, ids):
                return self.wte.attend(jnp.tanh(self.mlp(self.wte(ids))))

        return NNX(nnx.Rngs(1)), lambda m, ids: m(ids), ".wte.embedding"
    import equinox as eqx

    class Equinox(eqx.Module):  # per example; the head reads `embed.weight`
        embed: eqx.nn.Embedding
        mlp: eqx.nn.Linear

        def __init__(self, key):
            a, b = jax.random.split(key)
            self.embed = eqx.nn.Embedding(V, D, key=a)
            self.mlp = eqx.nn.Linear(D, D, key=b)

        def __call__(self, ids):
            h = jnp.tanh(jax.vmap(self.mlp)(jax.vmap(self.embed)(ids)))
            return h @ self.embed.weight.T

    return (
        Equinox(jax.random.key(1)),
        lambda m, ids: jax.vmap(m)(ids),
        ".embed.weight",
    )


JAX = ["linen", "nnx", "equinox"]


@pytest.mark.parametrize("name", JAX)
@pytest.mark.parametrize("torch_model", [TiedHead, Untied])
def test_jax_tie_into_torch(name, torch_model):
    source, forward, table = _jax_tied(name)
    plan = bridge.port_plan(source, torch_model().eval(), example=(IDS,))
    assert not plan.problems, plan
    if torch_model is TiedHead:  # the head's one array is the embedding's: no head
        assert "head.weight = embed.weight" in plan.tied, plan
    else:  # the JAX side's table read as a head too (its trace says so)
        assert f"{table} -> .embed, .head" in plan.tied, plan
    target = torch_model().eval()
    target.load_state_dict(bridge.port(source, target, example=(IDS,)), strict=True)
    np.testing.assert_allclose(
        _torch_out(target), np.asarray(forward(source, IDS)), rtol=1e-6, atol=1e-6
    )
    # the one array fills both names (one tensor where they are tied)
    assert (target.head.weight is target.embed.weight) == (torch_model is TiedHead)
    np.testing.assert_array_equal(
        target.head.weight.detach().numpy(), target.embed.weight.detach().numpy()
    )


@pytest.mark.parametrize("name", JAX)
@pytest.mark.parametrize("equal", [True, False])
def test_torch_into_jax_tie(name, equal):
    torch.manual_seed(0)
    tied = TiedHead().eval()
    model, forward, table = _jax_tied(name)
    ported = bridge.port(tied, model, example=(IDS,))
    np.testing.assert_allclose(
        np.asarray(forward(ported, IDS)), _torch_out(tied), rtol=1e-6, atol=1e-6
    )
    untied = Untied().eval()  # two tensors: equal, or two random ones
    if equal:
        with torch.no_grad():
            untied.head.weight.copy_(untied.embed.weight)
        ported = bridge.port(untied, model, example=(IDS,))
        np.testing.assert_allclose(
            np.asarray(forward(ported, IDS)), _torch_out(untied), rtol=1e-6, atol=1e-6
        )
        return
    with pytest.raises(bridge.PortError) as error:
        bridge.port(untied, model, example=(IDS,))
    message = str(error.value)
    assert f"tied: the target holds {table} once" in message
    assert "the source's arrays for them differ (.embed and .head" in message


# --- a Hugging Face folder's tied head, told by its config.json -----------------


def _llama_folder(folder, tied, key=True, head=True):
    """A tiny `LlamaForCausalLM` saved by `save_pretrained` (a tied head is stored
    once, as `model.embed_tokens.weight`), with `tie_word_embeddings` left out of
    its config.json where `key` is False (as transformers 4.x writes it when true)
    and `lm_head.weight` left out of its files where `head` is False."""
    import json

    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from .llamas import llama_config

    config = llama_config()
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    if not key:
        raw = json.loads((folder / "config.json").read_text())
        del raw["tie_word_embeddings"]
        (folder / "config.json").write_text(json.dumps(raw))
    if not head:
        weights = folder / "model.safetensors"
        state = safetensors_torch.load_file(weights)
        del state["lm_head.weight"]
        safetensors_torch.save_file(state, weights, metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("key", [True, False], ids=["said", "default"])
def test_folder_tied_head_fills_a_separate_head(tmp_path, key):
    from flax import nnx

    from .llamas import LlamaForCausalLM, tokens

    reference = _llama_folder(tmp_path, tied=True, key=key)
    like = LlamaForCausalLM(nnx.Rngs(0))  # a head of its own; no example inputs
    model, report = bridge.load(tmp_path, like=like, report=True)
    ids = np.array(tokens())
    with torch.no_grad():
        logits = reference(torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), logits, rtol=1e-5, atol=1e-5)
    said = "true" if key else "not set (transformers' default: true)"
    assert report.complete, report
    (line,) = report.tied
    arrow, why = line.split(" (", 1)
    source, targets = arrow.split(" -> ")
    assert source == ".model.embed_tokens.weight", line
    assert set(targets.split(", ")) == {".lm_head", ".model.embed_tokens"}, line
    assert why == (
        f"config.json: tie_word_embeddings {said}, and no lm_head.weight in the files)"
    ), line
    embedding = reference.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), embedding.T)


def test_folder_without_its_untied_head_refused(tmp_path):
    from flax import nnx

    from .llamas import LlamaForCausalLM

    _llama_folder(tmp_path, tied=False, head=False)
    with pytest.raises(bridge.PortError) as error:
        bridge.load(tmp_path, like=LlamaForCausalLM(nnx.Rngs(0)))
    message = str(error.value)
    assert "missing: target layer .lm_head" in message
    assert (
        "head: the source's files hold no lm_head.weight (config.json: "
        "tie_word_embeddings false, and no lm_head.weight in the files), so "
        "nothing fills the target's .lm_head"
    ) in message


@pytest.mark.parametrize("example", [False, True], ids=["config", "traced"])
def test_folder_into_a_jax_tie(tmp_path, example):
    from flax import nnx

    from .llamas import LlamaModel, tokens

    class Tied(nnx.Module):  # the head reads the embedding: one array
        def __init__(self, rngs):
            self.model = LlamaModel(rngs)

        def __call__(self, ids):
            return self.model.embed_tokens.attend(self.model(ids))

    reference = _llama_folder(tmp_path, tied=True)
    ids = np.array(tokens())
    given = (ids,) if example else None
    model = bridge.load(tmp_path, like=Tied(nnx.Rngs(0)), example=given)
    with torch.no_grad():
        logits = reference(torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), logits, rtol=1e-5, atol=1e-5)
    untied = tmp_path / "untied"
    _llama_folder(untied, tied=False)  # two tensors into one array: refused
    with pytest.raises(bridge.PortError, match=r"\(\.model\.embed_tokens and \.lm_hea"):
        bridge.load(untied, like=Tied(nnx.Rngs(0)), example=(ids,))


def test_a_body_folder_has_no_invented_head_tie(tmp_path):
    """A `BertModel` folder (no LM head: `architectures` names the body) loaded
    into a model of the same names: the report listed a tie
    `lm_head.weight = embeddings.word_embeddings.weight` for a layer no model of
    it has (issue 52, item 7)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16,
    )  # fmt: skip
    transformers.BertModel(config).save_pretrained(tmp_path)
    tree = bridge.load(tmp_path)
    plan = bridge.port_plan(tree, tree)
    assert plan.steps and not any("lm_head" in line for line in plan.tied), plan
