"""A LoRA training step on a 512 MiB model: bridge vs a hand-written low-rank step.

The model: an NNX MLP of 8 dense layers 4096 wide (float32, 512 MiB), a rank-8
adapter on every layer. Three variants, each in its own subprocess (interleaved
rounds, 3 each; steady peak RSS read from VmHWM after 2 warm-up steps, then the
median time of the next steps):

- bridge: `bridge.lora` + `bridge.make_step(loss, adam, bridge.trainable(t, "lora"))`;
- floor: a hand-written `jax.jit` step over plain arrays, `x W + s (x A) B`, the
  adapters and Adam state donated, the frozen weights passed in;
- full: `bridge.make_step` training every weight (full fine-tuning), for its peak.

Prints the medians and the ratios bridge/floor for peak RSS and step time (targets
<= 1.1 each) and full/bridge for peak RSS, the backend, and XLA's footprint of each
compiled step (`memory_analysis()`: on an accelerator RSS does not hold the arrays).

Measured (shared 2-core CPU, loaded): peak RSS floor 868 MiB, bridge 869 MiB (1.002),
full 1983 MiB (2.28x bridge); step time floor 6.75 s, bridge 5.68 s (0.84).

    python benchmarks/lora.py [--quick]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax
from _common import backend, compiled_bytes, reset_peak, rss
from flax import nnx

import bridge


DEPTH, RANK, ALPHA, BATCH, LR, STEPS = 8, 8, 16.0, 64, 1e-3, 5


class WideMLP(nnx.Module):
    def __init__(self, width, rngs):
        self.layers = nnx.List(
            [nnx.Linear(width, width, rngs=rngs) for _ in range(DEPTH)]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def variant_step(variant, width):
    """A function running one step of `variant`, blocking until it is done."""
    model = WideMLP(width, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, width))
    y = jax.random.normal(jax.random.key(2), (BATCH, width))
    optim = optax.adam(LR)
    tree = bridge.lora(
        bridge.from_nnx(model), "layers", rank=RANK, alpha=ALPHA, key=jax.random.key(3)
    )
    del model
    if variant in ("bridge", "full"):
        spec = bridge.trainable(tree, "lora" if variant == "bridge" else ".")
        step = bridge.make_step(loss_fn, optim, spec)
        state = {"tree": tree, "opt": step.init(tree)}

        def run():
            state["tree"], state["opt"], loss = step(state["tree"], state["opt"], x, y)
            jax.block_until_ready((loss, state["opt"]))

        run.footprint = lambda: compiled_bytes(
            step.lower(state["tree"], state["opt"], x, y)
        )
        return run
    frozen = [(layer.kernel, layer.bias) for layer in tree.layers]
    adapters = [(layer.lora_a, layer.lora_b) for layer in tree.layers]
    scaling = ALPHA / RANK
    del tree

    def loss(adapters, frozen, x, y):
        h = x
        for i, ((w, b), (a, bb)) in enumerate(zip(frozen, adapters)):
            h = h @ w + b[None] + scaling * ((h @ a) @ bb)
            if i < DEPTH - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - y) ** 2)

    @jax.jit
    def _step(adapters, opt_state, frozen, x, y):
        value, grads = jax.value_and_grad(loss)(adapters, frozen, x, y)
        updates, opt_state = optim.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    step = jax.jit(_step.__wrapped__, donate_argnums=(0, 1))
    state = {"ad": adapters, "opt": optim.init(adapters)}

    def run():
        state["ad"], state["opt"], value = step(state["ad"], state["opt"], frozen, x, y)
        jax.block_until_ready((value, state["opt"]))

    run.footprint = lambda: compiled_bytes(
        step.lower(state["ad"], state["opt"], frozen, x, y)
    )
    return run


def child(variant, width):
    run = variant_step(variant, width)
    for _ in range(2):  # compile, warm up
        run()
    reset_peak()  # VmHWM: from the current RSS on
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    out = {"peak": rss("VmHWM"), "time": statistics.median(times)}
    out.update(footprint=run.footprint(), backend=backend())
    print(json.dumps(out))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    width = 1024 if args.quick else 4096
    rounds = 1 if args.quick else 3
    size = DEPTH * (width * width + width) * 4 / 2**20
    print(f"model: {DEPTH} dense layers {width} wide, {size:.0f} MiB; rank {RANK}")
    peaks = {"floor": [], "bridge": [], "full": []}
    times = {"floor": [], "bridge": [], "full": []}
    footprints = {}
    for _ in range(rounds):
        for variant in peaks:
            out = subprocess.run(
                [sys.executable, __file__, "--child", variant, str(width)],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "XLA_FLAGS": ""},
            ).stdout
            result = json.loads(out.strip().splitlines()[-1])
            peaks[variant].append(result["peak"])
            times[variant].append(result["time"])
            footprints[variant] = result["footprint"]  # the same each round
    print(f"backend: {result['backend']}")
    peak = {k: statistics.median(v) for k, v in peaks.items()}
    time_ = {k: statistics.median(v) for k, v in times.items()}
    for k in peaks:
        print(
            f"{k:>6}: peak RSS {peak[k] / 2**20:8.0f} MiB, "
            f"step {time_[k] * 1e3:8.1f} ms, XLA footprint "
            f"{footprints[k] / 2**20:8.0f} MiB"
        )
    print(
        f"bridge/floor peak RSS: {peak['bridge'] / peak['floor']:.3f} (target <= 1.1)"
    )
    print(
        "bridge/floor step time: "
        f"{time_['bridge'] / time_['floor']:.3f} (target <= 1.1)"
    )
    print(f"full fine-tuning / LoRA peak RSS: {peak['full'] / peak['bridge']:.2f}")
    ratio = footprints["bridge"] / footprints["floor"]
    print(f"bridge/floor XLA footprint: {ratio:.3f} (what an accelerator holds)")


if __name__ == "__main__":
    main()
