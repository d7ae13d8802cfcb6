"""A masked-LM head's loose `bias`, ported by what the forward pass does with it
(issue 37): PyTorch's `BertLMPredictionHead` holds `bias` and its `decoder` (tied to
the word embeddings) adds it after the product; transformers'
`FlaxBertLMPredictionHead` holds `bias` alone and adds it after the product with
the embedding table. Its arrays alone read as a norm without scale; the traced
pass shows a bias added to a product's result. Outputs compared with PyTorch's own
forward pass, both directions, with other names on each side."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge


torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
V, D, B, T = 11, 4, 2, 5


class _Head(torch.nn.Module):
    """BERT's prediction head: `bias` held here, tied to `decoder.bias`."""

    def __init__(self, embedding):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(V))
        self.decoder = torch.nn.Linear(D, V)
        self.decoder.weight = embedding.weight
        self.decoder.bias = self.bias

    def forward(self, h):
        return self.decoder(h)


class TorchMLM(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embeddings = torch.nn.Embedding(V, D)
        self.transform = torch.nn.Linear(D, D)
        self.predictions = _Head(self.embeddings)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn_like(p))
        self.eval()

    def forward(self, ids):
        return self.predictions(torch.tanh(self.transform(self.embeddings(ids))))


class _FlaxHead(nn.Module):
    """transformers' Flax head: `bias` alone, added after the product with the
    embedding table."""

    @nn.compact
    def __call__(self, h, table):
        bias = self.param("bias", nn.initializers.normal(1.0), (V,))
        return h @ table.T + bias[None, None]


class FlaxMLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        tokens = nn.Embed(V, D, name="tokens")
        h = jnp.tanh(nn.Dense(D, name="mix")(tokens(ids)))
        return _FlaxHead(name="lm")(h, tokens.embedding)


IDS = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)


def _flax(seed):
    module = FlaxMLM()
    return module, module.init(jax.random.key(seed), jnp.asarray(IDS))


def _torch_out(model):
    with torch.no_grad():
        return model(torch.from_numpy(IDS).long()).numpy()


def test_mlm_bias_torch_into_flax_and_back_by_the_forward_pass():
    """torch -> Linen and Linen -> torch, other names on each side: the bias pairs
    as the array added to the product's result, and the outputs are the source's
    (torch's own forward for the torch side); `load_state_dict(strict=True)` takes
    the export, tied names and all."""
    source = TorchMLM(1)
    module, variables = _flax(2)
    _, ported = bridge.port(source, (module, variables), example=(IDS,))
    got = module.apply(ported, jnp.asarray(IDS))
    np.testing.assert_allclose(got, _torch_out(source), rtol=1e-5, atol=1e-5)
    assert np.array_equal(
        ported["params"]["lm"]["bias"], source.predictions.bias.detach().numpy()
    )
    target = TorchMLM(3)
    state = bridge.port((module, variables), target, example=(IDS,))
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=True
    )
    want = module.apply(variables, jnp.asarray(IDS))
    np.testing.assert_allclose(_torch_out(target), want, rtol=1e-5, atol=1e-5)


def test_mlm_bias_without_example_inputs_is_refused():
    """Without a forward pass, the head's `bias` alone reads as a norm's, which
    PyTorch's loose `bias` is not: refused, never guessed."""
    with pytest.raises(bridge.PortError, match=r"\.lm .*LayerNorm: bias \(11,\)"):
        bridge.port(TorchMLM(1), _flax(2))


# --- two heads' loose biases of one shape, other names on each side ---------------


def _bert_head(embedding):
    """transformers' own `BertLMPredictionHead` (transform, decoder tied to the
    word embeddings, loose `bias` as its `decoder.bias`, as `BertForMaskedLM` ties
    them)."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLMPredictionHead

    config = BertConfig(vocab_size=V, hidden_size=D, layer_norm_eps=1e-12)
    head = BertLMPredictionHead(config)
    head.decoder.weight = embedding.weight
    head.decoder.bias = head.bias
    return head


class TorchTwoHeads(torch.nn.Module):
    """Two masked-LM heads on one embedding: `mlm` on the embeddings, `aux` on
    their `tanh`; `plain`: heads without a transform, both on the embeddings."""

    def __init__(self, seed, plain=False):
        super().__init__()
        torch.manual_seed(seed)
        self.embeddings = torch.nn.Embedding(V, D)
        make = _Head if plain else _bert_head
        self.mlm, self.aux = make(self.embeddings), make(self.embeddings)
        self.plain = plain
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn_like(p))
        self.eval()

    def forward(self, ids):
        h = self.embeddings(ids)
        return self.mlm(h), self.aux(h if self.plain else torch.tanh(h))


class _FlaxTwoHead(nn.Module):
    """A Flax masked-LM head whose loose bias is named `output_bias`."""

    plain: bool

    @nn.compact
    def __call__(self, h, table):
        if not self.plain:
            h = nn.gelu(nn.Dense(D, name="transform_dense")(h), approximate=False)
            h = nn.LayerNorm(epsilon=1e-12, name="transform_LayerNorm")(h)
        bias = self.param("output_bias", nn.initializers.normal(1.0), (V,))
        return h @ table.T + bias[None, None]


class FlaxTwoHeads(nn.Module):
    """`TorchTwoHeads` in Linen, computing the `aux` head first."""

    plain: bool = False

    @nn.compact
    def __call__(self, ids):
        tokens = nn.Embed(V, D, name="tokens")
        h = tokens(ids)
        mlm, aux = (
            _FlaxTwoHead(self.plain, name="mlm"),
            _FlaxTwoHead(self.plain, name="aux"),
        )
        second = aux(h if self.plain else jnp.tanh(h), tokens.embedding)
        return mlm(h, tokens.embedding), second


def _two(model):
    with torch.no_grad():
        return [o.numpy() for o in model(torch.from_numpy(IDS).long())]


def test_two_heads_biases_pair_by_what_they_are_computed_from():
    """Two BERT heads' loose biases `(V,)`, named `bias` in torch and `output_bias`
    in Flax, which uses them in the other order: each pairs with the bias added
    after its own head's transform (was paired by order of use: 3.0 off). Both
    directions, against each framework's own forward pass."""
    source = TorchTwoHeads(1)
    module = FlaxTwoHeads()
    variables = module.init(jax.random.key(2), jnp.asarray(IDS))
    _, ported = bridge.port(source, (module, variables), example=(IDS,))
    for got, want in zip(module.apply(ported, jnp.asarray(IDS)), _two(source)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    held = ported["params"]["aux"]["output_bias"]
    assert np.array_equal(held, source.aux.bias.detach().numpy())
    target = TorchTwoHeads(3)
    state = bridge.port((module, variables), target, example=(IDS,))
    target.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=True
    )
    for got, want in zip(_two(target), module.apply(variables, jnp.asarray(IDS))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_two_heads_biases_computed_alike_are_refused():
    """Two heads without a transform, on one input and one table: their biases are
    computed alike, so only each pass's order of use would pair them (Flax's is
    the other: ported crossed before). Refused, naming both and the fix."""
    module = FlaxTwoHeads(plain=True)
    variables = module.init(jax.random.key(2), jnp.asarray(IDS))
    with pytest.raises(bridge.PortError, match=r"\['\.aux\.bias', '\.mlm\.bias'\]"):
        bridge.port(TorchTwoHeads(1, plain=True), (module, variables), example=(IDS,))
