"""qwix's LoRA form (`<param>_lora_a`/`_lora_b`, alpha and rank in the provider's
rules) read as bridge adapters by `bridge.from_qwix_lora`, against qwix's own forward
pass on real qwix-adapted NNX and Linen models. Skipped without qwix (`nox -s
tests_torch` installs it)."""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

import bridge


qwix = pytest.importorskip("qwix")
# qwix 0.1.8 calls what flax 0.12 deprecates (Module.iter_modules, Variable.value,
# nnx.VariableState), from inside apply_lora_to_model and its interception
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

X = jax.random.normal(jax.random.key(0), (2, 7, 4))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.q = nnx.Linear(4, 6, rngs=rngs)
        self.heads = nnx.LinearGeneral(6, (2, 3), rngs=rngs)
        self.out = nnx.LinearGeneral((2, 3), 6, axis=(-2, -1), rngs=rngs)
        self.conv = nnx.Conv(6, 5, (3,), rngs=rngs)

    def __call__(self, x):
        return self.conv(self.out(self.heads(jax.nn.relu(self.q(x)))))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jax.nn.relu(nn.Dense(6, name="q")(x))
        return nn.Conv(5, (3,), name="conv")(x)


def _provider(dropout=0.0):
    """(qwix drops out whenever a rule has dropout, with no inference mode: its
    forward pass is compared without.)"""
    return qwix.LoraProvider(
        [
            qwix.LoraRule(module_path="q|heads", rank=2, alpha=3.0),
            qwix.LoraRule(module_path=".*", rank=3, alpha=5.0, dropout=dropout),
        ]
    )


def _trained(model):
    """qwix's adapters as after training (lora_b starts at zero)."""
    state = nnx.state(model, nnx.LoRAParam)
    moved = jax.tree.map(
        lambda a: a + 0.3 * jax.random.normal(jax.random.key(a.size), a.shape), state
    )
    nnx.update(model, moved)
    return model


def _nnx(dropout=0.0):
    provider = _provider(dropout)
    plain = Model(nnx.Rngs(0))
    model = qwix.apply_lora_to_model(plain, provider, X, rngs=nnx.Rngs(1))
    return plain, _trained(model), provider


def test_nnx_model_adapted_by_qwix_computes_the_same_without_qwix(tmp_path):
    plain, model, provider = _nnx()
    want = model(X)
    assert np.abs(plain(X) - want).max() > 1e-2  # the adapters count
    read = bridge.from_qwix_lora(model, rules=provider)
    assert type(read) is Model  # qwix's interception gone
    assert not any(
        name.startswith("qwix") or name.endswith(("_lora_a", "_lora_b"))
        for _, m in nnx.iter_modules(read)
        for name in vars(m)
    )
    # Flax's orientation, per-head kernels flattened as qwix does
    assert read.heads.lora_a.shape == (6, 2) and read.heads.lora_b.shape == (2, 6)
    assert read.out.lora_a.shape == (6, 3) and read.out.lora_b.shape == (3, 6)
    assert read.conv.lora_a.shape == (3, 6, 3) and read.conv.lora_b.shape == (3, 5)
    assert read.q.lora_settings == (2, 3.0, False, 0.0)
    assert read.conv.lora_settings == (3, 5.0, False, 0.0)
    np.testing.assert_allclose(read(X), want, atol=1e-6, rtol=0)
    assert hasattr(model.q, "kernel_lora_a")  # the model given: unchanged
    assert read.q.lora_a[...] is model.q.kernel_lora_a[...]
    # exportable to PEFT: q's adapter is qwix's, transposed; alphas from the rules
    bridge.save_peft(tmp_path / "adapter", read)
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    alphas = {n: config["alpha_pattern"].get(n, config["lora_alpha"]) for n in
              ("q", "heads", "out", "conv")}  # fmt: skip
    assert alphas == {"q": 3.0, "heads": 3.0, "out": 5.0, "conv": 5.0}
    tensors = bridge.load(tmp_path / "adapter/adapter_model.safetensors")
    np.testing.assert_array_equal(
        tensors.base_model.model.q.lora_A.weight, np.asarray(model.q.kernel_lora_a).T
    )
    # and merged, the plain model computes the same
    np.testing.assert_allclose(bridge.merge_lora(read)(X), want, atol=1e-5, rtol=0)


def test_the_rules_dropout_is_the_adapters_dropout():
    _, model, provider = _nnx(dropout=0.1)
    read = bridge.from_qwix_lora(model, rules=provider)
    assert read.q.lora_settings.dropout == 0.0
    assert read.conv.lora_settings == (3, 5.0, False, 0.1)
    read.train()  # bridge's dropout runs in training mode only, as PEFT's
    assert not np.allclose(read(X), read(X))
    read.eval()
    np.testing.assert_array_equal(read(X), read(X))


def test_linen_model_adapted_by_qwix_computes_the_same_without_qwix(tmp_path):
    provider = _provider()
    module = qwix.apply_lora_to_model(LinenModel(), provider)
    variables = module.init(jax.random.key(0), X)
    variables = {
        "params": jax.tree_util.tree_map_with_path(
            lambda p, a: (
                a + 0.3 * jax.random.normal(jax.random.key(a.size), a.shape)
                if "lora" in jax.tree_util.keystr(p)
                else a
            ),
            variables["params"],
        )
    }
    want = module.apply(variables, X)
    assert np.abs(LinenModel().apply(_plain(variables), X) - want).max() > 1e-2
    read_module, read = bridge.from_qwix_lora((module, variables), rules=provider)
    assert "kernel_lora_a" not in read["params"]["q"]
    assert read["params"]["q"]["lora_a"].shape == (4, 2)
    assert not hasattr(type(read_module), "_unquantized_type")
    assert issubclass(type(read_module), LinenModel)
    got = read_module.apply(read, X)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    # one alpha for every layer instead of the rules
    uniform = bridge.from_qwix_lora((module, variables), alpha=3.0)
    bridge.save_peft(tmp_path / "adapter", uniform)
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert (config["lora_alpha"], config["alpha_pattern"]) == (3.0, {})
    ranks = {n: config["rank_pattern"].get(n, config["r"]) for n in ("q", "conv")}
    assert ranks == {"q": 2, "conv": 3}


def _plain(variables):
    return {
        "params": {
            layer: {k: v for k, v in p.items() if "lora" not in k}
            for layer, p in variables["params"].items()
        }
    }


def test_from_qwix_lora_refuses_by_name():
    plain, model, provider = _nnx()
    wrong = qwix.LoraProvider(module_path=".*", rank=2, alpha=1.0)
    with pytest.raises(ValueError) as info:
        bridge.from_qwix_lora(model, rules=wrong)
    message = str(info.value)
    assert "2 problem(s), nothing was changed" in message
    assert "out (kernel_lora_a): the rule matching it" in message
    assert "has rank 2, the adapter 3" in message
    only_q = [qwix.LoraRule(module_path="q|heads", rank=2, alpha=3.0)]
    with pytest.raises(ValueError, match=r"conv \(kernel_lora_a\): no LoRA rule"):
        bridge.from_qwix_lora(model, rules=only_q)
    with pytest.raises(TypeError, match="pass rules= .* or alpha="):
        bridge.from_qwix_lora(model)
    with pytest.raises(TypeError, match="not both"):
        bridge.from_qwix_lora(model, rules=provider, alpha=2.0)
    with pytest.raises(ValueError, match="holds no qwix LoRA parameter"):
        bridge.from_qwix_lora(plain, alpha=1.0)
    with pytest.raises(TypeError, match="`rules` must be"):
        bridge.from_qwix_lora(model, rules=5)
