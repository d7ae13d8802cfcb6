from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import bridge

from . import models
from .helpers import fresh, requires, run_markdown, tree_equal_bits


STEPS = 3
TARGET = jnp.ones((4, models.D_OUT))


def by_path(tree):
    """`{keystr: leaf}`: compares trees whose leaf order may differ."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p): x for p, x in leaves}


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def eqx_mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def eqx_filter_spec(model, *layers):
    """The Equinox way: True for the weight and bias of `model.layers[i]`."""
    spec = jax.tree_util.tree_map(lambda _: False, model)

    def where(m):
        return [x for i in layers for x in (m.layers[i].weight, m.layers[i].bias)]

    return eqx.tree_at(where, spec, replace=[True] * 2 * len(layers))


def run(step, tree, *batch):
    tree = fresh(tree)
    opt_state = step.init(tree)
    for _ in range(STEPS):
        tree, opt_state, loss = step(tree, opt_state, *batch)
    return tree, loss


def assert_frozen_and_trained(before, after, oracle, trained_prefix):
    before, after, oracle = by_path(before), by_path(after), by_path(oracle)
    assert after.keys() == oracle.keys()
    for path, leaf in after.items():
        assert tree_equal_bits(leaf, oracle[path]), path
        changed = not tree_equal_bits(leaf, before[path])
        assert changed == path.startswith(trained_prefix), path


def test_equinox_parity_with_the_equinox_recipe():
    model, x = models.equinox_mlp(), models.mlp_input()
    tree = bridge.from_equinox(model)
    spec = bridge.trainable(tree, lambda t: t.layers[-1])
    optim = optax.adam(1e-2)
    after, _ = run(bridge.make_step(eqx_mse, optim, spec), tree, x, TARGET)

    # Equinox's own freezing recipe, on the native model
    filter_spec = eqx_filter_spec(model, 2)

    @eqx.filter_jit
    def native_step(model, opt_state, x, y):
        diff, static = eqx.partition(model, filter_spec)
        loss = lambda d: eqx_mse(eqx.combine(d, static), x, y)  # noqa: E731
        grads = eqx.filter_grad(loss)(diff)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    opt_state = optim.init(eqx.filter(model, filter_spec))
    for _ in range(STEPS):
        model, opt_state = native_step(model, opt_state, x, TARGET)
    oracle = bridge.from_equinox(model)
    assert_frozen_and_trained(tree, after, oracle, ".layers[2].")


def test_nnx_parity_with_nnx_optimizer_wrt():
    model, x = models.nnx_mlp(), models.mlp_input()
    tree = bridge.from_nnx(model)
    spec = bridge.trainable(tree, lambda t: t.layers[-1])
    after, _ = run(bridge.make_step(mse, optax.adam(1e-2), spec), tree, x, TARGET)

    head = nnx.All(nnx.Param, lambda path, _: path[:2] == ("layers", 2))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=head)

    @nnx.jit
    def native_step(model, optimizer, x, y):
        diff = nnx.DiffState(0, head)
        grads = nnx.grad(mse, argnums=diff)(model, x, y)
        optimizer.update(model, grads)

    for _ in range(STEPS):
        native_step(model, optimizer, x, TARGET)
    assert_frozen_and_trained(tree, after, bridge.from_nnx(model), ".layers[2].")


def test_linen_parity_with_multi_transform():
    module, variables = models.linen_mlp()
    x = models.mlp_input()
    tree = bridge.from_linen(variables, module)
    spec = bridge.trainable(tree, r"^\.Dense_2\.")
    after, _ = run(bridge.make_step(mse, optax.adam(1e-2), spec), tree, x, TARGET)

    params = variables["params"]
    labels = {k: "train" if k == "Dense_2" else "frozen" for k in params}
    optim = optax.multi_transform(
        {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels
    )

    @jax.jit
    def native_step(params, opt_state, x, y):
        loss = lambda p: mse(lambda x: module.apply({"params": p}, x), x, y)  # noqa: E731
        grads = jax.grad(loss)(params)
        updates, opt_state = optim.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = optim.init(params)
    for _ in range(STEPS):
        params, opt_state = native_step(params, opt_state, x, TARGET)
    oracle = bridge.from_linen({"params": params}, module)
    assert_frozen_and_trained(tree, after, oracle, ".Dense_2.")


def test_adamw_chain_and_schedule_match_the_equinox_recipe():
    model, x = models.equinox_mlp(), models.mlp_input()
    schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=STEPS)
    optim = optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.1)
    )
    tree = bridge.from_equinox(model)
    spec = bridge.trainable(tree, lambda t: (t.layers[1], t.layers[2]))
    after, _ = run(bridge.make_step(eqx_mse, optim, spec), tree, x, TARGET)

    filter_spec = eqx_filter_spec(model, 1, 2)

    @eqx.filter_jit
    def native_step(model, opt_state, x, y):
        diff, static = eqx.partition(model, filter_spec)
        grads = jax.grad(lambda d: eqx_mse(eqx.combine(d, static), x, y))(diff)
        updates, opt_state = optim.update(grads, opt_state, diff)
        return eqx.apply_updates(model, updates), opt_state

    opt_state = optim.init(eqx.filter(model, filter_spec))
    for _ in range(STEPS):
        model, opt_state = native_step(model, opt_state, x, TARGET)
    oracle = bridge.from_equinox(model)
    assert_frozen_and_trained(tree, after, oracle, (".layers[1].", ".layers[2]."))


@requires("NNX")
def test_frozen_gradients_are_not_computed():
    class Deep(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(6)])

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    tree = bridge.from_nnx(Deep(nnx.Rngs(0)))
    x = jnp.ones((16, 32))

    def flops(where):
        step = bridge.make_step(
            lambda m, x: jnp.mean(m(x) ** 2),
            optax.sgd(0.1),
            bridge.trainable(tree, where),
        )
        compiled = step.lower(tree, step.init(tree), x).compile()
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        return analysis["flops"]

    head, everything = flops(lambda t: t.layers[-1]), flops(lambda t: t)
    assert head < 0.5 * everything, (head, everything)


def test_one_trace_across_steps_and_optimizer_state_of_trainable_leaves_only():
    traces = []

    def loss_fn(model, x, y):
        traces.append(1)
        return mse(model, x, y)

    tree = bridge.from_nnx(models.nnx_mlp())
    spec = bridge.trainable(tree, lambda t: t.layers[-1])
    step = bridge.make_step(loss_fn, optax.adam(1e-2), spec)
    opt_state = step.init(tree)
    assert sorted(opt_state[0].mu) == [".layers[2].bias", ".layers[2].kernel"]
    before = tree
    for _ in range(STEPS):
        tree, opt_state, _ = step(tree, opt_state, models.mlp_input(), TARGET)
    assert len(traces) == 1
    assert tree.layers[0].kernel is before.layers[0].kernel  # not even copied
    assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(before)


def test_has_aux_returns_aux():
    tree = bridge.from_nnx(models.nnx_mlp())
    spec = bridge.trainable(tree, lambda t: t.layers[-1])

    def loss_fn(model, x):
        out = model(x)
        return jnp.mean(out**2), {"out": out}

    step = bridge.make_step(loss_fn, optax.sgd(0.1), spec, has_aux=True)
    x = models.mlp_input()
    _, _, loss, aux = step(tree, step.init(tree), x)
    assert tree_equal_bits(aux["out"], models.nnx_mlp()(x))
    assert jnp.allclose(loss, jnp.mean(aux["out"] ** 2))


# --- errors ---------------------------------------------------------------------------


def test_spec_of_another_model_names_the_paths():
    mlp = bridge.from_nnx(models.nnx_mlp())
    cnn = bridge.from_nnx(models.nnx_cnn())
    step = bridge.make_step(mse, optax.sgd(0.1), bridge.trainable(mlp, r"kernel"))
    with pytest.raises(ValueError, match=r"\.conv\.kernel is in the tree but not"):
        step.init(cnn)
    with pytest.raises(ValueError, match=r"\.layers\[0\]\.kernel is in the spec but"):
        step(cnn, {}, models.cnn_input())


def test_spec_must_hold_bools_and_mark_params():
    tree = bridge.from_nnx(models.nnx_cnn())
    with pytest.raises(TypeError, match=r"not bools:\n  \.bn\.bias: function"):
        bridge.make_step(
            mse, optax.sgd(0.1), jax.tree_util.tree_map(lambda _: eqx.is_array, tree)
        )
    spec = jax.tree_util.tree_map(lambda _: True, tree)
    step = bridge.make_step(mse, optax.sgd(0.1), spec)
    with pytest.raises(
        ValueError, match=r"\.bn\.mean is marked trainable but has role"
    ):
        step.init(tree)
    with pytest.raises(ValueError, match="marks no leaf trainable"):
        bridge.make_step(
            mse, optax.sgd(0.1), jax.tree_util.tree_map(lambda _: False, tree)
        )


def test_non_scalar_loss():
    tree = bridge.from_nnx(models.nnx_mlp())
    step = bridge.make_step(
        lambda m, x: m(x), optax.sgd(0.1), bridge.trainable(tree, r"kernel")
    )
    with pytest.raises(ValueError, match=r"array of shape \(4, 2\)"):
        step(tree, step.init(tree), models.mlp_input())


def test_has_aux_needs_a_pair():
    tree = bridge.from_nnx(models.nnx_mlp())
    spec = bridge.trainable(tree, r"kernel")
    step = bridge.make_step(mse, optax.sgd(0.1), spec, has_aux=True)
    with pytest.raises(TypeError, match=r"return a pair `\(loss, aux\)`"):
        step(tree, step.init(tree), models.mlp_input(), TARGET)


def test_opt_state_of_another_spec():
    tree = bridge.from_nnx(models.nnx_mlp())
    head = bridge.make_step(mse, optax.adam(0.1), bridge.trainable(tree, r"\[2\]"))
    every = bridge.make_step(mse, optax.adam(0.1), bridge.trainable(tree, r"."))
    match = r"no entry for \.layers\[0\]\.kernel"
    with pytest.raises(ValueError, match=match):
        every(tree, head.init(tree), models.mlp_input(), TARGET)
    match = r"entry for \.layers\[0\]\.bias, which this step does not train"
    with pytest.raises(ValueError, match=match):
        head(tree, every.init(tree), models.mlp_input(), TARGET)
    sgd = bridge.make_step(mse, optax.sgd(0.1), bridge.trainable(tree, r"\[2\]"))
    with pytest.raises(ValueError, match=r"structure, shapes or dtypes differ"):
        sgd(tree, head.init(tree), models.mlp_input(), TARGET)


def test_not_a_tree_or_optimizer():
    tree = bridge.from_nnx(models.nnx_mlp())
    spec = bridge.trainable(tree, r"kernel")
    with pytest.raises(TypeError, match="must be an optax.GradientTransformation"):
        bridge.make_step(mse, optax.adam, spec)
    with pytest.raises(TypeError, match="convert the model once"):
        bridge.make_step(mse, optax.sgd(0.1), spec).init(models.nnx_mlp())


def test_linen_without_module_gets_the_variables():
    module, variables = models.linen_mlp()
    tree = bridge.from_linen(variables)
    spec = bridge.trainable(tree, r"Dense_2")

    def loss_fn(variables, x, y):
        return mse(lambda x: module.apply(variables, x), x, y)

    with_module = bridge.from_linen(variables, module)
    step = bridge.make_step(loss_fn, optax.sgd(0.1), spec)
    native = bridge.make_step(mse, optax.sgd(0.1), spec)
    x = models.mlp_input()
    after, _, _ = step(fresh(tree), step.init(tree), x, TARGET)
    oracle, _, _ = native(with_module, native.init(with_module), x, TARGET)
    assert tree_equal_bits(by_path(after), by_path(oracle))
    assert isinstance(bridge.to_native(after), dict)


@pytest.mark.slow
def test_freezing_guide_runs():
    """Every code block of docs/guides/freezing.md, in order, as one script."""
    code = run_markdown(Path(__file__).parent.parent / "docs/guides/freezing.md")
    assert "bridge.make_step" in code


def test_a_returned_tree_reads_and_steps_like_any_other():
    """The step's output Tree holds its leaves as the step split them (no flatten
    next call); read, flattened or given to another step, it is a plain Tree."""
    tree = bridge.from_nnx(models.nnx_mlp())
    head = bridge.make_step(mse, optax.sgd(0.1), bridge.trainable(tree, r"\[2\]"))
    first = bridge.make_step(mse, optax.sgd(0.1), bridge.trainable(tree, r"\[0\]"))
    x = models.mlp_input()
    after, _, _ = head(fresh(tree), head.init(tree), x, TARGET)
    rebuilt = fresh(after)  # a copy, built the usual way
    again, _, _ = first(after, first.init(after), x, TARGET)
    oracle, _, _ = first(rebuilt, first.init(rebuilt), x, TARGET)
    assert tree_equal_bits(again, oracle)
    assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(tree)
    assert by_path(again).keys() == by_path(tree).keys()
    assert isinstance(bridge.to_nnx(again), nnx.Module)
