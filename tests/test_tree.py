import equinox as eqx
import jax
import pytest
from flax import nnx

import bridge

from . import models
from .helpers import tree_equal_bits


def test_access_reads_like_the_model():
    t = bridge.from_nnx(models.nnx_mlp())
    assert t.layers[-1].kernel is t["layers"][2]["kernel"]
    assert t.layers[-1] is t.layers[2]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)]
    assert paths[0] == ".layers[0].bias"  # canonical (natural) key order


def test_tree_is_immutable():
    t = bridge.from_equinox(models.equinox_mlp())
    with pytest.raises(AttributeError, match="immutable"):
        t.layers = None
    with pytest.raises(AttributeError, match="A Tree is immutable"):
        del t.layers


def test_missing_child_names_the_children():
    t = bridge.from_nnx(models.nnx_cnn())
    with pytest.raises(AttributeError, match=r"children are \['bn', 'conv', 'head'\]"):
        t.nope


def test_seed_pattern_verbatim():
    t = bridge.from_nnx(models.nnx_mlp())
    spec = jax.tree_util.tree_map(lambda _: False, t)
    spec = eqx.tree_at(
        lambda s: (s.layers[-1].kernel, s.layers[-1].bias), spec, replace=(True, True)
    )
    diff, static = eqx.partition(t, spec)
    assert (
        diff.layers[0].kernel is None and diff.layers[-1].kernel is t.layers[-1].kernel
    )
    assert eqx.tree_equal(eqx.combine(diff, static), t)


def _trees():
    """One Tree per framework, each with its last layer's kernel and bias names."""
    module, variables = models.linen_mlp()
    return {
        "linen": (bridge.from_linen(variables, module), lambda s: s.Dense_2),
        "nnx": (bridge.from_nnx(models.nnx_mlp()), lambda s: s.layers[-1]),
        "equinox": (bridge.from_equinox(models.equinox_mlp()), lambda s: s.layers[-1]),
    }


LAST = {
    "linen": ("kernel", "bias"),
    "nnx": ("kernel", "bias"),
    "equinox": ("weight", "bias"),
}


@pytest.mark.parametrize("name", ["linen", "nnx", "equinox"])
def test_seed_pattern_verbatim_in_every_framework(name):
    t, last = _trees()[name]
    w, b = LAST[name]
    spec = jax.tree_util.tree_map(lambda _: False, t)
    spec = eqx.tree_at(
        lambda s: (getattr(last(s), w), getattr(last(s), b)), spec, replace=(True, True)
    )
    assert sum(jax.tree_util.tree_leaves(spec)) == 2
    diff, static = eqx.partition(t, spec)
    assert getattr(last(diff), w) is getattr(last(t), w)
    assert getattr(last(static), w) is None
    combined = eqx.combine(diff, static)
    assert jax.tree_util.tree_structure(combined) == jax.tree_util.tree_structure(t)
    assert all(
        x is y
        for x, y in zip(
            jax.tree_util.tree_leaves(combined), jax.tree_util.tree_leaves(t)
        )
    )
    # the combined Tree turns back into the model; a half or a spec does not
    native = bridge.to_native(combined)
    if name == "linen":  # a bound module's `.variables` sorts the names: use ours
        native = (native.clone(parent=None), bridge.to_linen(combined))
    assert tree_equal_bits(bridge.to_neutral(native), t)
    with pytest.raises(ValueError, match=r"missing \.[^\n]*\n"):
        bridge.to_native(diff)
    with pytest.raises(ValueError, match="is a bool, not an array"):
        bridge.to_native(spec)


@pytest.mark.parametrize("name", ["linen", "nnx", "equinox"])
def test_jit_takes_a_tree_and_does_not_retrace(name):
    traces = []

    @jax.jit
    def double(tree):
        traces.append(None)
        return jax.tree_util.tree_map(lambda x: 2 * x, tree)

    t, _ = _trees()[name]
    again, _ = _trees()[name]  # a second Tree of the same model
    out = double(t)
    assert isinstance(out, bridge.Tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(t)
    double(again)
    double(jax.tree_util.tree_map(lambda x: x + 1, t))
    assert len(traces) == 1
    doubled = jax.tree_util.tree_map(lambda x: 2 * x, t)
    assert tree_equal_bits(out, doubled)


def test_changed_structure_names_every_path():
    t = bridge.from_nnx(models.nnx_mlp())
    cut = eqx.tree_at(
        lambda s: (s.layers[0].kernel, s.layers[2].bias),
        t,
        replace=(None, None),
        is_leaf=lambda x: x is None,
    )
    with pytest.raises(ValueError, match="no longer fits the Flax NNX model") as info:
        bridge.to_nnx(cut)
    assert "missing .layers[0].kernel" in str(info.value)
    assert "missing .layers[2].bias" in str(info.value)


def test_leaves_may_change_shape_and_dtype_but_stay_arrays():
    t = bridge.from_equinox(models.equinox_mlp())
    half = jax.tree_util.tree_map(lambda x: x.astype("bfloat16"), t)
    model = bridge.to_equinox(half)
    assert model.layers[0].weight.dtype == "bfloat16"


def test_repr_folds_equal_layers_in_the_model_s_order_with_binary_sizes():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.q = nnx.Linear(4, 4, rngs=rngs)
            self.k = nnx.Linear(4, 4, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(10, 4, rngs=rngs)
            blocks = [Block(rngs) for _ in range(12)]
            self.layers = nnx.List([*blocks, nnx.Linear(4, 4, rngs=rngs)])
            self.head = nnx.Linear(4, 512, rngs=rngs)

    lines = repr(bridge.from_nnx(Model(nnx.Rngs(0)))).splitlines()
    assert lines == [  # a line per layer, as created, 12 blocks listed once
        "Tree (Model)  # params: 3,100 (12.1 KiB)",
        "  .embed (Embed)  embedding float32[10,4]  # 40",
        "  .layers (List)  # params: 500 (2.0 KiB)",
        "    [0..11]: 12 × (Block)  # each: params: 40 (160 B)",
        "      .q (Linear)  kernel float32[4,4], bias float32[4]  # 20",
        "      .k (Linear)  kernel float32[4,4], bias float32[4]  # 20",
        "    [12] (Linear)  kernel float32[4,4], bias float32[4]  # 20",
        "  .head (Linear)  kernel float32[4,512], bias float32[512]  # 2,560",
    ]


def test_roles_repr_and_errors():
    module, variables = models.linen_cnn()
    t = bridge.from_linen(variables, module)
    text = repr(t)
    assert "Tree (LinenCNN)" in text and "batch_stats: mean float32[4]" in text
    assert "Conv_0" in t and "nope" not in t and len(t) == 3
    with pytest.raises(TypeError, match="made by an adapter"):
        bridge.Tree()
    with pytest.raises(TypeError, match="`tree` must be a bridge.Tree, got dict"):
        bridge.roles({})
    with pytest.raises(KeyError, match="is not an index of this sequence of 3"):
        bridge.from_nnx(models.nnx_mlp()).layers[3]


def test_grad_through_the_native_model_matches_the_frameworks_own():
    x = models.mlp_input()

    # NNX: nnx.grad is the oracle
    module = models.nnx_mlp()
    t = bridge.from_nnx(module)
    grads = jax.jit(jax.grad(lambda s: bridge.to_nnx(s)(x).sum()))(t)
    want = nnx.grad(lambda m: m(x).sum())(module)
    assert tree_equal_bits(grads.layers[-1].kernel, want["layers"][2]["kernel"][...])

    # Linen: jax.grad of apply with respect to the params
    linen, variables = models.linen_mlp()
    t = bridge.from_linen(variables, linen)
    grads = jax.jit(jax.grad(lambda s: linen.apply(bridge.to_linen(s), x).sum()))(t)
    want = jax.grad(lambda v: linen.apply(v, x).sum())(variables)
    assert tree_equal_bits(grads.Dense_0.kernel, want["params"]["Dense_0"]["kernel"])

    # Equinox: eqx.filter_grad
    model = models.equinox_mlp()
    t = bridge.from_equinox(model)
    grads = jax.jit(jax.grad(lambda s: jax.vmap(bridge.to_equinox(s))(x).sum()))(t)
    want = eqx.filter_grad(lambda m: jax.vmap(m)(x).sum())(model)
    assert tree_equal_bits(grads.layers[0].weight, want.layers[0].weight)


def test_calling_a_tree_says_how_to_run_its_model():
    """`bridge.load(path)(x)`, a user's first guess: refused with the way to run it,
    while a Tree of bools still works as optax's and Equinox's mask (they ask
    `callable` of its leaves, not of the Tree)."""
    import jax.numpy as jnp
    import optax

    model = eqx.nn.Linear(2, 3, key=jax.random.key(0))
    tree = bridge.from_equinox(model)
    with pytest.raises(TypeError, match=r"cannot be called\.\n.*bridge\.to_native"):
        tree(jnp.ones(2))
    assert bridge.to_native(tree)(jnp.ones(2)).shape == (3,)  # the way it names
    spec = bridge.trainable(tree, r"\.weight$")
    grads = jax.tree.map(jnp.ones_like, tree)
    updates, _ = optax.masked(optax.sgd(1.0), spec).update(
        grads, optax.masked(optax.sgd(1.0), spec).init(tree)
    )
    assert float(updates.weight[0, 0]) == -1.0 and float(updates.bias[0]) == 1.0
    params, frozen = eqx.partition(tree, spec)
    assert params.bias is None and frozen.weight is None
    with pytest.raises(TypeError, match="where"):  # a Tree is no `where` either
        bridge.trainable(tree, spec)
