"""Training a model with a component of another framework costs what the same model
written in one framework costs.

Two models, each in two forms, trained with adam on an MLP of DEPTH layers x WIDTH
(batch BATCH) followed by a head:

- NNX outer: `Outer(enc=bridge.as_nnx(Equinox MLP))` vs the same model all in NNX
  (`nnx.Linear` layers of the same shapes);
- Equinox outer: `Outer(enc=bridge.as_equinox(NNX MLP))` vs the same model all in
  Equinox (`eqx.nn.MLP` of the same shapes);

each trained two ways: with `bridge.make_step`, and in the outer framework's own idiom
(`nnx.jit` + `nnx.Optimizer`; `eqx.filter_jit` + `eqx.filter_value_and_grad`). Every
variant blocks after every step on its loss. Each pairing is timed on its own, its
wrapped and native steps alternating (neighbouring steps see the same machine load);
prints the median time per step and the ratio wrapped / native (target <= 1.05).

    python benchmarks/embed.py [--quick]
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


DEPTH, WIDTH, BATCH, LR = 8, 64, 64, 1e-3


def loss_of(out, y):
    return jnp.mean((out - y) ** 2)


# --- the components ----------------------------------------------------------------


class EqxEncoder(eqx.Module):
    """An Equinox MLP on a batch."""

    mlp: eqx.nn.MLP

    def __call__(self, x):
        return jax.vmap(self.mlp)(x)


class NNXEncoder(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(DEPTH)]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def eqx_encoder():
    mlp = eqx.nn.MLP(
        WIDTH, WIDTH, WIDTH, DEPTH - 1, activation=jax.nn.relu, key=jax.random.key(0)
    )
    return EqxEncoder(mlp)


# --- NNX outer ----------------------------------------------------------------------


class NNXOuter(nnx.Module):
    def __init__(self, enc, rngs):
        self.enc = enc
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.enc(x)))


def nnx_models():
    wrapped = NNXOuter(bridge.as_nnx(eqx_encoder()), nnx.Rngs(1))
    native = NNXOuter(NNXEncoder(nnx.Rngs(2)), nnx.Rngs(1))
    return wrapped, native


def nnx_idiom(model, x, y):
    model = nnx.clone(model)
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        value, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
        optimizer.update(model, grads)
        return value

    return lambda: jax.block_until_ready(step(model, optimizer, x, y))


# --- Equinox outer --------------------------------------------------------------------


class EqxOuter(eqx.Module):
    enc: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.head)(jax.nn.relu(self.enc(x)))


def eqx_models():
    def head():
        return eqx.nn.Linear(WIDTH, WIDTH, key=jax.random.key(3))

    wrapped = EqxOuter(bridge.as_equinox(NNXEncoder(nnx.Rngs(2))), head())
    native = EqxOuter(eqx_encoder(), head())
    return wrapped, native


def eqx_idiom(model, x, y):
    optim = optax.adam(LR)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        value, grads = eqx.filter_value_and_grad(lambda m: loss_of(m(x), y))(model)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, value

    state = [model, optim.init(eqx.filter(model, eqx.is_array))]

    def run():
        model, opt_state, value = step(state[0], state[1], x, y)
        jax.block_until_ready(value)
        state[:] = [model, opt_state]

    return run


# --- bridge.make_step, any outer framework -------------------------------------------


def with_make_step(model, x, y):
    tree = bridge.to_neutral(model)
    spec = jax.tree.map(lambda role: role == "params", bridge.roles(tree))
    step = bridge.make_step(lambda m, x, y: loss_of(m(x), y), optax.adam(LR), spec)
    state = [tree, step.init(tree)]

    def run():
        tree, opt_state, value = step(state[0], state[1], x, y)
        jax.block_until_ready(value)
        state[:] = [tree, opt_state]

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    rounds, per_round = (10, 5) if args.quick else (400, 5)

    x = jax.random.normal(jax.random.key(4), (BATCH, WIDTH))
    y = jax.random.normal(jax.random.key(5), (BATCH, WIDTH))
    # fresh models for each variant: a make_step consumes the arrays it is given
    pairs = {
        "nnx outer, make_step": (nnx_models, with_make_step),
        "nnx outer, nnx.jit": (nnx_models, nnx_idiom),
        "eqx outer, make_step": (eqx_models, with_make_step),
        "eqx outer, filter_jit": (eqx_models, eqx_idiom),
    }
    variants = {}
    for name, (models, train) in pairs.items():
        wrapped, native = models()
        variants[name, "wrapped"] = train(wrapped, x, y)
        variants[name, "native"] = train(native, x, y)
    for run in variants.values():  # compile, warm up
        for _ in range(3):
            run()
    # each pairing on its own, wrapped and native alternating step by step (the
    # machine's load drifts: neighbouring steps see the same load)
    times = {key: [] for key in variants}
    for name in pairs:
        pair = [(name, "wrapped"), (name, "native")]
        for i in range(rounds * per_round):
            for key in pair if i % 2 else pair[::-1]:
                start = time.perf_counter()
                variants[key]()
                times[key].append(time.perf_counter() - start)

    median = {key: statistics.median(t) for key, t in times.items()}
    print(f"one adam step, MLP {DEPTH} x {WIDTH} + head, batch {BATCH}")
    print(f"{'training':<24}{'wrapped':>11}{'native':>11}{'ratio':>8}")
    for name in pairs:
        a, b = median[name, "wrapped"], median[name, "native"]
        print(f"{name:<24}{a * 1e6:>9.1f}us{b * 1e6:>9.1f}us{a / b:>8.3f}")
    print("ratio = wrapped / native (target <= 1.05)")


if __name__ == "__main__":
    main()
