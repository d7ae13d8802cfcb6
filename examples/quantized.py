"""FP8 out and back in: a model written as a block-scaled FP8 checkpoint (DeepSeek-V3's
form: `float8_e4m3fn` weights, `weight_scale_inv` per 128x128 block, the
`quantization_config` in `config.json`), then loaded into a bfloat16 NNX model and a
float32 Equinox model, each weight dequantized as its layer is filled. No torch.

The model is a Llama-style SwiGLU MLP stack named as transformers names it
(`model.layers.0.mlp.gate_proj`), so a hub folder of a Llama (Qwen3-FP8, ...) loads
the same way.
"""

import json
import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

import bridge


D, HIDDEN, LAYERS = 256, 512, 2


class Node(nnx.Module):
    def __init__(self, **children):
        for name, child in children.items():
            setattr(self, name, child)


def nnx_model(dtype, rngs):
    linear = lambda i, o: nnx.Linear(  # noqa: E731
        i, o, use_bias=False, param_dtype=dtype, dtype=dtype, rngs=rngs
    )
    mlp = lambda: Node(  # noqa: E731
        gate_proj=linear(D, HIDDEN),
        up_proj=linear(D, HIDDEN),
        down_proj=linear(HIDDEN, D),
    )
    return Node(model=Node(layers=nnx.List([Node(mlp=mlp()) for _ in range(LAYERS)])))


class EqxMLP(eqx.Module):
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear


class EqxLayer(eqx.Module):
    mlp: EqxMLP


class EqxLayers(eqx.Module):
    layers: list


class EqxModel(eqx.Module):
    model: EqxLayers


def eqx_model():
    keys = iter(jax.random.split(jax.random.key(0), 3 * LAYERS))
    linear = lambda i, o: eqx.nn.Linear(i, o, use_bias=False, key=next(keys))  # noqa: E731
    layers = [
        EqxLayer(EqxMLP(linear(D, HIDDEN), linear(D, HIDDEN), linear(HIDDEN, D)))
        for _ in range(LAYERS)
    ]
    return EqxModel(EqxLayers(layers))


def forward(model, x, call):
    for layer in model.model.layers:
        m = layer.mlp
        x = x + call(
            m.down_proj, jax.nn.silu(call(m.gate_proj, x)) * call(m.up_proj, x)
        )
    return x


def main() -> None:
    original = nnx_model(jnp.float32, nnx.Rngs(0))
    folder = Path(tempfile.mkdtemp())
    bridge.save_quantized(folder / "model.safetensors", original, "fp8-block")
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    print("written:", config)

    x = jax.random.normal(jax.random.key(1), (4, D))
    want = forward(original, x, lambda layer, y: layer(y))

    # into a bfloat16 NNX model, abstract until filled
    target = nnx.eval_shape(lambda: nnx_model(jnp.bfloat16, nnx.Rngs(0)))
    bf16 = bridge.load(folder, like=target, dtype=jnp.bfloat16)
    got = forward(bf16, x.astype(jnp.bfloat16), lambda layer, y: layer(y))
    error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
    print(f"NNX bfloat16 from FP8: largest output difference {error:.4f}")
    assert error < 0.1 * float(jnp.max(jnp.abs(want)))

    # into a float32 Equinox model
    f32 = bridge.load(folder, like=eqx.filter_eval_shape(eqx_model), dtype=jnp.float32)
    got = forward(f32, x, lambda layer, y: jax.vmap(layer)(y))
    error = float(jnp.max(jnp.abs(got - want)))
    print(f"Equinox float32 from FP8: largest output difference {error:.4f}")
    assert error < 0.05 * float(jnp.max(jnp.abs(want)))

    # a float32 model read from FP8 is written back with the same FP8 values and
    # scales, so it reads back exactly
    again = Path(tempfile.mkdtemp())
    bridge.save_quantized(again / "model.safetensors", f32, "fp8-block")
    back = bridge.load(again, like=eqx.filter_eval_shape(eqx_model), dtype=jnp.float32)
    same = jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: bool((a == b).all()), back, f32)
    )
    print("FP8 -> float32 -> FP8 -> float32, exactly:", same)
    assert same


if __name__ == "__main__":
    main()
