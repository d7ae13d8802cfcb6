"""Train an Equinox MLP with everything but the last layer frozen.

The same `bridge.trainable` + `bridge.make_step` as for Flax models, in place of
`eqx.partition` + `eqx.filter_grad` + `eqx.apply_updates` under `eqx.filter_jit`.
Prints that the first layer is unchanged and the last one trained.

    python examples/freeze_equinox.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import bridge


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def main():
    model = eqx.nn.MLP(2, 1, 32, depth=2, activation=jax.nn.relu, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (128, 2))
    y = jnp.sin(x[:, :1]) * jnp.cos(x[:, 1:])

    tree = bridge.from_equinox(model)  # once, before the loop
    spec = bridge.trainable(tree, lambda t: t.layers[-1])
    step = bridge.make_step(loss_fn, optax.adam(1e-2), spec)
    opt_state = step.init(tree)

    before = tree
    for i in range(200):
        tree, opt_state, loss = step(tree, opt_state, x, y)
        if i % 50 == 0:
            print(f"step {i:3d}  loss {float(loss):.4f}")

    first = np.array_equal(before.layers[0].weight, tree.layers[0].weight)
    last = np.array_equal(before.layers[-1].weight, tree.layers[-1].weight)
    print(f"first layer identical before and after: {first}")
    print(f"last layer changed: {not last}")
    assert first and not last

    model = bridge.to_equinox(tree)  # back to a plain Equinox model
    print("trained model output:", jax.vmap(model)(x[:2]).ravel())


if __name__ == "__main__":
    main()
