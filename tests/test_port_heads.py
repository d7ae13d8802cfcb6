"""One array in two roles inside a JAX model (issue 37): an embedding looked up and
read again as the LM head (`nn.Embed.attend`, NNX's `embed.attend`), ported to and
from a model with a head of its own. The traced pass decides it (the array is a
`gather`'s table and a later `dot_general`'s operand), never a name; each port is
compared with the other framework's own forward pass."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires


pytestmark = requires("NNX")

V, D = 11, 4
IDS = np.array([[1, 5, 9, 3], [4, 0, 10, 6]], np.int32)


class _NNXTied(nnx.Module):
    """The head reads the embedding (`attend`): one array, two layers."""

    def __init__(self, rngs):
        self.lookup = nnx.Embed(V, D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, ids):
        return self.lookup.attend(jnp.tanh(self.mlp(self.lookup(ids))))


class _LinenUntied(nn.Module):
    """Its own names, a head of its own."""

    @nn.compact
    def __call__(self, ids):
        h = jnp.tanh(nn.Dense(D, name="hidden")(nn.Embed(V, D, name="tokens")(ids)))
        return nn.Dense(V, use_bias=False, name="logits")(h)


class _NNXOneHot(nnx.Module):
    """The table is contracted twice (a one-hot product, then `attend`) and never
    looked up: by the computation, no embedding with a head."""

    def __init__(self, rngs):
        self.lookup = nnx.Embed(V, D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, ids):
        table = self.lookup.embedding[...]
        h = jax.nn.one_hot(ids, V) @ table
        return self.lookup.attend(jnp.tanh(self.mlp(h)))


def _linen():
    module = _LinenUntied()
    return module, module.init(jax.random.key(1), IDS)


def test_tied_head_fills_a_separate_head():
    source = _NNXTied(nnx.Rngs(0))
    plan = bridge.port_plan(source, _linen(), example=(IDS,))
    assert not plan.problems, plan
    assert set(plan.tied) & {
        ".lookup.embedding -> .tokens, .logits",
        ".lookup.embedding -> .logits, .tokens",
    }, plan
    module, variables = bridge.port(source, _linen(), example=(IDS,))
    np.testing.assert_allclose(
        np.asarray(module.apply(variables, IDS)),
        np.asarray(source(IDS)),
        rtol=1e-6,
        atol=1e-6,
    )
    table = np.asarray(source.lookup.embedding[...])
    params = variables["params"]
    np.testing.assert_array_equal(np.asarray(params["tokens"]["embedding"]), table)
    np.testing.assert_array_equal(np.asarray(params["logits"]["kernel"]), table.T)


def test_separate_head_into_a_tied_one_needs_equal_arrays():
    module, variables = _linen()
    with pytest.raises(bridge.PortError) as error:  # two random arrays
        bridge.port((module, variables), _NNXTied(nnx.Rngs(0)), example=(IDS,))
    message = str(error.value)
    assert "tied: the target holds .lookup.embedding once" in message
    assert "differ (.tokens and .logits" in message
    params = dict(variables["params"])
    params["logits"] = {"kernel": params["tokens"]["embedding"].T}
    equal = {"params": params}
    ported = bridge.port((module, equal), _NNXTied(nnx.Rngs(0)), example=(IDS,))
    np.testing.assert_allclose(
        np.asarray(ported(IDS)),
        np.asarray(module.apply(equal, IDS)),
        rtol=1e-6,
        atol=1e-6,
    )


def test_no_head_without_a_lookup():
    # the same array contracted twice, never looked up: the pass shows no head, so
    # the other side's head stays missing (refused), whatever the names say
    with pytest.raises(bridge.PortError, match="missing: target layer .logits"):
        bridge.port(_NNXOneHot(nnx.Rngs(0)), _linen(), example=(IDS,))
    tied = bridge.port_plan(_NNXTied(nnx.Rngs(0)), _linen(), example=(IDS,))
    assert not tied.problems, tied  # the same names, looked up: a head


def test_no_head_without_a_trace():
    with pytest.raises(bridge.PortError, match="missing: target layer .logits"):
        bridge.port(_NNXTied(nnx.Rngs(0)), _linen())


# --- a Hugging Face folder's head, told by its config.json (no torch) -------------


def test_folder_head_from_config_and_files():
    from bridge._families._tied_heads import folder_head

    files = {"model.embed_tokens.weight": (32, 16), "model.norm.weight": (16,)}
    for config, said in (
        ({"vocab_size": 32, "tie_word_embeddings": True}, "true"),
        ({"vocab_size": 32}, "not set (transformers' default: true)"),
        ({"text_config": {"vocab_size": 32}}, "not set (transformers' default: true)"),
    ):
        head, table, why = folder_head(config, files)
        assert (head, table) == ("lm_head.weight", "model.embed_tokens.weight")
        assert why.startswith(f"config.json: tie_word_embeddings {said}, "), why
    # the files hold the head: nothing to tie
    assert (
        folder_head({"vocab_size": 32}, {**files, "lm_head.weight": (32, 16)}) is None
    )
    # untied, no head: nothing fills it
    untied = folder_head({"vocab_size": 32, "tie_word_embeddings": False}, files)
    assert untied == (
        "lm_head.weight",
        "",
        "config.json: tie_word_embeddings false, and no lm_head.weight in the files",
    )
    # two tables of the vocabulary's rows: which one is not told
    two = {**files, "model.positions.weight": (32, 16)}
    _, table, why = folder_head({"vocab_size": 32}, two)
    assert table == "" and "the files hold 2 tables of vocab_size=32 rows" in why
