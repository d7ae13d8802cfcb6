"""The FP8 block-scaled TPU kernel (`bridge/_kept/_fp8_kernel.py`) against the dense
bfloat16 product and XLA's dequantizing path, on the device.

1. A check on the device itself (Pallas's interpreter can be right where the chip is
   not): one `(2304, 5760)` layer (2 x 5 tiles of 1152), batch 33, the forward
   `x @ w.T` and the input gradient `g @ w` against the dequantizing path
   (`dequantize()` then one bfloat16 product); it prints the largest difference over
   the largest output.
2. The timing: LAYERS `Linear(5760, 5760)` (FP8 e4m3, 128 x 128 block scales) with a
   `tanh` between them, the forward and the input gradient at batch 8, 64 and 1024,
   each of: dense bfloat16 weights, the kernel, XLA's dequantizing path; medians of
   interleaved runs, as multiples of the dense time.

    python benchmarks/fp8_kernel.py           # on a TPU: about a minute
    python benchmarks/fp8_kernel.py --quick   # 1 layer (a TPU), or tiny shapes in
                                              # Pallas's interpreter (a CPU smoke run)

Exits 1 when a check is off by more than bfloat16 rounding allows (TOLERANCE).

Measured on one v5e (JAX 0.10.2, 2026-12-06; `RESULTS-tpu.md`): the forward 0.74x
dense at batch 8, 0.76x at 64, 1.14x at 1024; the input gradient 0.78x, 0.80x,
1.24x; XLA's dequantize 4.6x at batch 8; checks within 2.6e-3.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import backend, interleaved

from bridge._kept import _fp8_kernel
from bridge._kept._array import QuantizedArray, Scheme


TOLERANCE = 2e-2  # of the largest output: a few bfloat16 roundings, not a layout slip


def layer(key: jax.Array, out: int, inputs: int) -> QuantizedArray:
    """A kept FP8 weight `(out, in)` with 128 x 128 block scales, outputs of about
    unit size for unit inputs."""
    k1, k2 = jax.random.split(key)
    codes = jnp.clip(jax.random.normal(k1, (out, inputs)) * 100, -448, 448)
    bound = 1 / (100 * inputs**0.5)
    scale = jax.random.uniform(
        k2, (out // 128, inputs // 128), jnp.float32, bound / 2, bound
    )
    parts = {"weight": codes.astype(jnp.float8_e4m3fn), "scale": scale}
    settings = (("block", (128, 128)),)
    return QuantizedArray(
        parts, Scheme("fp8-block", 8, (out, inputs), "bfloat16", settings)
    )


def _product(x: jax.Array, w: jax.Array, contract: str) -> jax.Array:
    """`x @ w.T` (`"in"`) or `x @ w` (`"out"`) for a dense `w` `(out, in)`."""
    dims = (((1,), (1 if contract == "in" else 0,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(
        x.dtype
    )


def _kernel(x: jax.Array, q: QuantizedArray, contract: str) -> jax.Array:
    return _fp8_kernel.fp8_block_matmul(
        x, q.parts["weight"], q.parts["scale"], contract
    )


def check(out: int, inputs: int, batch: int) -> bool:
    """The kernel against the dequantizing path on this device, both ways; prints
    each. Returns whether both are right."""
    q = layer(jax.random.key(0), out, inputs)
    right = True
    for contract, n in (("in", inputs), ("out", out)):
        v = jax.random.normal(jax.random.key(1), (batch, n), jnp.bfloat16)
        got = np.asarray(jax.jit(_kernel, static_argnums=2)(v, q, contract), np.float32)
        dense = jax.jit(QuantizedArray.dequantize)(q)
        want = np.asarray(
            jax.jit(_product, static_argnums=2)(v, dense, contract), np.float32
        )
        error = float(np.abs(got - want).max() / np.abs(want).max())
        good = error <= TOLERANCE and got.shape == want.shape
        right &= good
        what = "forward" if contract == "in" else "gradient"
        print(
            f"check {what:8s} batch {batch}: max error {error:.2e} of the largest"
            f" output {'ok' if good else 'WRONG'}",
            flush=True,
        )
    return right


def timing(n: int, layers: int, batches: tuple[int, ...], rounds: int) -> None:
    """Dense, kernel and XLA's dequantizing path over `layers` layers, both ways, at
    each batch; prints the medians as multiples of the dense time."""
    kept = [layer(k, n, n) for k in jax.random.split(jax.random.key(3), layers)]
    dense = [jax.jit(QuantizedArray.dequantize)(q) for q in kept]
    jax.block_until_ready(dense)

    def chain(product, contract):
        def f(x, weights):
            for w in weights:
                x = jnp.tanh(product(x, w, contract))
            return x

        return jax.jit(f)

    def xla(x, q, contract):
        return _product(x, q.dequantize(), contract)  # XLA fuses it into the dot

    for contract in ("in", "out"):
        fns = {
            "dense": (chain(_product, contract), dense),
            "kernel": (chain(_kernel, contract), kept),
            "xla": (chain(xla, contract), kept),
        }
        for batch in batches:
            x = jax.random.normal(jax.random.key(4), (batch, n), jnp.bfloat16)
            times = interleaved(
                {
                    k: lambda f=f, w=w: jax.block_until_ready(f(x, w))
                    for k, (f, w) in fns.items()
                },
                rounds,
                per_round=5,
            )
            what = "forward " if contract == "in" else "gradient"
            print(
                f"{what} batch {batch:5d}: dense {times['dense'] * 1e3:7.3f} ms, "
                f"kernel {times['kernel'] / times['dense']:.2f}x, XLA dequantize "
                f"{times['xla'] / times['dense']:.2f}x",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 layer, or a CPU smoke run"
    )
    args = parser.parse_args()
    on_chip = jax.default_backend() == "tpu"
    print(f"{backend()}, JAX {jax.__version__}")
    if _fp8_kernel._pallas() is None:
        print("this JAX has no Pallas TPU API: nothing to measure")
        return 0
    context = contextlib.nullcontext() if on_chip else _fp8_kernel.interpreted()
    with context:
        if on_chip:
            right = check(2304, 5760, 33)
            layers, n, batches, rounds = (
                (1 if args.quick else 16),
                5760,
                (8, 64, 1024),
                7,
            )
        else:  # the interpreter: tiny shapes, the times mean nothing
            right = check(256, 384, 5)
            layers, n, batches, rounds = 2, 256, (8,), 1
        if right:
            timing(n, layers, batches, rounds)
    print("all checks ok" if right else "a check FAILED")
    return 0 if right else 1


if __name__ == "__main__":
    sys.exit(main())
