"""Port a Linen CNN with BatchNorm into Equinox, print the plan and check the outputs.

The Linen model is trained for a few steps first so its BatchNorm running statistics
are not the initial ones; the Equinox model keeps them in an `eqx.nn.State`.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp

import bridge


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = jax.nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(3)(x)


class EquinoxCNN(eqx.Module):
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    head: eqx.nn.Linear
    channel_first = True  # tells bridge.compare to feed (C, H, W) examples

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(2, 8, 3, padding=1, key=k1)
        self.bn = eqx.nn.BatchNorm(8, "batch", momentum=0.9, mode="batch")
        self.head = eqx.nn.Linear(8, 3, key=k2)

    def __call__(self, x, state):
        x, state = self.bn(self.conv(x), state)
        return self.head(jax.nn.relu(x).mean(axis=(1, 2))), state


def main():
    images = jax.random.normal(jax.random.key(0), (16, 8, 8, 2))
    module = LinenCNN()
    variables = module.init(jax.random.key(1), images)
    for step in range(3):  # move the running statistics
        _, updates = module.apply(
            variables, images + step, train=True, mutable=["batch_stats"]
        )
        variables = {**variables, **updates}

    target = eqx.nn.make_with_state(EquinoxCNN)(jax.random.key(2))
    print(bridge.port_plan((module, variables), target))
    before = bridge.compare((module, variables), target, images)
    model, state = bridge.port((module, variables), target)
    after = bridge.compare((module, variables), (model, state), images)
    print(f"\nmax |linen - equinox| before the port: {before:.3g}")
    print(f"max |linen - equinox| after the port:  {after:.3g}")
    mean, _ = state.get(model.bn.batch_state_index)
    print("running mean, Linen:  ", variables["batch_stats"]["BatchNorm_0"]["mean"][:4])
    print("running mean, State:  ", mean[:4])
    assert after < 1e-5 and jnp.allclose(
        mean, variables["batch_stats"]["BatchNorm_0"]["mean"]
    )


if __name__ == "__main__":
    main()
