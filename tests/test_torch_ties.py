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
