import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import bridge
from bridge._adapters import _equinox

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


class WithNones(eqx.Module):
    """`None` fields between arrays, a function and a python float as leaves, and a
    static field."""

    first: eqx.nn.Linear
    gap: eqx.nn.Linear | None
    last: eqx.nn.Linear
    scale: float
    activation: object
    name: str = eqx.field(static=True)

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(models.D_IN, models.D_HID, use_bias=False, key=k1)
        self.gap = None
        self.last = eqx.nn.Linear(models.D_HID, models.D_OUT, key=k2)
        self.scale = 0.5
        self.activation = jax.nn.relu
        self.name = "with-nones"

    def __call__(self, x):
        return self.last(self.activation(self.first(x)) * self.scale)


def _forward(model, state, x):
    """A batch through the model (vmapped), with its state if it has one."""
    if state is None:
        return jax.vmap(model)(x)
    return jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(
        x, state
    )


CASES = {
    "mlp": (lambda: (models.equinox_mlp(), None), models.mlp_input),
    "cnn-batch": (lambda: models.equinox_cnn(mode="batch"), models.cnn_input),
    "cnn-ema": (lambda: models.equinox_cnn(mode="ema"), models.cnn_input),
    "block": (lambda: (models.equinox_block(), None), models.tokens),
    "nones": (lambda: (WithNones(jax.random.key(0)), None), models.mlp_input),
}


@pytest.mark.parametrize("name", CASES)
def test_round_trip_is_exact_zero_copy_and_leaves_the_source(name):
    make, inputs = CASES[name]
    model, state = make()
    source = model if state is None else (model, state)
    before = snapshot(source)
    t = bridge.from_equinox(model, state)
    back = bridge.to_equinox(t)

    assert type(back) is type(source)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(source)
    assert tree_equal_bits(
        eqx.filter(back, eqx.is_array), eqx.filter(source, eqx.is_array)
    )
    assert bool(eqx.tree_equal(back, source))  # functions and floats too
    # zero copy: the Tree's leaves and the rebuilt model's are the source's arrays
    arrays = leaf_objects(eqx.filter(source, eqx.is_array))
    assert {id(x) for x in leaf_objects(t)} == {id(x) for x in arrays}
    assert same_objects(leaf_objects(eqx.filter(back, eqx.is_array)), arrays)
    assert snapshot(source) == before
    x = inputs()
    assert tree_equal_bits(_forward(*make_pair(back), x), _forward(model, state, x))


def make_pair(native):
    return native if isinstance(native, tuple) else (native, None)


def test_state_entries_sit_where_their_state_index_is():
    model, state = models.equinox_cnn(mode="batch")
    t = bridge.from_equinox(model, state)
    assert list(t.bn) == ["weight", "bias", "batch_counter", "batch_state_index"]
    mean, var = state.get(model.bn.batch_state_index)
    assert t.bn.batch_state_index[0] is mean and t.bn.batch_state_index[1] is var
    r = bridge.roles(t)
    assert (r.bn.weight, r.bn.batch_state_index[0], r.bn.batch_counter) == (
        "params",
        "batch_stats",
        "batch_stats",
    )
    ema = bridge.roles(bridge.from_equinox(*models.equinox_cnn(mode="ema")))
    assert (ema.bn.ema_state_index[1], ema.bn.ema_first_time_index) == (
        "batch_stats",
        "batch_stats",
    )


class Counter(eqx.Module):
    """A stateful layer that is not a BatchNorm: its entry's role is `state`."""

    index: eqx.nn.StateIndex

    def __init__(self):
        self.index = eqx.nn.StateIndex(jnp.zeros((), jnp.int32))

    def __call__(self, x, state):
        return x, state.set(self.index, state.get(self.index) + 1)


def test_other_state_entries_have_the_state_role():
    model, state = eqx.nn.make_with_state(Counter)()
    t = bridge.from_equinox(model, state)
    assert bridge.roles(t).index == "state"
    back, back_state = bridge.to_equinox(t)
    assert back_state.get(back.index) is t.index


@requires("eqx.nn.BatchNorm(mode=...)")
def test_undeleted_initial_state_with_a_state():
    """`state = eqx.nn.State(model)` without `delete_init_state`: the State's
    entries are the leaves, the model's initial values are kept as they are."""
    model = models.EquinoxCNN(jax.random.key(0))
    state = eqx.nn.State(model)
    t = bridge.from_equinox(model, state)
    assert list(t.bn) == ["weight", "bias", "batch_counter", "batch_state_index"]
    back, back_state = bridge.to_equinox(t)
    assert bool(eqx.tree_equal(back, model))
    assert back.bn.batch_state_index.init[0] is model.bn.batch_state_index.init[0]
    assert tree_equal_bits(back_state, state)
    x = models.cnn_input()
    assert tree_equal_bits(_forward(back, back_state, x), _forward(model, state, x))


@requires("eqx.nn.BatchNorm(mode=...)")
def test_undeleted_initial_state_without_a_state():
    model = models.EquinoxCNN(jax.random.key(0))
    t = bridge.from_equinox(model)
    r = bridge.roles(t)
    assert r.bn.batch_state_index.init[0] == "batch_stats" and r.conv.weight == "params"
    assert bool(eqx.tree_equal(bridge.to_equinox(t), model))


class _Holder(eqx.Module):
    value: jax.Array
    inner: eqx.nn.Sequential


@pytest.mark.parametrize("dtype", DTYPES + ("key",))
def test_every_dtype_round_trips_exactly(dtype):
    leaf = jax.random.split(jax.random.key(7), 3) if dtype == "key" else array_of(dtype)
    holder = _Holder(leaf, eqx.nn.Sequential([eqx.nn.Lambda(jax.nn.relu)]))
    t = bridge.from_equinox(holder)
    assert t.value is leaf and t.value.dtype == leaf.dtype and len(t) == 1
    back = bridge.to_equinox(t)
    assert back.value is leaf and back.inner.layers[0].fn is jax.nn.relu
    assert tree_equal_bits(back.value, holder.value)


def test_surgery_reinitialises_a_wider_head():
    model = models.equinox_mlp()
    before = snapshot(model)
    t = bridge.from_equinox(model)
    weight, bias = jnp.ones((7, models.D_HID)), jnp.arange(7.0)
    new = eqx.tree_at(
        lambda s: (s.layers[-1].weight, s.layers[-1].bias), t, replace=(weight, bias)
    )
    got = bridge.to_equinox(new)
    # the native way, the oracle: eqx.tree_at on the model itself
    want = eqx.tree_at(
        lambda m: (m.layers[-1].weight, m.layers[-1].bias),
        model,
        replace=(weight, bias),
    )
    assert bool(eqx.tree_equal(got, want))
    assert (
        got.layers[-1].weight is weight
        and got.layers[0].weight is model.layers[0].weight
    )
    x = models.mlp_input()
    assert tree_equal_bits(jax.vmap(got)(x), jax.vmap(want)(x))
    assert snapshot(model) == before


def test_surgery_on_running_statistics():
    model, state = models.equinox_cnn()
    t = bridge.from_equinox(model, state)
    zeros = jnp.zeros(4)
    new = eqx.tree_at(lambda s: s.bn.batch_state_index[0], t, replace=zeros)
    back, back_state = bridge.to_equinox(new)
    assert back_state.get(back.bn.batch_state_index)[0] is zeros
    assert state.get(model.bn.batch_state_index)[0] is not zeros


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="expects `model`, an eqx.Module, got list"):
        bridge.from_equinox([jnp.ones(2)])
    model, state = models.equinox_cnn()
    with pytest.raises(TypeError, match="`state` must be an eqx.nn.State, got dict"):
        bridge.from_equinox(model, {})
    _, other = eqx.nn.make_with_state(Counter)()
    with pytest.raises(ValueError, match="StateIndex that is not in the model"):
        bridge.from_equinox(model, other)


class _Mixed(eqx.Module):
    """Containers the one-walk conversion reads (tuples, lists, dicts, `None`), a
    StateIndex with its initial value, a tied array, and a custom pytree node it
    leaves to the general path (`custom`)."""

    layers: tuple
    table: dict
    items: list
    bn: eqx.nn.BatchNorm
    tied: jax.Array
    again: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = (eqx.nn.Linear(2, 3, key=k1), None, eqx.nn.Linear(3, 2, key=k2))
        self.table = {"b": jnp.ones(2), "a": (jnp.zeros(1), jax.nn.relu), "c": None}
        self.items = [jnp.arange(3.0), 1.5]
        self.bn = eqx.nn.BatchNorm(3, "batch", mode="batch")
        self.tied = self.again = jnp.ones(4)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda: _Mixed(jax.random.key(0)),
            marks=requires("eqx.nn.BatchNorm(mode=...)"),
        ),
        lambda: WithNones(jax.random.key(0)),
        lambda: models.equinox_block(),
        lambda: eqx.nn.MLP(2, 3, 4, 2, key=jax.random.key(0)),
    ],
)
def test_one_walk_makes_the_tree_of_the_general_path(make, monkeypatch):
    """The oracle is the general path (`jax.tree_util` key paths into `build`): the
    same structure (paths, native positions, node kinds, roles, statics), the very
    same leaf objects, and `to_equinox` gives the model back."""
    model = make()
    fast = bridge.from_equinox(model)
    monkeypatch.setattr(_equinox, "_walk", lambda model: None)
    general = bridge.from_equinox(model)
    assert jax.tree_util.tree_structure(fast) == jax.tree_util.tree_structure(general)
    assert bridge._tree.leaf_roles(fast) == bridge._tree.leaf_roles(general)
    assert same_objects(leaf_objects(fast), leaf_objects(general))
    assert bool(eqx.tree_equal(bridge.to_equinox(fast), model))


class _Pair(eqx.Module):
    inner: object


def test_a_custom_pytree_node_takes_the_general_path():
    """A node of a kind the walk does not read (a namedtuple) is left to the general
    path, whose Tree it gives."""
    import collections

    Point = collections.namedtuple("Point", "x y")
    model = _Pair(Point(jnp.ones(2), jnp.zeros(3)))
    assert _equinox._walk(model) is None
    t = bridge.from_equinox(model)
    assert t.inner.x is model.inner.x
    assert bool(eqx.tree_equal(bridge.to_equinox(t), model))
