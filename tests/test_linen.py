import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import FrozenDict

import bridge
from bridge._adapters._linen import linen_module
from bridge._tree import native_order

from . import models
from .helpers import (
    DTYPES,
    array_of,
    key_orders,
    leaf_objects,
    same_objects,
    snapshot,
    tree_equal_bits,
)


class SetupMLP(nn.Module):
    """`setup` with a list of layers: Linen names them `layers_0`, `layers_1`, ..."""

    sizes: tuple[int, ...] = (5,) * 11 + (2,)

    def setup(self):
        self.layers = [nn.Dense(n) for n in self.sizes]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class Boxed(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(4, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
        kernel_init = nn.with_logical_partitioning(init, ("embed", "mlp"))
        return nn.Dense(2, kernel_init=kernel_init)(x)


class Head(nn.Module):
    """An MLP whose output width is a field, to reinitialise its head wider."""

    out: int = models.D_OUT

    @nn.compact
    def __call__(self, x):
        x = jax.nn.relu(nn.Dense(models.D_HID)(x))
        return nn.Dense(self.out)(x)


def _mappings(obj):
    """Every mapping (dict, FrozenDict) and box in nested variables."""
    if isinstance(obj, nn.meta.AxisMetadata):
        return [obj]
    if not hasattr(obj, "items"):
        return []
    return [obj] + [m for child in obj.values() for m in _mappings(child)]


def sequential():
    return nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(3), nn.relu, nn.Dense(2)])


def _init(module, x):
    return module, module.init(jax.random.key(0), x)


CASES = {
    "mlp": (models.linen_mlp, models.mlp_input),
    "cnn": (models.linen_cnn, models.cnn_input),
    "block": (models.linen_block, models.tokens),
    "setup": (lambda: _init(SetupMLP(), models.mlp_input()), models.mlp_input),
    "sequential": (lambda: _init(sequential(), models.mlp_input()), models.mlp_input),
    "boxed": (lambda: _init(Boxed(), models.mlp_input()), models.mlp_input),
}


@pytest.mark.parametrize("name", CASES)
def test_round_trip_is_exact_zero_copy_and_leaves_the_source(name):
    make, inputs = CASES[name]
    module, variables = make()
    before = snapshot(variables)
    t = bridge.from_linen(variables, module)
    back = bridge.to_linen(t)

    assert type(back) is dict and tree_equal_bits(back, variables)
    assert key_orders(back) == key_orders(variables)  # creation order, not sorted
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(variables)
    # zero copy both ways: the Tree's leaves and the result's are the source arrays
    assert {id(x) for x in leaf_objects(t)} == {id(x) for x in leaf_objects(variables)}
    assert same_objects(leaf_objects(back), leaf_objects(variables))
    # a new container at every level (nothing mutable shared), the source untouched
    mappings = lambda v: {id(m) for m in _mappings(v)}  # noqa: E731
    assert not mappings(back) & mappings(variables)
    assert snapshot(variables) == before
    # forward outputs equal bit for bit, through the variables and the bound module
    x = inputs()
    want = module.apply(variables, x)
    assert tree_equal_bits(module.apply(back, x), want)
    assert tree_equal_bits(bridge.to_native(t)(x), want)


def test_cnn_is_organised_by_module_with_collection_roles():
    module, variables = models.linen_cnn()
    t = bridge.from_linen(variables, module)
    assert list(t) == ["BatchNorm_0", "Conv_0", "Dense_0"]  # canonical order
    assert native_order(t)[()] == ("Conv_0", "BatchNorm_0", "Dense_0")
    assert list(t.BatchNorm_0) == ["bias", "mean", "scale", "var"]
    assert t.BatchNorm_0.mean is variables["batch_stats"]["BatchNorm_0"]["mean"]
    r = bridge.roles(t)
    assert (r.BatchNorm_0.scale, r.BatchNorm_0.mean, r.Conv_0.kernel) == (
        "params",
        "batch_stats",
        "params",
    )


def test_training_forward_through_the_bound_module_updates_running_stats():
    module, variables = models.linen_cnn()
    x = models.cnn_input()
    want, updates = module.apply(variables, x, train=True, mutable=["batch_stats"])
    native = bridge.to_native(bridge.from_linen(variables, module))
    got = native(x, train=True)
    assert tree_equal_bits(got, want)
    assert tree_equal_bits(native.variables["batch_stats"], updates["batch_stats"])


def test_names_keep_linen_creation_order_past_ten():
    module, variables = CASES["setup"][0]()
    t = bridge.from_linen(variables, module)
    assert list(t) == [f"layers_{i}" for i in range(12)]  # JAX sorts layers_10 first
    assert t["layers_11"].kernel.shape == (5, 2)
    assert t.layers_2.kernel is variables["params"]["layers_2"]["kernel"]


def test_sequential_names_skip_the_activations():
    module, variables = CASES["sequential"][0]()
    t = bridge.from_linen(variables, module)
    assert list(t) == ["layers_0", "layers_2", "layers_4"]
    native = bridge.to_native(t)  # nn.Sequential holds a list: not hashable
    assert type(native) is nn.Sequential and native.scope is not None


def test_frozen_dict_stays_frozen_dict():
    module, variables = models.linen_cnn()
    frozen = FrozenDict(variables)
    back = bridge.to_linen(bridge.from_linen(frozen, module))
    assert type(back) is FrozenDict and type(back["params"]) is FrozenDict
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(frozen)
    assert tree_equal_bits(back, frozen)
    assert key_orders(back) == key_orders(frozen)


def test_boxed_partitioning_metadata_survives():
    module, variables = CASES["boxed"][0]()
    t = bridge.from_linen(variables, module)
    box0 = variables["params"]["Dense_0"]["kernel"]
    assert t.Dense_0.kernel is box0.value  # the Tree holds the array, not the box
    back = bridge.to_linen(t)
    k0, k1 = back["params"]["Dense_0"]["kernel"], back["params"]["Dense_1"]["kernel"]
    assert type(k0) is nn.Partitioned and k0.names == (None, "model")
    assert type(k1) is nn.LogicallyPartitioned and k1.names == ("embed", "mlp")
    assert k0.value is box0.value and k0 is not box0
    assert nn.get_partition_spec(back) == nn.get_partition_spec(variables)


@pytest.mark.parametrize("dtype", DTYPES + ("key",))
def test_every_dtype_round_trips_exactly(dtype):
    if dtype == "key":
        leaf = jax.random.split(jax.random.key(7), 3)
    else:
        leaf = array_of(dtype)
    variables = {"params": {"layer": {"w": leaf}}, "cache": {"layer2": {"c": leaf}}}
    t = bridge.from_linen(variables)
    back = bridge.to_linen(t)
    assert back["params"]["layer"]["w"] is leaf and back["cache"]["layer2"]["c"] is leaf
    assert tree_equal_bits(back, variables)
    assert bridge.roles(t).layer2.c == "cache"


def test_surgery_reinitialises_a_wider_head():
    module, variables = _init(Head(), models.mlp_input())
    kernel, bias = jnp.ones((models.D_HID, 7)), jnp.arange(7.0)
    t = bridge.from_linen(variables, module)
    new = eqx.tree_at(
        lambda s: (s.Dense_1.kernel, s.Dense_1.bias), t, replace=(kernel, bias)
    )
    back = bridge.to_linen(new)
    # the native way: replace the two arrays in the nested dict
    want = jax.tree_util.tree_map(lambda x: x, variables)
    want["params"]["Dense_1"] = {"kernel": kernel, "bias": bias}
    assert tree_equal_bits(back, want)
    assert (
        back["params"]["Dense_0"]["kernel"] is variables["params"]["Dense_0"]["kernel"]
    )
    assert t.Dense_1.kernel.shape == (models.D_HID, models.D_OUT)  # source Tree kept
    assert variables["params"]["Dense_1"]["kernel"].shape == (
        models.D_HID,
        models.D_OUT,
    )
    x = models.mlp_input()
    wide = Head(out=7)
    assert tree_equal_bits(wide.apply(back, x), wide.apply(want, x))


def test_a_bound_module_and_a_module_with_variables_convert():
    module, variables = models.linen_mlp()
    bound = module.bind(variables)
    for t in (bridge.to_neutral(bound), bridge.to_neutral((module, variables))):
        assert tree_equal_bits(bridge.to_linen(t), variables)
        assert tree_equal_bits(
            bridge.to_native(t)(models.mlp_input()), bound(models.mlp_input())
        )


def test_without_a_module_to_native_gives_the_variables():
    _, variables = models.linen_mlp()
    native = bridge.to_native(bridge.from_linen(variables))
    assert tree_equal_bits(native, variables)


def test_non_mapping_is_refused():
    with pytest.raises(TypeError, match="expects `variables`, the dict .* got list"):
        bridge.from_linen([np.ones(2)])
    with pytest.raises(TypeError, match="`module` must be a flax.linen Module, got"):
        bridge.from_linen({"params": {}}, module=3)


def test_name_colliding_across_collections_names_path_and_collections():
    variables = {
        "params": {"Dense_0": {"kernel": jnp.ones(2), "bias": jnp.ones(2)}},
        "batch_stats": {"Dense_0": {"kernel": jnp.ones(2)}},
        "cache": {"Dense_0": {"bias": {"x": jnp.ones(1)}}},
    }
    with pytest.raises(ValueError, match="collide") as info:
        bridge.from_linen(variables)
    message = str(info.value)
    assert ".Dense_0.kernel is in collections 'params' and 'batch_stats'" in message
    assert ".Dense_0.bias is a variable in collection 'params' and a module" in message
    assert "and a module in collection 'cache'" in message  # all, not the first


def test_variables_linen_does_not_make_are_refused():
    with pytest.raises(ValueError, match="collection 'params' is an array"):
        bridge.from_linen({"params": jnp.ones(2)})
    layer = eqx.nn.Linear(2, 2, key=jax.random.key(0))  # a pytree, not a mapping
    with pytest.raises(TypeError, match="hold 2 JAX leaves, and 1 values"):
        bridge.from_linen({"params": {"layer": layer}})


def test_a_second_conversion_of_the_same_structure_takes_its_own_leaves_and_order():
    # the second call of a structure reuses the first one's Tree structure: it must
    # still read the new leaves, the new dict order and the new module
    a = {"params": {"b": {"w": jnp.ones(2)}, "a": {"w": jnp.zeros(2)}}}
    first = bridge.from_linen(a)
    again = {"params": {"b": {"w": jnp.full(2, 3.0)}, "a": {"w": jnp.zeros(2)}}}
    second = bridge.from_linen(again)
    assert (
        second.b.w is again["params"]["b"]["w"] and first.b.w is a["params"]["b"]["w"]
    )
    swapped = {"params": {"a": {"w": jnp.zeros(2)}, "b": {"w": jnp.ones(2)}}}
    assert list(bridge.from_linen(swapped)) == ["a", "b"] == list(second)
    assert native_order(second)[()] == ("b", "a") and not native_order(
        bridge.from_linen(swapped)
    )
    assert list(bridge.to_linen(second)["params"]) == ["b", "a"]
    assert list(bridge.to_linen(bridge.from_linen(swapped))["params"]) == ["a", "b"]
    model = nn.Dense(2)
    with_module = bridge.from_linen(a, model)
    assert linen_module(with_module) is model and linen_module(first) is None
    assert jax.tree_util.tree_structure(second) == jax.tree_util.tree_structure(first)
