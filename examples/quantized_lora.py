"""LoRA on a quantized base (QLoRA's recipe): an FP8 block-scaled checkpoint loaded with
`keep_quantized=True`, so its weights stay FP8 in the model (`bridge.QuantizedArray`),
LoRA adapters put on its projections and trained with `bridge.make_step`, which
dequantizes the frozen base inside its compiled step. The same training on the
dequantized model gives the same losses; the base comes back untouched, still FP8.
No torch.

The model is `examples/quantized.py`'s: a Llama-style SwiGLU MLP stack named as
transformers names it (`model.layers.0.mlp.gate_proj`), so a hub folder of a Llama
(Qwen3-FP8, ...) loads the same way.
"""

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from quantized import (  # the model of examples/quantized.py
    D,
    forward as forward_with,
    nnx_model,
)

import bridge


def model(rngs):
    return nnx_model(jnp.float32, rngs)


def forward(model, x):
    return forward_with(model, x, lambda layer, y: layer(y))


def loss_fn(model, x, y):
    return jnp.mean((forward(model, x) - y) ** 2)


def train(model, x, y, steps=5):
    """LoRA (rank 4) on every projection, `steps` Adam steps: the losses and the
    Tree."""
    adapted = bridge.lora(model, "proj", rank=4, key=jax.random.key(1))
    tree = bridge.to_neutral(adapted)
    spec = bridge.trainable(tree, "lora")  # quantized weights are never trainable
    step = bridge.make_step(loss_fn, optax.adam(1e-2), spec)
    opt_state = step.init(tree)
    losses = []
    for _ in range(steps):
        tree, opt_state, loss = step(tree, opt_state, x, y)
        losses.append(float(loss))
    return losses, tree


def main():
    folder = Path(tempfile.mkdtemp())
    bridge.save_quantized(folder / "model.safetensors", model(nnx.Rngs(0)), "fp8-block")
    target = nnx.eval_shape(lambda: model(nnx.Rngs(0)))
    kept = bridge.load(folder, like=target, keep_quantized=True)
    dense = bridge.load(folder, like=target)
    weight = kept.model.layers[0].mlp.up_proj.kernel[...]
    print("kept:", weight)
    whole = lambda x: isinstance(x, bridge.QuantizedArray)  # noqa: E731
    held = sum(
        x.nbytes for x in jax.tree.leaves(bridge.to_neutral(kept), is_leaf=whole)
    )
    full = sum(x.nbytes for x in jax.tree.leaves(bridge.to_neutral(dense)))
    print(f"the model holds {held:,} bytes kept quantized, {full:,} dequantized")

    x = jax.random.normal(jax.random.key(2), (16, D))
    y = jax.random.normal(jax.random.key(3), (16, D))
    losses, tree = train(kept, x, y)
    dense_losses, _ = train(dense, x, y)
    print("losses on the FP8 base:       ", " ".join(f"{v:.5f}" for v in losses))
    print("losses on the dequantized base:", " ".join(f"{v:.5f}" for v in dense_losses))
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, dense_losses, rtol=1e-5)
    after = tree.model.layers[0].mlp.up_proj.kernel
    assert isinstance(after, bridge.QuantizedArray)
    assert bool((after.parts["weight"] == weight.parts["weight"]).all())
    print("the base is still FP8 and unchanged:", after)


if __name__ == "__main__":
    main()
