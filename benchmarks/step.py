"""One step training the top half of a 20-layer, 32-wide MLP (batch 64, adam).

Compares, in one interleaved run (each round times every variant in turn):

- floor: `jax.jit` over plain lists of arrays, the frozen half passed in;
- bridge: `bridge.make_step` on the NNX model's Tree;
- nnx: `nnx.jit` + `nnx.Optimizer(wrt=...)` + `nnx.DiffState`, NNX's own freezing;
- eqx: `eqx.filter_jit` with `eqx.partition` / `eqx.filter_grad` / `eqx.apply_updates`
  on an Equinox MLP of the same size.

Every variant blocks after every step on its loss and optimizer state: outputs of the
same XLA computation as the new weights, so when they are ready the step is done (the
frozen weights that bridge's new Tree holds are its inputs, ready all along). Prints the
median time per step and the ratios bridge/floor (target <= 1.1), nnx/bridge (>= 8),
eqx/bridge (>= 2).

    python benchmarks/step.py [--quick]
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import bridge


DEPTH, WIDTH, BATCH, LR = 20, 32, 64, 1e-3
TOP = DEPTH // 2  # layers TOP.. are trained


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(DEPTH)]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def eqx_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def floor_variant(model, x, y):
    """Hand-written: lists of (kernel, bias), the frozen ones passed in."""
    layers = [(layer.kernel[...], layer.bias[...]) for layer in model.layers]
    frozen, train = layers[:TOP], layers[TOP:]
    optim = optax.adam(LR)

    def loss(train, frozen, x, y):
        h = x
        for i, (w, b) in enumerate(frozen + train):
            h = h @ w + b
            h = jax.nn.relu(h) if i < DEPTH - 1 else h
        return jnp.mean((h - y) ** 2)

    @jax.jit
    def step(train, frozen, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(train, frozen, x, y)
        updates, opt_state = optim.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, value

    state = [train, optim.init(train)]

    def run():
        train, opt_state, value = step(state[0], frozen, state[1], x, y)
        jax.block_until_ready((opt_state, value))
        state[:] = [train, opt_state]

    return run


def bridge_variant(model, x, y):
    # the step donates the trained leaves: a copy, so the other variants keep the
    # model's own arrays
    tree = jax.tree_util.tree_map(jnp.array, bridge.from_nnx(model))
    spec = bridge.trainable(tree, lambda t: [t.layers[i] for i in range(TOP, DEPTH)])
    step = bridge.make_step(nnx_loss, optax.adam(LR), spec)
    state = [tree, step.init(tree)]

    def run():
        tree, opt_state, value = step(state[0], state[1], x, y)
        jax.block_until_ready((opt_state, value))
        state[:] = [tree, opt_state]

    return run


def nnx_variant(model, x, y):
    model = nnx.clone(model)
    top = nnx.All(nnx.Param, lambda path, _: path[0] == "layers" and path[1] >= TOP)
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=top)

    @nnx.jit
    def step(model, optimizer, x, y):
        grad_fn = nnx.value_and_grad(nnx_loss, argnums=nnx.DiffState(0, top))
        value, grads = grad_fn(model, x, y)
        optimizer.update(model, grads)
        return value

    def run():
        jax.block_until_ready(step(model, optimizer, x, y))

    return run


def eqx_variant(x, y):
    model = eqx.nn.MLP(
        WIDTH, WIDTH, WIDTH, DEPTH - 1, activation=jax.nn.relu, key=jax.random.key(0)
    )
    spec = jax.tree_util.tree_map(lambda _: False, model)
    spec = eqx.tree_at(
        lambda m: [p for layer in m.layers[TOP:] for p in (layer.weight, layer.bias)],
        spec,
        replace=[True] * 2 * (DEPTH - TOP),
    )
    optim = optax.adam(LR)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        diff, static = eqx.partition(model, spec)
        loss = lambda d: eqx_loss(eqx.combine(d, static), x, y)  # noqa: E731
        value, grads = eqx.filter_value_and_grad(loss)(diff)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, value

    state = [model, optim.init(eqx.filter(model, spec))]

    def run():
        model, opt_state, value = step(state[0], state[1], x, y)
        jax.block_until_ready((opt_state, value))
        state[:] = [model, opt_state]

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    rounds, per_round = (20, 5) if args.quick else (400, 5)

    model = MLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    y = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))
    variants = {
        "floor": floor_variant(model, x, y),
        "bridge": bridge_variant(model, x, y),
        "nnx": nnx_variant(model, x, y),
        "eqx": eqx_variant(x, y),
    }
    for run in variants.values():  # compile, warm up
        for _ in range(3):
            run()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            for _ in range(per_round):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)

    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"one step, top {DEPTH - TOP} of {DEPTH} layers x {WIDTH}, batch {BATCH}, adam"
    )
    print(f"{'variant':<8}{'median':>12}")
    for name, value in median.items():
        print(f"{name:<8}{value * 1e6:>10.1f}us")
    print(f"bridge/floor {median['bridge'] / median['floor']:6.2f}   (target <= 1.1)")
    print(f"nnx/bridge   {median['nnx'] / median['bridge']:6.2f}   (target >= 8)")
    print(f"eqx/bridge   {median['eqx'] / median['bridge']:6.2f}   (target >= 2)")


if __name__ == "__main__":
    main()
