"""One step training the top half of a 20-layer, 32-wide MLP (batch 64, adam).

Compares, in one interleaved run (each round times every variant in turn):

- floor: `jax.jit` over plain lists of arrays, the frozen half passed in;
- bridge: `bridge.make_step` on the NNX model's Tree;
- nnx: `nnx.jit` + `nnx.Optimizer(wrt=...)` + `nnx.DiffState`, NNX's own freezing;
- eqx: `eqx.filter_jit` with `eqx.partition` / `eqx.filter_grad` / `eqx.apply_updates`
  on an Equinox MLP of the same size;
- haiku: `bridge.make_step` on the Tree of Haiku's own `hk.nets.MLP` of the same size
  (`bridge.from_haiku`, `loss_fn(params, x, y)` calling `fn.apply`), when dm-haiku is
  installed;
- keras: `bridge.make_step` on a Keras `Sequential` of the same Dense layers
  (`bridge.from_keras`, the model run in a `keras.StatelessScope`), when keras is
  installed (the JAX backend: KERAS_BACKEND is set to jax here).

Every variant blocks after every step on its loss and optimizer state: outputs of the
same XLA computation as the new weights, so when they are ready the step is done (the
frozen weights that bridge's new Tree holds are its inputs, ready all along). Prints the
median time per step and the ratios bridge/floor (target <= 1.1), nnx/bridge (>= 8),
eqx/bridge (>= 2), haiku/floor and keras/floor (<= 1.1: the same compiled step).

Two more cases, each against its own floor:

- per-call overhead: 10,000 leaves (5,000 Linen Dense layers of one unit, half of them
  trained by sgd) and trivial compute, bridge vs a donated `jax.jit` over lists of
  arrays (target <= 1.3);
- memory: a 512 MiB NNX MLP (8 layers 4096 wide), its top half trained by adam, each
  variant in its own subprocess (alternating, 3 each) for the steady peak RSS (VmHWM,
  reset after 2 warm-up steps), then both in this process, interleaved, for the
  median step time; bridge (donating, the default) vs a `jax.jit` step with
  `donate_argnums` (targets <= 1.05 both), and XLA's footprint of each compiled step
  (`memory_analysis()`: what an accelerator holds, where RSS does not show it).

    python benchmarks/step.py [--quick]
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import backend, compiled_bytes, interleaved, reset_peak, rss
from flax import nnx

import bridge


os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported (below)


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
    # a copy: the step donates (consumes) the trainable arrays it is given, and the
    # other variants start from the same model
    tree = jax.tree_util.tree_map(jnp.copy, bridge.from_nnx(model))
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


def haiku_variant(x, y):
    """Haiku's own `hk.nets.MLP` of the same layers, the top half trained."""
    import haiku as hk

    fn = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([WIDTH] * DEPTH)(x)))
    params = fn.init(jax.random.key(0), x)

    def loss(params, x, y):
        return jnp.mean((fn.apply(params, x) - y) ** 2)

    tree = bridge.from_haiku(params, fn=fn)
    top = [f"linear_{i}" for i in range(TOP, DEPTH)]
    step = bridge.make_step(
        loss, optax.adam(LR), bridge.trainable(tree, lambda t: [t.mlp[n] for n in top])
    )
    return _stepping(step, tree, x, y)


def keras_variant(x, y):
    """A Keras `Sequential` of the same Dense layers, the top half trained."""
    import keras

    model = keras.Sequential(
        [keras.Input((WIDTH,))]
        + [
            keras.layers.Dense(
                WIDTH, activation="relu" if i < DEPTH - 1 else None, name=f"d{i}"
            )
            for i in range(DEPTH)
        ]
    )

    def loss(model, x, y):
        return jnp.mean((model(x, training=True) - y) ** 2)

    tree = bridge.from_keras(model)
    trained = [f"d{i}" for i in range(TOP, DEPTH)]
    step = bridge.make_step(
        loss, optax.adam(LR), bridge.trainable(tree, lambda t: [t[n] for n in trained])
    )
    return _stepping(step, tree, x, y)


def _stepping(step, tree, x, y):
    state = [tree, step.init(tree)]

    def run():
        tree, opt_state, value = step(state[0], state[1], x, y)
        jax.block_until_ready((opt_state, value))
        state[:] = [tree, opt_state]

    return run


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


# --- per-call overhead: many leaves, trivial compute --------------------------------


def overhead_variants(leaves):
    """bridge and a donated jax.jit, each on `leaves` one-unit arrays, half trained."""
    layers = leaves // 2
    variables = {
        "params": {
            f"Dense_{i}": {"kernel": jnp.full((1, 1), 0.5), "bias": jnp.zeros((1,))}
            for i in range(layers)
        }
    }
    x = jnp.ones((1, 1))
    top = f"Dense_{layers - 1}"

    def loss(variables, x):
        return jnp.sum(x * variables["params"][top]["kernel"])

    tree = bridge.from_linen(variables)
    spec = bridge.trainable(
        tree, lambda t: [t[f"Dense_{i}"] for i in range(layers // 2, layers)]
    )
    step = bridge.make_step(loss, optax.sgd(0.1), spec)
    state = [tree, step.init(tree)]

    def run_bridge():
        tree, opt_state, value = step(state[0], state[1], x)
        jax.block_until_ready(value)
        state[:] = [tree, opt_state]

    flat = [jnp.copy(a) for a in jax.tree_util.tree_leaves(variables)]
    train, frozen = flat[len(flat) // 2 :], flat[: len(flat) // 2]
    optim = optax.sgd(0.1)

    def floor_step(train, frozen, opt_state, x):
        grads = jax.grad(lambda t: jnp.sum(x * t[-1]))(train)
        updates, opt_state = optim.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, jnp.sum(x)

    floor = jax.jit(floor_step, donate_argnums=(0, 2))
    floor_state = [train, optim.init(train)]

    def run_floor():
        train, opt_state, value = floor(floor_state[0], frozen, floor_state[1], x)
        jax.block_until_ready(value)
        floor_state[:] = [train, opt_state]

    return {"floor": run_floor, "bridge": run_bridge}


# --- memory: a large MLP, each variant in its own process ----------------------------


class WideMLP(nnx.Module):
    def __init__(self, width, depth, rngs):
        self.layers = nnx.List(
            [nnx.Linear(width, width, rngs=rngs) for _ in range(depth)]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


MEMORY_DEPTH, MEMORY_BATCH, MEMORY_STEPS = 8, 8, 6


def memory_variant(variant, width):
    """A function running one step of `variant` ("bridge" or "floor")."""
    model = WideMLP(width, MEMORY_DEPTH, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (MEMORY_BATCH, width))
    y = jax.random.normal(jax.random.key(2), (MEMORY_BATCH, width))
    top = MEMORY_DEPTH // 2
    optim = optax.adam(LR)
    if variant == "bridge":
        tree = bridge.from_nnx(model)
        spec = bridge.trainable(tree, lambda t: t.layers[top:])
        step = bridge.make_step(nnx_loss, optim, spec)
        state = [tree, step.init(tree)]

        def run():
            tree, opt_state, value = step(state[0], state[1], x, y)
            jax.block_until_ready((opt_state, value))
            state[:] = [tree, opt_state]

        run.footprint = lambda: compiled_bytes(step.lower(*state, x, y))

    else:
        layers = [(layer.kernel[...], layer.bias[...]) for layer in model.layers]
        frozen, train = layers[:top], layers[top:]
        del model, layers

        def loss(train, frozen, x, y):
            h = x
            for i, (w, b) in enumerate(frozen + train):
                h = h @ w + b
                h = jax.nn.relu(h) if i < MEMORY_DEPTH - 1 else h
            return jnp.mean((h - y) ** 2)

        def floor_step(train, frozen, opt_state, x, y):
            value, grads = jax.value_and_grad(loss)(train, frozen, x, y)
            updates, opt_state = optim.update(grads, opt_state, train)
            return optax.apply_updates(train, updates), opt_state, value

        floor = jax.jit(floor_step, donate_argnums=(0, 2))
        state = [train, optim.init(train)]

        def run():
            train, opt_state, value = floor(state[0], frozen, state[1], x, y)
            jax.block_until_ready((opt_state, value))
            state[:] = [train, opt_state]

        run.footprint = lambda: compiled_bytes(
            floor.lower(state[0], frozen, state[1], x, y)
        )

    return run


def memory_child(variant, width):
    """One variant's steps in this process: prints its steady peak RSS, step times."""
    run = memory_variant(variant, width)
    for _ in range(2):  # compile, warm up
        run()
    reset_peak()  # VmHWM: from the current RSS on
    times = []
    for _ in range(MEMORY_STEPS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(json.dumps({"peak": rss("VmHWM"), "times": times}))


def memory_case(width, rounds):
    """Peak RSS and step time medians of `rounds` alternating runs of each variant."""
    peaks = {"floor": [], "bridge": []}
    times = {"floor": [], "bridge": []}
    for _ in range(rounds):
        for variant in peaks:
            out = subprocess.run(
                [sys.executable, __file__, "--memory-child", variant, str(width)],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "XLA_FLAGS": ""},
            ).stdout
            result = json.loads(out.strip().splitlines()[-1])
            peaks[variant].append(result["peak"])
            times[variant].extend(result["times"])
    return (
        {k: statistics.median(v) for k, v in peaks.items()},
        {k: statistics.median(v) for k, v in times.items()},
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        return memory_child(args.memory_child[0], int(args.memory_child[1]))
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
    if installed("haiku"):
        variants["haiku"] = haiku_variant(x, y)
    if installed("keras"):
        variants["keras"] = keras_variant(x, y)
    median = interleaved(variants, rounds, per_round, warmup=3)
    print(f"backend: {backend()}")
    print(
        f"one step, top {DEPTH - TOP} of {DEPTH} layers x {WIDTH}, batch {BATCH}, adam"
    )
    print(f"{'variant':<8}{'median':>12}")
    for name, value in median.items():
        print(f"{name:<8}{value * 1e6:>10.1f}us")
    print(f"bridge/floor {median['bridge'] / median['floor']:6.2f}   (target <= 1.1)")
    print(f"nnx/bridge   {median['nnx'] / median['bridge']:6.2f}   (target >= 8)")
    print(f"eqx/bridge   {median['eqx'] / median['bridge']:6.2f}   (target >= 2)")
    for name in ("haiku", "keras"):
        if name in median:
            ratio = median[name] / median["floor"]
            print(f"{name + '/floor':<12} {ratio:6.2f}   (target <= 1.1)")
        else:
            print(f"{name}: not installed (pip install 'bridge[{name}]')")

    leaves = 1_000 if args.quick else 10_000
    median = interleaved(overhead_variants(leaves), rounds // 4, per_round, warmup=3)
    print(f"\nper-call overhead: {leaves} leaves, half trained (sgd), trivial compute")
    for name, value in median.items():
        print(f"{name:<8}{value * 1e3:>10.2f}ms")
    ratio = median["bridge"] / median["floor"]
    print(f"bridge/floor {ratio:6.2f}   (target <= 1.3)")

    width = 1024 if args.quick else 4096  # 32 MiB or 512 MiB of float32 weights
    mib = MEMORY_DEPTH * width * (width + 1) * 4 / 2**20
    # RSS peaks in a process each, on the CPU only (an accelerator holds the arrays
    # in its own memory, and this process holds the accelerator)
    cpu = jax.default_backend() == "cpu"
    peaks = memory_case(width, 1 if args.quick else 3)[0] if cpu else None
    # the time, interleaved in this process (the peaks need a process each)
    variants = {v: memory_variant(v, width) for v in ("floor", "bridge")}
    times = interleaved(variants, 2 if args.quick else 8, warmup=3)
    print(f"\nmemory: NNX MLP of {mib:.0f} MiB, top half trained (adam), donated")
    for name in variants:
        held = f"peak RSS {peaks[name] / 2**20:8.0f} MiB " if peaks else ""
        held += f"({peaks[name] / 2**20 / mib:4.2f}x the model)  " if peaks else ""
        print(f"{name:<8}{held}step {times[name] * 1e3:8.1f}ms")
    footprint = {name: variants[name].footprint() for name in variants}
    for name, nbytes in footprint.items():
        print(f"{name:<8}XLA footprint {nbytes / 2**20:8.0f} MiB (compiled step)")
    print(f"bridge/floor footprint {footprint['bridge'] / footprint['floor']:6.3f}")
    if peaks:
        ratio = peaks["bridge"] / peaks["floor"]
        print(f"bridge/floor peak RSS {ratio:6.3f}   (<= 1.05)")
    print(f"bridge/floor step     {times['bridge'] / times['floor']:6.3f}   (<= 1.05)")


if __name__ == "__main__":
    main()
