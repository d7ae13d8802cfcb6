"""The int4 group-scaled TPU kernel (`bridge/_kept/_int4_kernel.py`) against the dense
bfloat16 product and XLA's dequantizing path, on the device; both of the kernel's
ways to unpack the 4-bit values (`"nibbles"`: one a vector operation; `"pairs"`: two,
through `pltpu.bitcast`, the default).

1. A check on the device itself (an in-kernel slice can be right in Pallas's
   interpreter and wrong on the chip): one GPTQ `(2816, 5632)` layer (2 x 4 tiles),
   batch 33, forward `x @ w.T` and input gradient `g @ w`, each way of unpacking
   against the dequantizing path (`dequantize` then one bfloat16 product); it prints
   the largest difference over the largest output. A way that fails is not timed.
2. The timing, until 60 s (`--seconds`) have passed: LAYERS layers
   `Linear(5632, 5632)` (GPTQ weights, groups of 128, zero points) with a `tanh`
   between them; forward and input gradient at batch 8, 64 and 1024, each of: dense
   bfloat16 weights (`x @ w`, w `(in, out)`), the kernel, XLA's dequantizing path;
   medians of 20 interleaved runs, as multiples of the dense time (FACTS: an int4
   kernel measured elsewhere at 0.61-0.63x dense at batch 8; XLA's int4 with zero
   points 3.4x). Each line also gives the largest difference from the dequantizing
   path after all layers.
3. The check of step 1 for the other kinds (GPTQ with a plain-order `g_idx`,
   compressed-tensors with and without zero points), for 12 s more.
4. For 8 s more: the forward at batch 8 with the kernel ("pairs" where it is right)
   on each format's own packing (GPTQ as stored; compressed-tensors transposed in
   every call), against dense.

Measured on one v5e (JAX 0.10.2, 2026-12-06; 16 layers, medians of 20 interleaved
runs; two calls): batch 8 forward 0.71-0.72x dense ("pairs"), 0.75-0.76x
("nibbles"), XLA's dequantize 4.0x; input gradient 0.78x ("pairs"), XLA 4.0x; batch
64 forward 0.78x ("pairs"), 0.81x ("nibbles"), XLA 3.9x; compressed-tensors with
zero points 0.75-0.78x; every check on the chip within 5.0e-3 of the largest
output. Batch 1024 was not reached (each line takes ~25 s there). AWQ repacked in
every call measured 86x, so AWQ takes XLA's path in bridge.

    python benchmarks/int4_kernel.py           # on a TPU: < 90 s (--seconds 60)
    python benchmarks/int4_kernel.py --quick   # 1 layer (a TPU), or tiny shapes in
                                               # Pallas's interpreter (a CPU smoke run)

Exits 1 when a check is off by more than bfloat16 rounding allows (TOLERANCE).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import backend, interleaved

from bridge._kept import _fp8_kernel, _int4_kernel
from bridge._kept._array import QuantizedArray, Scheme


TOLERANCE = 2e-2  # of the largest output: a few bfloat16 roundings


def _words(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.lax.bitcast_convert_type(jax.random.bits(key, shape), jnp.int32)


def layer(key: jax.Array, out: int, inputs: int, kind: str) -> QuantizedArray:
    """One random kept 4-bit weight `(out, inputs)` of `kind`, groups of 128."""
    k1, k2, k3 = jax.random.split(key, 3)
    groups = inputs // 128
    bound = 1 / (8 * inputs**0.5)  # outputs of about unit size
    settings: tuple = (("group_size", 128),)
    if kind.startswith("gptq"):
        scale = jax.random.uniform(k3, (groups, out), jnp.float32, bound / 2, bound)
        parts = {
            "weight": _words(k1, (inputs // 8, out)),
            "zero": _words(k2, (groups, out // 8)),
            "scale": scale.astype(jnp.float16),
        }
        if kind == "gptq g_idx":
            parts["g_idx"] = jnp.arange(inputs, dtype=jnp.int32) // 128
        settings += (("zero_plus_one", True),)
        name = "gptq"
    else:  # compressed-tensors pack-quantized
        scale = jax.random.uniform(k3, (out, groups), jnp.float32, bound / 2, bound)
        parts = {"weight": _words(k1, (out, inputs // 8)), "scale": scale}
        parts["scale"] = scale.astype(jnp.bfloat16)
        if kind == "ct zero":
            parts["zero"] = jax.random.randint(k2, (out, groups), -8, 8, jnp.int8)
        name = "int-packed"
    return QuantizedArray(parts, Scheme(name, 4, (out, inputs), "bfloat16", settings))


def _dense_product(x: jax.Array, w: jax.Array, contract: str) -> jax.Array:
    dims = (((1,), (1 if contract == "in" else 0,)), ((), ()))
    y = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


KINDS = ("gptq", "gptq g_idx", "ct", "ct zero")
UNPACKS = ("nibbles", "pairs")  # bridge._kept._int4_kernel's two ways to unpack values


def check(
    out: int,
    inputs: int,
    batch: int,
    kinds: tuple[str, ...] = KINDS,
    deadline: float = float("inf"),
) -> dict[str, bool]:
    """The kernel (each way of unpacking) against the dequantizing path on this
    device, each kind while `time.perf_counter()` is before `deadline`; prints
    each. Returns whether each way is right."""
    right: dict[str, bool] = dict.fromkeys(UNPACKS, True)
    failed: set[str] = set()
    key = jax.random.key(0)
    kernel = jax.jit(_int4_kernel.int4_matmul, static_argnums=(2, 3, 4))
    for kind in kinds:
        if time.perf_counter() > deadline:
            print(f"check {kind}: skipped (the time is up)")
            continue
        q = layer(jax.random.fold_in(key, len(kind)), out, inputs, kind)
        x = jax.random.normal(jax.random.key(1), (batch, inputs), jnp.bfloat16)
        g = jax.random.normal(jax.random.key(2), (batch, out), jnp.bfloat16)
        assert _int4_kernel.applies(x, q.parts, q.scheme), kind
        for contract, v in (("in", x), ("out", g)):
            want = jax.jit(
                lambda v, p, c=contract: _dense_product(
                    v, QuantizedArray(p, q.scheme).dequantize(), c
                )
            )(v, q.parts)
            want = np.asarray(want, np.float32)
            for unpack in UNPACKS:
                try:
                    got = kernel(v, q.parts, q.scheme, contract, unpack)
                    got = np.asarray(got, np.float32)
                    error = float(np.abs(got - want).max() / np.abs(want).max())
                except Exception as e:  # a lowering the chip refuses: report, go on
                    got, error = want, float("inf")
                    if unpack not in failed:  # the first time only
                        failed.add(unpack)
                        print(f"{unpack}: {type(e).__name__}: {str(e)[:2000]}")
                good = error <= TOLERANCE and got.shape == want.shape
                right[unpack] &= good
                print(
                    f"check {kind:10s} {unpack:7s} "
                    f"{'forward' if contract == 'in' else 'gradient':8s} batch "
                    f"{batch}: max error {error:.2e} of the largest output"
                    f" {'ok' if good else 'WRONG'}",
                    flush=True,
                )
    return right


def timing(
    n: int,
    layers: int,
    cases: tuple[tuple[str, int], ...],
    rounds: int,
    unpacks: tuple[str, ...],
    deadline: float,
) -> bool:
    """Times `cases` (direction, batch) in turn while `time.perf_counter()` is
    before `deadline`; prints each. Returns whether the kernels' outputs after
    all layers are the dequantizing path's (within TOLERANCE)."""
    keys = jax.random.split(jax.random.key(3), layers)
    kept = [layer(k, n, n, "gptq") for k in keys]
    scheme = kept[0].scheme
    parts = [q.parts for q in kept]
    dense = [jax.jit(QuantizedArray.dequantize)(q) for q in kept]  # (out, in) bf16
    # the dense products contract the weights' leading axis: x @ w for the
    # forward with w (in, out), as a dense model holds it
    dense_in = [w.T.copy() for w in dense]
    jax.block_until_ready((parts, dense, dense_in))

    def run(product):
        def f(x, weights):
            for w in weights:
                x = jnp.tanh(product(x, w))
            return x

        return jax.jit(f)

    def dequantizing(contract):
        def product(x, p):
            w = QuantizedArray(p, scheme).dequantize()  # XLA fuses it into the dot
            return _dense_product(x, w, contract)

        return product

    def kernel(contract, unpack):
        def product(x, p):
            return _int4_kernel.int4_matmul(x, p, scheme, contract, unpack)

        return product

    fns = {
        contract: {
            "dense": (
                run(partial(_dense_product, contract="out")),
                dense_in if contract == "in" else dense,
            ),
            **{u: (run(kernel(contract, u)), parts) for u in unpacks},
            "xla": (run(dequantizing(contract)), parts),
        }
        for contract in ("in", "out")
    }
    ok = True
    for contract, batch in cases:
        if time.perf_counter() > deadline:
            print(f"{contract} batch {batch}: skipped (the time is up)")
            continue
        try:
            ok &= _case(fns[contract], contract, batch, n, layers, rounds, unpacks)
        except Exception as e:  # a shape the chip refuses: report, go on
            ok = False
            print(f"{contract} batch {batch}: {type(e).__name__}: {str(e)[:2000]}")
    return ok


def formats(n: int, layers: int, unpack: str, deadline: float) -> None:
    """The forward at batch 8 with the kernel on each checkpoint format's own
    packing (compressed-tensors' words are transposed in every call, see
    bridge/_kept/_int4_kernel.py), as multiples of the dense time; prints it
    unless `time.perf_counter()` is past `deadline`."""
    if time.perf_counter() > deadline:
        print("formats: skipped (the time is up)")
        return
    keys = jax.random.split(jax.random.key(4), layers)
    x = jax.random.normal(jax.random.key(5), (8, n), jnp.bfloat16)
    fns = {}
    for kind in ("gptq", "ct zero"):
        kept = [layer(k, n, n, kind) for k in keys]

        def f(x, parts, scheme=kept[0].scheme):
            for p in parts:
                x = jnp.tanh(_int4_kernel.int4_matmul(x, p, scheme, "in", unpack))
            return x

        fns[kind] = (jax.jit(f), [q.parts for q in kept])
    dense = [jnp.ones((n, n), jnp.bfloat16) / n for _ in keys]
    fns["dense"] = (jax.jit(lambda x, ws: _chain(x, ws)), dense)
    try:
        times = interleaved(
            {
                k: lambda f=f, w=w: jax.block_until_ready(f(x, w))
                for k, (f, w) in fns.items()
            },
            10,
        )
    except Exception as e:
        print(f"formats: {type(e).__name__}: {str(e)[:2000]}")
        return
    d = times.pop("dense")
    shown = ", ".join(f"{k} {t / d:.2f}x" for k, t in times.items())
    print(f"forward  batch    8, kernel ({unpack}) on each format: {shown}", flush=True)


def _chain(x: jax.Array, weights: list[jax.Array]) -> jax.Array:
    for w in weights:
        x = jnp.tanh(_dense_product(x, w, "out"))
    return x


def _case(
    chosen: dict[str, Any],
    contract: str,
    batch: int,
    n: int,
    layers: int,
    rounds: int,
    unpacks: tuple[str, ...],
) -> bool:
    x = jax.random.normal(jax.random.key(batch), (batch, n), jnp.bfloat16)
    outs = {name: f(x, w) for name, (f, w) in chosen.items()}  # compiles
    want = np.asarray(outs["xla"], np.float32)
    errors, ok = [], True
    for u in (*unpacks, "dense"):
        got = np.asarray(outs[u], np.float32)
        error = float(np.abs(got - want).max() / np.abs(want).max())
        ok &= error <= TOLERANCE
        errors.append(f"{u} {error:.1e}")
    times = interleaved(
        {
            name: lambda f=f, w=w: jax.block_until_ready(f(x, w))
            for name, (f, w) in chosen.items()
        },
        rounds,
    )
    d = times["dense"]
    kernels = ", ".join(f"kernel ({u}) {times[u] / d:.2f}x" for u in unpacks)
    print(
        f"{'forward ' if contract == 'in' else 'gradient'} batch {batch:4d}: "
        f"dense {d * 1e3:7.3f} ms, {kernels}, XLA dequantize "
        f"{times['xla'] / d:.2f}x (max error after {layers} layers: "
        f"{', '.join(errors)})",
        flush=True,
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 layer; CPU: tiny")
    parser.add_argument(
        "--seconds", type=float, default=60, help="the timing's budget (step 2)"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    print(f"{backend()}, JAX {jax.__version__}", flush=True)
    if jax.default_backend() == "tpu":  # the kernel's body is the same for all kinds
        right = check(2816, 5632, 33, KINDS[:1])
        unpacks = tuple(u for u in UNPACKS if right[u])
        cases = (
            ("in", 8),
            ("out", 8),
            ("in", 64),
            ("in", 1024),
            ("out", 64),
            ("out", 1024),
        )
        layers = 1 if args.quick else 16
        ok = all(right.values())
        if unpacks:
            ok &= timing(5632, layers, cases, 20, unpacks, start + args.seconds)
        print(f"({time.perf_counter() - start:.0f} s) the other kinds:", flush=True)
        more = check(2816, 5632, 33, KINDS[1:], start + args.seconds + 12)
        ok &= all(more.values())
        if unpacks:
            formats(5632, layers, unpacks[-1], start + args.seconds + 20)
    else:  # a smoke run: the kernel in Pallas's interpreter, tiny shapes
        with _fp8_kernel.interpreted():
            right = check(256, 384, 9, ("gptq", "ct zero"))
            ok = all(right.values())
            ok &= timing(256, 1, (("in", 8),), 2, UNPACKS, start + 60)
            formats(256, 1, "pairs", start + 60)
        print("(not a TPU: the kernel ran in Pallas's interpreter; times mean nothing)")
    took = time.perf_counter() - start
    print(f"{'all checks ok' if ok else 'A CHECK FAILED'} ({took:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
