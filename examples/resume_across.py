"""Resume a training run in another framework, optimizer state included.

A Linen MLP trains for 20 steps with `optax.chain(clip_by_global_norm, adamw)`; its
model, optimizer state and step are saved in one safetensors file. An Equinox twin
loads the file (Adam's moments ported with the same layouts as the weights: Dense
kernel `(in, out)` -> Linear weight `(out, in)`) and trains 20 more steps. The
result equals the Linen run trained for 40 steps, to float tolerance; restarting
the optimizer from zero instead does not.
"""

import tempfile
from pathlib import Path

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import bridge


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jax.nn.tanh(nn.Dense(16)(x)))


def batch(i):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (32, 2))
    return x, jnp.sin(x[:, :1] * 3) * jnp.cos(x[:, 1:])


tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-2))


@jax.jit
def linen_step(params, opt_state, x, y):
    def loss(p):
        return jnp.mean((LinenMLP().apply({"params": p}, x) - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


@eqx.filter_jit
def equinox_step(model, opt_state, x, y):
    def loss(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


def main(k=20, n=20):
    params = LinenMLP().init(jax.random.key(1), jnp.ones((1, 2)))["params"]
    opt_state = tx.init(params)
    for i in range(k):
        params, opt_state, _ = linen_step(params, opt_state, *batch(i))
    path = Path(tempfile.mkdtemp()) / "run.safetensors"
    bridge.save_training(path, {"params": params}, opt_state, step=k)

    # the Linen run goes on: the reference
    reference = params, opt_state
    for i in range(k, k + n):
        reference = linen_step(*reference, *batch(i))[:2]

    # an Equinox twin resumes from the file, optimizer state included
    twin = eqx.nn.MLP(2, 1, 16, depth=1, activation=jax.nn.tanh, key=jax.random.key(2))
    like = tx.init(eqx.filter(twin, eqx.is_array))
    run = bridge.load(path, like=twin, opt_state_like=like)
    print(f"loaded step {run.step} into an Equinox {type(run.model).__name__}")
    fresh = run.model, like  # the same weights, the optimizer restarted
    resumed = run.model, run.opt_state
    for i in range(run.step, run.step + n):
        resumed = equinox_step(*resumed, *batch(i))[:2]
        fresh = equinox_step(*fresh, *batch(i))[:2]

    def distance(model):
        ported = bridge.port(model, {"params": reference[0]})["params"]
        leaves = jax.tree.leaves(
            jax.tree.map(lambda a, b: jnp.abs(a - b).max(), ported, reference[0])
        )
        return float(max(leaves))

    print(
        f"max |Equinox resumed - Linen after {k + n} steps|: {distance(resumed[0]):.1e}"
    )
    print(f"max |Equinox restarted optimizer - Linen|:      {distance(fresh[0]):.1e}")
    assert distance(resumed[0]) < 1e-5 < distance(fresh[0])


if __name__ == "__main__":
    main()
