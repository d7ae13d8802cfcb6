"""Train a Flax NNX MLP with everything but the last layer frozen.

The Equinox way, on an NNX model: a boolean spec says what trains, and one compiled
step updates only that. Prints that the first layer is unchanged and the last one
trained.

    python examples/freeze_nnx.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import bridge


class MLP(nnx.Module):
    def __init__(self, sizes, rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def main():
    model = MLP([2, 32, 32, 1], nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (128, 2))
    y = jnp.sin(x[:, :1]) * jnp.cos(x[:, 1:])

    tree = bridge.from_nnx(model)  # once, before the loop
    spec = bridge.trainable(tree, lambda t: t.layers[-1])
    step = bridge.make_step(loss_fn, optax.adam(1e-2), spec)
    opt_state = step.init(tree)

    before = tree
    for i in range(200):
        tree, opt_state, loss = step(tree, opt_state, x, y)
        if i % 50 == 0:
            print(f"step {i:3d}  loss {float(loss):.4f}")

    first = np.array_equal(before.layers[0].kernel, tree.layers[0].kernel)
    last = np.array_equal(before.layers[-1].kernel, tree.layers[-1].kernel)
    print(f"first layer identical before and after: {first}")
    print(f"last layer changed: {not last}")
    assert first and not last

    model = bridge.to_nnx(tree)  # back to a plain NNX module
    print("trained model output:", model(x[:2]).ravel())


if __name__ == "__main__":
    main()
