"""Public model shapes ported in every applicable direction, into concrete, abstract
(eval_shape) and trained targets, and from trained sources: outputs must agree
(`compare` and `port(check=...)`), not merely "no error"."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import bridge

from . import public_models as pm
from .helpers import skip_unless


def _eqx_step(model, *batch):
    """One SGD step on an Equinox model (every inexact array moves)."""

    def loss(m):
        out = jax.vmap(m)(*batch)
        return jnp.mean(out**2)

    grads = eqx.filter_grad(loss)(model)
    return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))


def _linen_step(module, variables, *batch):
    """One Adam step: the params dicts come back with sorted keys."""
    params = variables["params"]
    tx = optax.adam(0.05)
    grads = jax.grad(lambda p: jnp.mean(module.apply({"params": p}, *batch) ** 2))(
        params
    )
    updates, _ = tx.update(grads, tx.init(params), params)
    return module, {"params": optax.apply_updates(params, updates)}


def _nnx_step(model, *batch):
    """One native NNX training step under nnx.jit (attributes come back sorted)."""
    optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, *batch):
        grads = nnx.grad(lambda m: jnp.mean(m(*batch) ** 2))(model)
        optimizer.update(model, grads)

    step(model, optimizer, *batch)
    return model


# --- ViT: cls and pos_embedding next to the encoder blocks ----------------------------


def _vit(framework, variant, seed):
    x = pm.image()
    if framework == "linen":
        model = pm.linen_vit(seed)
        if variant == "abstract":
            module = pm.LinenViT()
            return module, jax.eval_shape(module.init, jax.random.key(seed), x)
        return _linen_step(*model, x) if variant == "trained" else model
    if variant == "abstract":
        return eqx.filter_eval_shape(pm.EqxViT, jax.random.key(seed))
    model = pm.EqxViT(jax.random.key(seed))
    return _eqx_step(model, x) if variant == "trained" else model


@pytest.mark.parametrize(
    "source_fw, target_fw",
    [("linen", "equinox"), pytest.param("equinox", "linen", marks=pytest.mark.slow)],
)
# A trained Linen source (sorted params after an optax step) into Equinox is slow (an
# eager Adam step and a ViT init, minutes on 2 shared cores): the abstract target runs
# the same plan, port and compare by default, and test_port_order's
# test_twelve_same_shape_linen_dense_after_an_optax_step ports a trained Linen source.
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("trained", marks=pytest.mark.slow),
        pytest.param("concrete", marks=pytest.mark.slow),
        "abstract",
    ],
)
def test_vit_with_loose_parameters(source_fw, target_fw, variant):
    x = pm.image()
    source = _vit(source_fw, "trained" if variant == "trained" else "concrete", 0)
    target = _vit(target_fw, variant, 1)
    plan = bridge.port_plan(source, target)
    assert not plan.problems, plan
    rows = {s.source: (s.target, s.kind) for s in plan.steps}
    assert rows[".cls"] == (".cls", "Array")
    assert rows[".pos_embedding"] == (".pos_embedding", "Array")
    ported = bridge.port(source, target, check=x)
    assert bridge.compare(source, ported, x) < 1e-5


def _vit_like(framework, abstract, seed, scan=False):
    if framework == "linen":
        module = pm.LinenViT(scan=scan)
        if abstract:
            return module, jax.eval_shape(module.init, jax.random.key(seed), pm.image())
        return pm.linen_vit(seed, scan)
    if framework == "nnx":
        skip_unless("NNX")
        if abstract:
            return nnx.eval_shape(lambda: pm.NNXViT(nnx.Rngs(seed)))
        return pm.NNXViT(nnx.Rngs(seed))
    return _vit("equinox", "abstract" if abstract else "concrete", seed)


def _vit_cases():
    """By default: the stacked ViT into an abstract Equinox ViT, the looped one into
    an abstract NNX ViT (the stack into per-layer NNX layers is test_port_stacked's
    test_a_bias_free_stack_at_either_axis_into_per_layer_nnx_and_back; the looped ViT
    into Equinox pairs the per-layer Linen names the scan case's way back does); the
    other cases run in `tests_slow` (20-50 s each on 2 shared cores)."""
    for layout in ("scan", "loop"):
        for target in ("nnx", "equinox"):
            for abstract in (False, True):
                fast = abstract and (layout, target) in (
                    ("loop", "nnx"),
                    ("scan", "equinox"),
                )
                slow = not fast
                yield pytest.param(
                    layout,
                    target,
                    abstract,
                    id=f"{layout}-{target}-{'eval_shape' if abstract else 'concrete'}",
                    marks=pytest.mark.slow if slow else (),
                )


@pytest.mark.parametrize("layout, target_fw, abstract", list(_vit_cases()))
def test_vit_stacked_or_looped_into_per_layer_and_back(layout, target_fw, abstract):
    """big_vision's ViT, `nn.scan`-stacked or looped, into per-layer NNX and Equinox
    ViTs and back into the Linen layout it came from; targets concrete or abstract."""
    x = pm.image()
    scan = layout == "scan"
    source = pm.linen_vit(0, scan)
    target = _vit_like(target_fw, abstract, 1)
    plan = bridge.port_plan(source, target)
    assert not plan.problems, plan
    rows = {s.source: s for s in plan.steps}
    assert rows[".cls"].target == ".cls" and rows[".pos_embedding"].kind == "Array"
    block = ".encoderblock[1]" if scan else ".encoderblock_1"
    assert rows[f"{block}.LayerNorm_1"].target.startswith(".blocks[1].")
    ported = bridge.port(source, target, check=x)
    assert bridge.compare(source, ported, x) < 1e-5
    back = bridge.port(ported, _vit_like("linen", abstract, 2, scan), check=x)
    assert bridge.compare(source, back, x) < 1e-5
    if scan:
        kernel = back[1]["params"]["encoderblock"]["MlpBlock_0"]["Dense_0"]["kernel"]
        assert kernel.shape == (2, 2 * pm.D, pm.D)  # Dense_0: the outer Dense (FACTS)


# --- Gemma-style: tied embeddings, many RMSNorms of one shape ------------------------


def _gemma(framework, variant, seed):
    ids = pm.tokens()
    if framework == "nnx":
        if variant == "abstract":
            return nnx.eval_shape(lambda: pm.NNXGemma(nnx.Rngs(seed)))
        model = pm.NNXGemma(nnx.Rngs(seed))
        return _nnx_step(model, ids) if variant == "trained" else model
    if variant == "abstract":
        return eqx.filter_eval_shape(pm.EqxGemma, jax.random.key(seed))
    model = pm.EqxGemma(jax.random.key(seed))
    return _eqx_step(model, ids) if variant == "trained" else model


@pytest.mark.parametrize(
    "source_fw, target_fw",
    [("nnx", "equinox"), pytest.param("equinox", "nnx", marks=pytest.mark.slow)],
)
# trained: slow (an NNX Adam step); the abstract target runs the same pairing by
# default, and test_gemma_nnx_after_training_into_its_own_eval_shape a trained source.
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("trained", marks=pytest.mark.slow),
        pytest.param("concrete", marks=pytest.mark.slow),
        "abstract",
    ],
)
def test_gemma_style_norms_pair_by_name(source_fw, target_fw, variant):
    ids = pm.tokens()
    source = _gemma(source_fw, "trained" if variant == "trained" else "concrete", 0)
    target = _gemma(target_fw, variant, 1)
    plan = bridge.port_plan(source, target)
    assert not plan.problems, plan
    norms = [s for s in plan.steps if s.kind == "RMSNorm"]
    assert len(norms) == 2 * 6 + 1
    assert all(s.source == s.target for s in plan.steps)
    ported = bridge.port(source, target, check=ids)
    assert bridge.compare(source, ported, ids) < 1e-5


def test_gemma_nnx_after_training_into_its_own_eval_shape():
    ids = pm.tokens()
    source = _nnx_step(pm.NNXGemma(nnx.Rngs(0)), ids)
    target = nnx.eval_shape(lambda: pm.NNXGemma(nnx.Rngs(1)))
    ported = bridge.port(source, target, check=ids)
    assert bridge.compare(source, ported, ids) == 0
