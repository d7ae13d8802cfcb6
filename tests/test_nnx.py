import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import bridge
from bridge._tree import kind, native_order

from . import models
from .helpers import (
    DTYPES,
    array_of,
    leaf_objects,
    requires,
    same_objects,
    snapshot,
    tree_equal_bits,
)


# bridge's NNX adapter needs flax >= 0.12.1
pytestmark = requires("NNX")


class Dropped(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(models.D_IN, models.D_HID, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.linear(x))


class Tied(nnx.Module):
    """An embedding tied to the output projection, and one Linear used twice."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(models.VOCAB, models.D_MODEL, rngs=rngs)
        self.mix = nnx.Linear(models.D_MODEL, models.D_MODEL, rngs=rngs)
        self.again = self.mix
        self.unembed = self.embed.embedding  # the same Variable

    def __call__(self, ids):
        x = self.again(self.mix(self.embed(ids)))
        return x @ self.unembed[...].T


class Nested(nnx.Module):
    """`nnx.Dict` and `nnx.List` nested, more than ten entries, keys not sorted."""

    def __init__(self, rngs):
        self.blocks = nnx.List(
            [nnx.Dict(zeta=nnx.Linear(2, 2, rngs=rngs)) for _ in range(12)]
        )
        self.heads = nnx.Dict(
            b=nnx.List([nnx.Linear(2, 3, rngs=rngs)]), a=nnx.Linear(2, 1, rngs=rngs)
        )
        self.sizes = [2, 2]  # a static, mutable attribute
        # plain containers of Variables (nnx.merge rebuilds dicts in sorted order)
        self.extra = nnx.data(
            (nnx.Param(jnp.ones(1)), {"z": nnx.BatchStat(jnp.ones(2)), "y": None})
        )
        self.seq = nnx.Sequential(nnx.Linear(2, 2, rngs=rngs), jax.nn.relu)

    def __call__(self, x):
        for block in self.blocks:
            x = block["zeta"](x)
        return self.heads["b"][0](x), self.heads["a"](x)


def _dropped():
    return Dropped(nnx.Rngs(0, dropout=1))


def _tied():
    return Tied(nnx.Rngs(0))


def _nested():
    return Nested(nnx.Rngs(0))


CASES = {
    "mlp": (models.nnx_mlp, models.mlp_input),
    "cnn": (models.nnx_cnn, models.cnn_input),
    "block": (models.nnx_block, models.tokens),
    "dropout": (_dropped, models.mlp_input),
    "tied": (_tied, models.tokens),
    "nested": (_nested, lambda: jnp.ones((1, 2))),
}


def _variables(module) -> list:
    return nnx.graph.flatten(module)[1].leaves


def _graph_objects(module) -> set[int]:
    """Every module, Rngs and Variable object of an NNX graph (the mutable ones)."""
    return {
        id(node)
        for _, node in nnx.iter_graph(module)
        if isinstance(node, (nnx.Pytree, nnx.Variable))
    }


@pytest.mark.parametrize("name", CASES)
def test_round_trip_is_exact_zero_copy_and_shares_nothing(name):
    make, inputs = CASES[name]
    module = make()
    before = snapshot(module)
    t = bridge.from_nnx(module)
    back = bridge.to_nnx(t)

    graphdef, state = nnx.split(module)
    graphdef2, state2 = nnx.split(back)
    assert type(back) is type(module) and graphdef2 == graphdef
    assert tree_equal_bits(state2, state)
    # the attributes in definition order again, so converting back gives the same Tree
    assert list(vars(back)) == list(vars(module))
    again = bridge.from_nnx(back)
    assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(t)
    # zero copy: the Tree's leaves and the new Variables hold the very same arrays
    raw = [v.get_raw_value() for v in _variables(module)]
    assert {id(x) for x in leaf_objects(t)} == {id(x) for x in raw}
    assert same_objects([v.get_raw_value() for v in _variables(back)], raw)
    # no Variable and no module is shared with the source, which is unchanged
    assert not _graph_objects(back) & _graph_objects(module)
    assert snapshot(module) == before
    # forward outputs equal bit for bit (Dropout: same key, same count, same mask)
    x = inputs()
    assert tree_equal_bits(back(x), module(x))


def test_children_come_in_canonical_order_with_the_definition_order_recorded():
    module = _nested()
    t = bridge.from_nnx(module)
    assert list(t) == ["blocks", "extra", "heads", "seq"]  # natural key order
    native = native_order(t)
    assert native[()] == ("blocks", "heads", "extra", "seq")  # definition order
    assert list(t.extra[1]) == ["z"] and t.seq.layers[-1].kernel.shape == (2, 2)
    assert list(t.heads) == ["a", "b"] and native[("heads",)] == ("b", "a")
    assert len(t.blocks) == 12 and t.blocks[-1] is t.blocks[11]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)]
    assert paths[:4] == [
        ".blocks[0].zeta.bias",
        ".blocks[0].zeta.kernel",
        ".blocks[1].zeta.bias",
        ".blocks[1].zeta.kernel",
    ]
    assert paths[20:24] == [
        ".blocks[10].zeta.bias",
        ".blocks[10].zeta.kernel",
        ".blocks[11].zeta.bias",
        ".blocks[11].zeta.kernel",
    ]
    assert kind(t.heads) is nnx.Dict and kind(t.blocks) is nnx.List
    back = bridge.to_nnx(t)  # the definition order again
    assert list(vars(back)) == list(vars(module)) and list(back.heads) == ["b", "a"]


def test_static_mutable_attributes_are_not_shared():
    module = _nested()
    back = bridge.to_nnx(bridge.from_nnx(module))
    assert back.sizes == module.sizes and back.sizes is not module.sizes


def test_tied_weights_stay_tied_and_appear_once():
    module = _tied()
    t = bridge.from_nnx(module)
    # one path for each shared object: the first in nnx.split's (sorted) order
    assert list(t) == ["again", "embed"] and list(t.embed) == ["embedding"]
    assert native_order(t)[()] == ("embed", "again")  # definition order
    back = bridge.to_nnx(t)
    assert back.again is back.mix and back.unembed is back.embed.embedding
    assert back.unembed is not module.unembed
    # surgery on the one leaf changes both uses
    new = eqx.tree_at(lambda s: s.embed.embedding, t, replace=t.embed.embedding * 2)
    tied = bridge.to_nnx(new)
    assert tied.unembed is tied.embed.embedding
    assert tree_equal_bits(tied.unembed[...], module.unembed[...] * 2)


def test_dropout_rng_state_is_carried_with_rngs_roles():
    module = _dropped()
    t = bridge.from_nnx(module)
    r = bridge.roles(t)
    assert (r.drop.rngs.key, r.drop.rngs.count, r.linear.kernel) == (
        "rngs",
        "rngs",
        "params",
    )
    assert jnp.issubdtype(t.drop.rngs.key.dtype, jax.dtypes.prng_key)
    x = models.mlp_input()
    back = bridge.to_nnx(t)
    first = module(x)  # advances the source's counter, not the copy's
    assert tree_equal_bits(back(x), first)
    assert int(module.drop.rngs.count[...]) == 1 and int(t.drop.rngs.count) == 0


def test_cnn_roles():
    r = bridge.roles(bridge.from_nnx(models.nnx_cnn()))
    assert (r.bn.scale, r.bn.bias, r.bn.mean, r.bn.var) == (
        "params",
        "params",
        "batch_stats",
        "batch_stats",
    )


class AllDtypes(nnx.Module):
    def __init__(self):
        for dtype in DTYPES:
            setattr(self, f"p_{dtype}", nnx.Param(array_of(dtype)))
        self.stat = nnx.BatchStat(array_of("float32"))
        self.cache = nnx.Cache(array_of("bfloat16"))
        self.seen = nnx.Intermediate(array_of("float16"))
        self.counter = nnx.Variable(array_of("uint32"))
        self.raw = nnx.data(array_of("int8"))  # an array, not a Variable
        self.rngs = nnx.Rngs(3, dropout=4)


def test_every_dtype_and_variable_type_round_trips_exactly():
    module = AllDtypes()
    t = bridge.from_nnx(module)
    back = bridge.to_nnx(t)
    assert tree_equal_bits(nnx.split(back)[1], nnx.split(module)[1])
    for dtype in DTYPES:
        assert getattr(back, f"p_{dtype}").get_raw_value() is getattr(t, f"p_{dtype}")
        assert getattr(t, f"p_{dtype}").dtype == dtype
    assert jnp.issubdtype(t.rngs.dropout.key.dtype, jax.dtypes.prng_key)
    r = bridge.roles(t)
    assert (r.stat, r.cache, r.seen, r.counter, r.raw) == (
        "batch_stats",
        "cache",
        "intermediates",
        "Variable",
        "state",
    )
    assert (r.rngs.dropout.key, r.rngs.default.count) == ("rngs", "rngs")
    assert back.rngs.dropout() is not None  # the Rngs works after the round trip


def test_surgery_reinitialises_a_wider_head():
    module = models.nnx_mlp()
    before = snapshot(module)
    t = bridge.from_nnx(module)
    kernel, bias = jnp.ones((models.D_HID, 7)), jnp.arange(7.0)
    new = eqx.tree_at(
        lambda s: (s.layers[-1].kernel, s.layers[-1].bias), t, replace=(kernel, bias)
    )
    got = bridge.to_nnx(new)
    # the native way: replace the head's Variables in a clone
    want = nnx.clone(module)
    want.layers[-1].kernel = nnx.Param(kernel)
    want.layers[-1].bias = nnx.Param(bias)
    assert got.layers[-1].kernel.get_raw_value() is kernel
    assert got.layers[0].kernel.get_raw_value() is module.layers[0].kernel[...]
    x = models.mlp_input()
    assert got(x).shape == (x.shape[0], 7)
    assert tree_equal_bits(got(x), want(x))
    assert snapshot(module) == before and t.layers[-1].kernel.shape[-1] == models.D_OUT


def test_replace_a_layer_of_another_shape():
    module = models.nnx_mlp()
    t = bridge.from_nnx(module)
    wide = nnx.Linear(models.D_IN, 9, rngs=nnx.Rngs(5))
    new = eqx.tree_at(
        lambda s: (s.layers[0].kernel, s.layers[0].bias, s.layers[1].kernel),
        t,
        replace=(wide.kernel[...], wide.bias[...], jnp.ones((9, models.D_HID))),
    )
    got = bridge.to_nnx(new)
    assert got.layers[0].kernel.shape == (models.D_IN, 9)
    assert got(models.mlp_input()).shape == (4, models.D_OUT)
    assert module.layers[0].kernel.shape == (models.D_IN, models.D_HID)


def test_a_non_module_is_refused():
    with pytest.raises(TypeError, match="expects `module`, an nnx.Module, got dict"):
        bridge.from_nnx({"kernel": jnp.ones(2)})
    graphdef, state = nnx.split(models.nnx_mlp())
    with pytest.raises(TypeError, match="expects `module`, an nnx.Module, got State"):
        bridge.from_nnx(state)


class _TwoLayers(nnx.Module):
    def __init__(self, a_first: bool, seed: int):
        rngs = nnx.Rngs(seed)
        if a_first:
            self.a = nnx.Linear(2, 2, rngs=rngs)
        self.b = nnx.Linear(2, 2, rngs=rngs)
        if not a_first:
            self.a = nnx.Linear(2, 2, rngs=rngs)


def test_a_second_module_of_the_same_structure_takes_its_own_arrays_and_order():
    # equal graph definitions (NNX sorts attributes): the second conversion reuses
    # the first one's Tree structure only if the classes and attribute order match
    one, two = _TwoLayers(True, 0), _TwoLayers(True, 1)
    first, second = bridge.from_nnx(one), bridge.from_nnx(two)
    assert second.a.kernel is two.a.kernel.get_raw_value()
    assert first.a.kernel is one.a.kernel.get_raw_value()
    swapped = _TwoLayers(False, 0)
    tree = bridge.from_nnx(swapped)
    assert list(tree) == ["a", "b"] == list(second)  # canonical order
    assert native_order(tree)[()] == ("b", "a") and () not in native_order(second)
    assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(second)
    back = bridge.to_nnx(tree)
    assert [k for k in vars(back) if k in ("a", "b")] == ["b", "a"]
    assert back.a.kernel.get_raw_value() is swapped.a.kernel.get_raw_value()


@pytest.mark.skipif(not hasattr(nnx, "WeightNorm"), reason="flax has no nnx.WeightNorm")
def test_a_dict_keyed_by_tuples_round_trips():
    """`nnx.WeightNorm` keeps its scales in a dict keyed by tuples (`('kernel',)`):
    the Tree shows such a key by its repr, and the module comes back exactly, its
    forward pass unchanged (was a raw TypeError from sorting the keys)."""
    module = nnx.WeightNorm(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    tree = bridge.from_nnx(module)
    held = module.scales[("kernel",)]  # an array, or an nnx.Param (flax >= 0.12.9)
    assert jnp.array_equal(tree.scales["('kernel',)"], held[...])
    scaled = eqx.tree_at(lambda t: t.scales["('kernel',)"], tree, jnp.full(4, 2.0))
    back = bridge.to_native(scaled)
    assert isinstance(back, nnx.WeightNorm)
    assert list(back.scales) == [("kernel",)]
    assert type(back.scales[("kernel",)]) is type(held)
    x = jnp.ones((2, 3))
    if isinstance(held, nnx.Variable):
        held[...] = jnp.full(4, 2.0)
    else:
        module.scales[("kernel",)] = jnp.full(4, 2.0)
    assert jnp.array_equal(back(x), module(x))
