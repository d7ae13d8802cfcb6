"""Pairing when the order is lost (optax updates, nnx.jit, eval_shape): names decide,
creation order only where it is known, else an `ambiguous` error; `port_plan` lists
problems instead of raising; `port(check=...)` and `compare(**kwargs)`."""

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import bridge

from .helpers import requires


# every test ports an NNX model (or into one)
pytestmark = requires("NNX")


KEY = jax.random.key
D = 4


@jax.jit  # one program, not an eager op per parameter shape
def _optax_step(params):
    """One Adam step: JAX gives the dicts back with sorted keys."""
    tx = optax.adam(0.1)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


def _nnx_jit_call(model, x):
    """One call through `nnx.jit`: the module's attributes come back sorted."""
    nnx.jit(lambda m, x: m(x))(model, x)
    return model


class TwelveDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(12):
            x = jnp.tanh(nn.Dense(D)(x))
        return x


class TwelveLinear(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(D, D, rngs=rngs) for _ in range(12)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def test_twelve_same_shape_linen_dense_after_an_optax_step():
    """`Dense_10` sorts before `Dense_2`: the numbers give the creation order."""
    x = jax.random.normal(KEY(9), (2, D))
    module = TwelveDense()
    variables = module.init(KEY(0), x)
    variables = {"params": _optax_step(variables["params"])}
    assert list(variables["params"])[:3] == ["Dense_0", "Dense_1", "Dense_10"]
    source = (module, variables)
    for target in (
        TwelveLinear(nnx.Rngs(1)),
        nnx.eval_shape(lambda: TwelveLinear(nnx.Rngs(1))),
        _nnx_jit_call(TwelveLinear(nnx.Rngs(1)), x),
    ):
        plan = bridge.port_plan(source, target)
        assert [(s.source, s.target) for s in plan.steps] == [
            (f".Dense_{i}", f".layers[{i}]") for i in range(12)
        ]
        assert all(s.renamed and s.by == "order" for s in plan.steps)
        assert bridge.compare(source, bridge.port(source, target, check=(x,)), x) == 0
    # and back, into a Linen target whose dict is sorted too
    fresh = module.init(KEY(3), x)
    back = bridge.port(TwelveLinear(nnx.Rngs(1)), (module, fresh), check=x)
    assert bridge.compare(TwelveLinear(nnx.Rngs(1)), back, x) == 0


class Block(nnx.Module):
    """Gemma-style norms around a block: same shapes, told apart by name only."""

    def __init__(self, rngs):
        self.pre_norm = nnx.LayerNorm(D, rngs=rngs)
        self.query = nnx.Linear(D, D, rngs=rngs)
        self.key = nnx.Linear(D, D, rngs=rngs)
        self.value = nnx.Linear(D, D, rngs=rngs)
        self.post_norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x):
        h = self.pre_norm(x)
        q, k, v = self.query(h), self.key(h), self.value(h)
        weights = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2), axis=-1)
        return self.post_norm(x + weights @ v)


class EqxBlock(eqx.Module):
    pre_norm: eqx.nn.LayerNorm
    query: eqx.nn.Linear
    key: eqx.nn.Linear
    value: eqx.nn.Linear
    post_norm: eqx.nn.LayerNorm

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.pre_norm = eqx.nn.LayerNorm(D, eps=1e-6)
        self.query = eqx.nn.Linear(D, D, key=k[0])
        self.key = eqx.nn.Linear(D, D, key=k[1])
        self.value = eqx.nn.Linear(D, D, key=k[2])
        self.post_norm = eqx.nn.LayerNorm(D, eps=1e-6)

    def __call__(self, x):
        """`x`: one example `(T, D)`."""
        h = jax.vmap(self.pre_norm)(x)
        q, k, v = (
            jax.vmap(self.query)(h),
            jax.vmap(self.key)(h),
            jax.vmap(self.value)(h),
        )
        weights = jax.nn.softmax(q @ k.T, axis=-1)
        return jax.vmap(self.post_norm)(x + weights @ v)


def _randomised(model):
    """Every parameter moved away from its initial value (norm scales and biases away
    from 1 and 0, so a swap shows in the outputs), in place: the attribute order
    stays the creation order."""
    state = nnx.state(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(KEY(7), len(leaves))
    leaves = [x + jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
    return model


def test_nnx_block_into_an_eval_shape_target_pairs_by_name():
    x = jax.random.normal(KEY(5), (2, 3, D))
    source = _randomised(Block(nnx.Rngs(0)))
    target = nnx.eval_shape(lambda: Block(nnx.Rngs(1)))
    plan = bridge.port_plan(source, target)
    assert {(s.source, s.target) for s in plan.steps} == {
        (f".{n}", f".{n}") for n in ("pre_norm", "query", "key", "value", "post_norm")
    }
    assert not any(s.renamed for s in plan.steps) and not plan.problems
    ported = bridge.port(source, target, check=x)
    assert bridge.compare(source, ported, x) == 0


@pytest.mark.parametrize("trained", ["source", "target"])
def test_nnx_after_nnx_jit_into_equinox_and_back(trained):
    x = jax.random.normal(KEY(5), (2, 3, D))
    source = _randomised(Block(nnx.Rngs(0)))
    target = EqxBlock(KEY(1))
    if trained == "source":
        source = _nnx_jit_call(source, x)
        assert list(vars(source))[2:] == [
            "key",
            "post_norm",
            "pre_norm",
            "query",
            "value",
        ]
    ported = bridge.port(source, target, check=x)
    assert bridge.compare(source, ported, x) < 1e-5
    back_target = _nnx_jit_call(Block(nnx.Rngs(2)), x)
    back = bridge.port(ported, back_target, check=x)
    assert bridge.compare(source, back, x) < 1e-5


class RenamedBlock(eqx.Module):
    """The same block with other names: `q_proj`, `k_proj`, `v_proj`, `norm_a/b`."""

    norm_a: eqx.nn.LayerNorm
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    norm_b: eqx.nn.LayerNorm

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.norm_a = eqx.nn.LayerNorm(D, eps=1e-6)
        self.q_proj = eqx.nn.Linear(D, D, key=k[0])
        self.k_proj = eqx.nn.Linear(D, D, key=k[1])
        self.v_proj = eqx.nn.Linear(D, D, key=k[2])
        self.norm_b = eqx.nn.LayerNorm(D, eps=1e-6)

    def __call__(self, x):
        block = EqxBlock.__new__(EqxBlock)
        for a, b in zip(
            ("pre_norm", "query", "key", "value", "post_norm"),
            ("norm_a", "q_proj", "k_proj", "v_proj", "norm_b"),
        ):
            object.__setattr__(block, a, getattr(self, b))
        return block(x)


def test_names_differ_and_order_is_lost_is_ambiguous_with_a_rule_to_fix_it():
    x = jax.random.normal(KEY(5), (2, 3, D))
    concrete = _randomised(Block(nnx.Rngs(0)))
    target = RenamedBlock(KEY(1))
    # built by its class, the NNX block knows its order: pairs in order
    plan = bridge.port_plan(concrete, target)
    assert [s.by for s in plan.steps] == ["order"] * 5
    assert bridge.compare(concrete, bridge.port(concrete, target), x) < 1e-5
    # after nnx.jit its attributes are sorted: names differ, order unknown
    source = _nnx_jit_call(_randomised(Block(nnx.Rngs(0))), x)
    plan = bridge.port_plan(source, target)  # never raises
    assert len(plan.problems) == 2 and not plan.steps
    assert "problems (bridge.port raises):" in str(plan)
    with pytest.raises(
        bridge.PortError,
        match=r"(?s)ambiguous: source layers \['\.key', '\.query', '\.value'\] .*"
        r"target's order|source's order.*rules=",
    ):
        bridge.port(source, target)
    rules = {
        r"\.pre_norm": ".norm_a",
        r"\.post_norm": ".norm_b",
        r"\.(q|k|v)\w*": r".\1_proj",
    }
    ported = bridge.port(source, target, rules=rules, check=x)
    assert bridge.compare(source, ported, x) < 1e-5


def test_check_refuses_a_port_whose_outputs_differ():
    x = jax.random.normal(KEY(5), (2, 3, D))
    source = _randomised(Block(nnx.Rngs(0)))
    swapped = {r"\.pre_norm": ".post_norm", r"\.post_norm": ".pre_norm"}
    plan = bridge.port_plan(source, EqxBlock(KEY(1)), rules=swapped)
    assert [s.renamed for s in plan.steps if s.by == "rule"] == [True, True]
    assert "~: the names differ" in str(plan)
    with pytest.raises(bridge.PortError, match=r"check: the ported model's outputs"):
        bridge.port(source, EqxBlock(KEY(1)), rules=swapped, check=(x,))


class ResNetBlock(nn.Module):
    """Flax's ImageNet ResNet block: bias-less convs, `conv_proj` when shapes change."""

    filters: int

    @nn.compact
    def __call__(self, x, train=True):
        norm = functools.partial(
            nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5
        )
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = norm()(y)
        if x.shape != y.shape:
            x = nn.Conv(self.filters, (1, 1), use_bias=False, name="conv_proj")(x)
            x = norm(name="norm_proj")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Conv(4, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.BatchNorm(
            use_running_average=not train, momentum=0.9, epsilon=1e-5, name="bn_init"
        )(x)
        x = nn.relu(x)
        x = ResNetBlock(4)(x, train)
        x = ResNetBlock(8)(x, train)
        return nn.Dense(3)(jnp.mean(x, axis=(1, 2)))


class NNXResNetBlock(nnx.Module):
    def __init__(self, cin, filters, rngs):
        conv = lambda i, o, k: nnx.Conv(i, o, k, use_bias=False, rngs=rngs)  # noqa: E731
        norm = lambda: nnx.BatchNorm(filters, momentum=0.9, epsilon=1e-5, rngs=rngs)  # noqa: E731
        self.conv1, self.bn1 = conv(cin, filters, (3, 3)), norm()
        self.conv2, self.bn2 = conv(filters, filters, (3, 3)), norm()
        if cin != filters:
            self.conv_proj, self.norm_proj = conv(cin, filters, (1, 1)), norm()

    def __call__(self, x):
        y = self.bn2(self.conv2(nnx.relu(self.bn1(self.conv1(x)))))
        if hasattr(self, "conv_proj"):
            x = self.norm_proj(self.conv_proj(x))
        return nnx.relu(x + y)


class NNXResNet(nnx.Module):
    def __init__(self, rngs):
        self.conv_init = nnx.Conv(2, 4, (3, 3), use_bias=False, rngs=rngs)
        self.bn_init = nnx.BatchNorm(4, momentum=0.9, epsilon=1e-5, rngs=rngs)
        self.blocks = nnx.List([NNXResNetBlock(4, 4, rngs), NNXResNetBlock(4, 8, rngs)])
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn_init(self.conv_init(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


def _trained_resnet(seed):
    """A Linen ResNet after one training step (params through optax: sorted keys;
    batch statistics updated)."""
    x = jax.random.normal(KEY(seed), (2, 6, 6, 2))
    module = ResNet()
    variables = module.init(KEY(seed), x)
    _, updates = module.apply(variables, x, mutable=["batch_stats"])
    return module, {
        "params": _optax_step(variables["params"]),
        "batch_stats": updates["batch_stats"],
    }


# An abstract target by default; concrete and nnx.jit-called targets (their attributes
# sorted) in `tests_slow`, as test_nnx_after_nnx_jit_into_equinox_and_back runs them by
# default on a smaller model.
@pytest.mark.parametrize(
    "target_kind",
    [
        "eval_shape",
        pytest.param("concrete", marks=pytest.mark.slow),
        pytest.param("nnx_jit", marks=pytest.mark.slow),
    ],
)
def test_resnet_after_an_optax_step_linen_to_nnx_and_back(target_kind):
    x = jax.random.normal(KEY(1), (2, 6, 6, 2))
    source = _trained_resnet(0)
    call = ({"train": False}, {})
    targets = {
        "concrete": lambda: NNXResNet(nnx.Rngs(1)),
        "eval_shape": lambda: nnx.eval_shape(lambda: NNXResNet(nnx.Rngs(1))),
        "nnx_jit": lambda: _nnx_jit_call(NNXResNet(nnx.Rngs(1)), x),
    }
    target = targets[target_kind]()
    plan = bridge.port_plan(source, target)
    assert not plan.problems, plan
    rows = {s.source: s.target for s in plan.steps}
    assert rows[".conv_init"] == ".conv_init"
    assert rows[".ResNetBlock_1.conv_proj"] == ".blocks[1].conv_proj"
    ported = bridge.port(source, target, check=x, check_kwargs=call)
    assert bridge.compare(source, ported, x, per_side=call) < 1e-5
    # back into a Linen ResNet that went through its own optax step
    back = bridge.port(ported, _trained_resnet(5), check=x, check_kwargs=call[::-1])
    assert bridge.compare(source, back, x, train=False) < 1e-6


def test_compare_passes_keyword_arguments():
    x = jax.random.normal(KEY(1), (2, 6, 6, 2))
    module, variables = _trained_resnet(0)
    native = module.apply(variables, x, train=False)
    assert bridge.compare((module, variables), (module, variables), x, train=False) == 0
    ported = bridge.port((module, variables), NNXResNet(nnx.Rngs(1)))
    diff = bridge.compare(
        (module, variables), ported, x, per_side=({"train": False}, {})
    )
    ported.eval()
    assert diff == float(jnp.max(jnp.abs(native - ported(x)))) < 1e-5
    with pytest.raises(TypeError, match="train"):
        bridge.compare((module, variables), ported, x, train=False)
