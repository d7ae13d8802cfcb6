"""Bridge adapters to and from the Flax ecosystem's own LoRA forms: Flax's
`nnx.LoRALinear` (`bridge.to_nnx_lora`; `from_nnx_lora` is in `tests/test_lora.py`)
and qwix's `<param>_lora_a`/`_lora_b` (`bridge.from_qwix_lora`), each against the
form's own forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .lora_models import LENGTH, OUT, WIDTH, models, nonzero, run


KEY = jax.random.key(11)
IDS = jnp.array([[1, 2, 3, 4, 5], [9, 0, 8, 7, 1]])
assert IDS.shape[1] == LENGTH


# --- back to nnx.LoRALinear --------------------------------------------------------


@pytest.mark.parametrize("rslora", [False, True])
def test_to_nnx_lora_gives_flax_lora_linear_layers(rslora):
    """Adapted Linear layers become nnx.LoRALinear (scaling folded into lora_b): its
    own forward equals bridge's within 1e-6 and x W + b + s (x A) B; LoRAParam
    selects exactly the adapters; from_nnx_lora reads them back."""
    model = models()["nnx"]
    tree = nonzero(
        bridge.to_neutral(
            bridge.lora(
                model, ["q", "head"], rank=2, alpha=6, key=KEY, use_rslora=rslora
            )
        )
    )
    adapted = bridge.to_native(tree)
    flax_model = bridge.to_nnx_lora(adapted)
    assert type(flax_model.q) is nnx.LoRALinear
    assert type(flax_model.head) is nnx.LoRALinear
    assert type(flax_model.emb) is nnx.Embed
    assert type(adapted.q).__name__ == "LoRALinear" and hasattr(adapted.q, "lora_a")
    assert type(adapted.q) is not nnx.LoRALinear  # the model given: unchanged
    want = adapted(IDS)
    np.testing.assert_allclose(flax_model(IDS), want, atol=1e-6, rtol=0)
    scaling = 6 / (np.sqrt(2) if rslora else 2)
    h = np.asarray(model.emb(IDS))
    a, b = np.asarray(tree.q.lora_a), np.asarray(tree.q.lora_b)
    q = h @ np.asarray(tree.q.kernel) + np.asarray(tree.q.bias) + scaling * (h @ a) @ b
    np.testing.assert_allclose(flax_model.q(jnp.asarray(h)), q, atol=1e-5, rtol=0)
    lora_state = jax.tree_util.tree_leaves(nnx.state(flax_model, nnx.LoRAParam))
    assert sorted(x.shape for x in lora_state) == sorted(
        [(WIDTH, 2), (2, WIDTH), (WIDTH, 2), (2, OUT)]
    )
    back = bridge.from_nnx_lora(flax_model)
    np.testing.assert_allclose(back(IDS), want, atol=1e-6, rtol=0)
    # a Tree gives a Tree
    assert isinstance(bridge.to_nnx_lora(tree), bridge.Tree)


def test_to_nnx_lora_refuses_what_flax_lora_cannot_hold():
    adapted = bridge.lora(models()["nnx"], ["emb", "conv"], rank=2, key=KEY)
    adapted = bridge.lora(adapted, ["q"], rank=2, key=KEY, dropout=0.1)
    with pytest.raises(ValueError) as info:
        bridge.to_nnx_lora(adapted)
    message = str(info.value)
    assert "3 problem(s), nothing was changed" in message
    assert "emb (Embed): nnx.LoRALinear is an nnx.Linear" in message
    assert "conv (Conv): nnx.LoRALinear is an nnx.Linear" in message
    assert "q: the adapter has dropout 0.1; nnx.LoRA has none" in message
    assert type(adapted.q).__name__ == "LoRALinear" and hasattr(adapted.q, "lora_a")
    half = bridge.lora(models()["nnx"], ["head"], rank=2, key=KEY, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"head: the adapters are bfloat16"):
        bridge.to_nnx_lora(half)
    with pytest.raises(ValueError, match="holds no LoRA adapter"):
        bridge.to_nnx_lora(models()["nnx"])
    with pytest.raises(TypeError, match="writes Flax NNX models"):
        bridge.to_nnx_lora(models()["equinox"])


def test_to_nnx_lora_model_trains_with_flax_own_filters():
    """The Flax way of training LoRA works on the result: nnx.Optimizer with
    wrt=nnx.LoRAParam moves the adapters alone."""
    optax = pytest.importorskip("optax")
    adapted = bridge.lora(models()["nnx"], ["q", "head"], rank=2, key=KEY)
    flax_model = bridge.to_nnx_lora(adapted)
    kernel = np.asarray(flax_model.q.kernel[...])
    opt = nnx.Optimizer(flax_model, optax.sgd(0.1), wrt=nnx.LoRAParam)
    y = jnp.ones((2, LENGTH, OUT))

    def loss(m):
        return jnp.mean((m(IDS) - y) ** 2)

    grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(flax_model)
    opt.update(flax_model, grads)
    assert np.array_equal(flax_model.q.kernel[...], kernel)
    assert np.any(flax_model.q.lora.lora_b[...] != 0)
    # and it is read back as bridge adapters with what it learnt
    assert np.array_equal(
        bridge.from_nnx_lora(flax_model).q.lora_b[...], flax_model.q.lora.lora_b[...]
    )
    assert run(flax_model, IDS).shape == (2, LENGTH, OUT)
