"""Train a Flax Linen MLP with everything but the last layer frozen.

No `optax.multi_transform` label trees: a boolean spec says what trains, and one
compiled step updates only that. Prints that the first layer is unchanged and the last
one trained.

    python examples/freeze_linen.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import bridge


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jax.nn.relu(nn.Dense(32)(x))
        x = jax.nn.relu(nn.Dense(32)(x))
        return nn.Dense(1)(x)


def loss_fn(model, x, y):
    # `model` is the module bound to the variables: call it like a function
    return jnp.mean((model(x) - y) ** 2)


def main():
    module = MLP()
    x = jax.random.normal(jax.random.key(1), (128, 2))
    y = jnp.sin(x[:, :1]) * jnp.cos(x[:, 1:])
    variables = module.init(jax.random.key(0), x)

    tree = bridge.from_linen(variables, module)  # once, before the loop
    spec = bridge.trainable(tree, lambda t: t.Dense_2)
    step = bridge.make_step(loss_fn, optax.adam(1e-2), spec)
    opt_state = step.init(tree)

    before = tree
    for i in range(200):
        tree, opt_state, loss = step(tree, opt_state, x, y)
        if i % 50 == 0:
            print(f"step {i:3d}  loss {float(loss):.4f}")

    first = np.array_equal(before.Dense_0.kernel, tree.Dense_0.kernel)
    last = np.array_equal(before.Dense_2.kernel, tree.Dense_2.kernel)
    print(f"first layer identical before and after: {first}")
    print(f"last layer changed: {not last}")
    assert first and not last

    variables = bridge.to_linen(tree)  # back to Linen variables
    print("trained model output:", module.apply(variables, x[:2]).ravel())


if __name__ == "__main__":
    main()
