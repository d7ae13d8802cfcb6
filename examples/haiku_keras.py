"""Out of Haiku, into Keras 3 and Flax NNX: Haiku's own `hk.nets.ResNet18`.

1. The transformed function and its dicts become a `bridge.Tree`
   (`bridge.from_haiku(params, state, fn=..., example=...)`); its logits are trained
   one step with the rest frozen, the Haiku way (`loss_fn(params, state, x, y)`
   calling `fn.apply`, the BatchNorm averages coming back in the Tree).
2. The trained model is ported into a Flax NNX ResNet18 with names of its own (the
   twin in tests/haiku_twins.py), by what the two forward passes compute
   (`example=`), and its outputs checked.
3. Its BatchNorm-free head goes through a checkpoint file into a Keras `Dense`.

Needs `dm-haiku` and `keras` (`pip install "./bridge[haiku,keras]"`); without them
the example says so and stops.

    python examples/haiku_keras.py
"""

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import bridge


HAVE = all(importlib.util.find_spec(m) for m in ("haiku", "keras"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    if not HAVE:
        print("haiku_keras.py needs dm-haiku and keras: skipped")
        return
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import haiku as hk
    import keras

    from tests.haiku_twins import CLASSES, NNXResNet18, image

    # 1. Haiku's ResNet18 as a Tree, its logits trained one step
    fn = hk.transform_with_state(
        lambda x, is_training: hk.nets.ResNet18(CLASSES)(x, is_training)
    )
    x = image()
    params, state = jax.jit(fn.init, static_argnums=2)(jax.random.key(0), x, True)
    tree = bridge.from_haiku(params, state, fn=fn, example=(x, False))

    def loss_fn(params, state, x, y):
        out, state = fn.apply(params, state, None, x, True)
        return jnp.mean((out - y) ** 2), state

    spec = bridge.trainable(tree, lambda t: t.res_net18.logits)
    step = bridge.make_step(loss_fn, optax.adam(1e-2), spec, donate=False)
    y = jax.random.normal(jax.random.key(1), (x.shape[0], CLASSES))
    tree, _, loss = step(tree, step.init(tree), x, y)
    print(f"1. one step on the logits of hk.nets.ResNet18: loss {float(loss):.4f}")

    # 2. into an NNX ResNet18 whose blocks apply the shortcut first, as Haiku's do
    import tests.haiku_twins as twins

    twins.SHORTCUT_FIRST = True
    nnx_model = bridge.port(
        tree,
        NNXResNet18(nnx.Rngs(0)),
        example=(x,),
        example_kwargs=({"is_training": False}, {}),
    )
    diff = bridge.compare(tree, nnx_model, x, per_side=({"is_training": False}, {}))
    print(f"2. ported into Flax NNX: max output difference {diff:.1e}")
    assert diff < 1e-5

    # 3. the head through a file into Keras
    path = Path(tempfile.mkdtemp()) / "head.safetensors"
    head = bridge.from_haiku(
        {"logits": bridge.to_native(tree)[1]["res_net18/~/logits"]}
    )
    bridge.save(path, head)
    dense = keras.Sequential(
        [keras.Input((512,)), keras.layers.Dense(CLASSES, name="logits")]
    )
    dense = bridge.load(path, like=dense)
    features = np.ones((1, 512), "float32")
    want = features @ np.asarray(head.logits.w) + np.asarray(head.logits.b)
    diff = np.abs(np.asarray(dense(features)) - want).max()
    print(f"3. the head in Keras: max difference {diff:.1e}")


if __name__ == "__main__":
    main()
