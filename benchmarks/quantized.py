"""Load a block-scaled FP8 checkpoint (1 GiB once dequantized to bfloat16) into an
abstract bfloat16 NNX model, against the same model's plain bfloat16 checkpoint:
`bridge.load(folder, like=nnx.eval_shape(...))` for both.

The FP8 folder is laid out as DeepSeek-V3's: LAYERS `nn.Linear(N, N, bias=False)`
weights `float8_e4m3fn` `(out, in)` with float32 `weight_scale_inv`
`(N / 128, N / 128)`, in shards of SHARD_LAYERS layers with a
`model.safetensors.index.json`, and `config.json`'s `quantization_config` (the FP8
values are random bytes, NaN codes excluded: the load's cost does not depend on them).
bridge dequantizes each weight when its layer is ported, then transposes and places
it.

Each load runs in a fresh subprocess (FP8, bf16, FP8, ...): its time and the peak
anonymous resident memory (RssAnon + RssShmem, as the other load benchmarks count it;
RssAnon alone before 2026-12-02) above the process's just before the load, as a
multiple of the target model's bytes; medians over the rounds.

    python benchmarks/quantized.py             # 1 GiB dequantized, 3 rounds
    python benchmarks/quantized.py --quick     # 64 MiB (a smoke run)

`--keep` measures instead what `load(..., keep_quantized=True)` saves when the model
runs: the FP8 folder loaded dequantized and kept quantized, then the compiled memory
of a forward pass (`jax.jit(f).lower(...).compile().memory_analysis()`: arguments +
outputs + temporaries, the buffers XLA allocates) and of a LoRA `bridge.make_step`
(rank 8 on every layer), kept vs dequantized; once with XLA CPU's default scheduler
(which runs independent work early, for concurrency) and once with its memory
scheduler (`XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false`), each
in a fresh process.

    python benchmarks/quantized.py --keep      # 256 MiB dequantized
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from _common import sampled
from flax import nnx

import bridge


LAYERS, SHARD_LAYERS = 16, 4
DTYPE = jnp.float32 if "--f32" in sys.argv else jnp.bfloat16


def width(size_mb: int) -> int:
    """N for LAYERS bfloat16 (N, N) weights of `size_mb` in all, a multiple of 128."""
    return int((size_mb * 2**20 / LAYERS / 2) ** 0.5) // 128 * 128


def _write(folder: Path, n: int, fp8: bool) -> None:
    rng = np.random.default_rng(0)
    weight_map = {}
    for s in range(0, LAYERS, SHARD_LAYERS):
        shard = {}
        for i in range(s, s + SHARD_LAYERS):
            name = f"layers.{i}.weight"
            if fp8:
                codes = rng.integers(0, 0x7F, (n, n), dtype=np.uint8)  # no NaN
                codes |= rng.integers(0, 2, (n, n), dtype=np.uint8) << 7  # signs
                shard[name] = codes.view(ml_dtypes.float8_e4m3fn)
                scale = rng.uniform(1e-4, 1e-3, (n // 128, n // 128))
                shard[name + "_scale_inv"] = scale.astype(np.float32)
            else:
                values = rng.standard_normal((n, n), np.float32) * 0.02
                shard[name] = values.astype(ml_dtypes.bfloat16)
        file = f"model-{s // SHARD_LAYERS + 1:05d}.safetensors"
        safetensors.numpy.save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"dtype": "bfloat16"}
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    (folder / "config.json").write_text(json.dumps(config))


class Model(nnx.Module):
    def __init__(self, n: int):
        kw = dict(use_bias=False, param_dtype=DTYPE, dtype=DTYPE)
        self.layers = nnx.List(
            [nnx.Linear(n, n, rngs=nnx.Rngs(i), **kw) for i in range(LAYERS)]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _compiled_bytes(lowered) -> int:
    """Arguments + outputs + temporaries of a compiled computation (donated
    arguments aliased by outputs counted once)."""
    m = lowered.compile().memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def keep_child(folder: Path, n: int) -> None:
    """Forward and LoRA-step compiled bytes, dequantized then kept (one process)."""
    import optax

    abstract = nnx.eval_shape(lambda: Model(n))
    x = jnp.ones((8, n), DTYPE)
    out = {}
    for keep in (False, True):
        model = bridge.load(folder, like=abstract, dtype=DTYPE, keep_quantized=keep)
        forward = jax.jit(lambda m, x: bridge.dequantize(m)(x))
        out[f"forward_{keep}"] = _compiled_bytes(forward.lower(model, x))
        adapted = bridge.lora(model, "layers", rank=8, key=jax.random.key(0))
        tree = bridge.to_neutral(adapted)
        spec = bridge.trainable(tree, "lora")
        step = bridge.make_step(
            lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2), optax.adam(1e-3), spec
        )
        opt_state = step.init(tree)
        out[f"step_{keep}"] = _compiled_bytes(step.lower(tree, opt_state, x))
        del model, adapted, tree, opt_state
    print(json.dumps(out))


def keep_main(n: int) -> None:
    import os

    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        folder = Path(tmp, "fp8")
        folder.mkdir()
        _write(folder, n, True)
        runs = {}
        for name, flags in (("default", ""), ("memory", MEMORY_SCHEDULER)):
            env = dict(os.environ)
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
            done = subprocess.run(
                [sys.executable, __file__, "--keep-child", str(folder), "--n", str(n)]
                + (["--f32"] if DTYPE == jnp.float32 else []),
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    dense = LAYERS * n * n * jnp.dtype(DTYPE).itemsize
    print(
        f"{LAYERS} Linear({n}, {n}) {jnp.dtype(DTYPE).name} "
        f"({dense / 2**20:,.0f} MiB dense), FP8 "
        "128x128 blocks; compiled bytes (arguments + outputs + temporaries), batch 8"
    )
    for name, r in runs.items():
        for what in ("forward", "step"):
            d, k = r[f"{what}_False"], r[f"{what}_True"]
            print(
                f"{name:7s} scheduler {what:7s} dequantized {d / 2**20:8,.1f} MiB  "
                f"kept {k / 2**20:8,.1f} MiB  kept/dequantized {k / d:4.2f}"
            )


def child(folder: Path, n: int) -> None:
    abstract = nnx.eval_shape(lambda: Model(n))
    jax.numpy.zeros(1).block_until_ready()  # the JAX backend, up before measuring

    def load():
        model = bridge.load(folder, like=abstract)
        model.layers[-1].kernel[...].block_until_ready()
        return model

    measured = sampled(load)
    print(json.dumps({"seconds": measured.seconds, "extra": measured.extra}))


def run(folder: Path, n: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(folder), "--n", str(n)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB dequantized")
    parser.add_argument("--size-mb", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--keep", action="store_true", help="forward/step memory, keep_quantized"
    )
    parser.add_argument("--f32", action="store_true", help="--keep: a float32 model")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--keep-child", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(Path(args.child), args.n)
        return
    if args.keep_child is not None:
        keep_child(Path(args.keep_child), args.n)
        return
    if args.keep:
        keep_main(width(args.size_mb or (16 if args.quick else 256)))
        return
    n = width(args.size_mb or (64 if args.quick else 1024))
    target = LAYERS * n * n * 2
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        fp8, bf16 = Path(tmp, "fp8"), Path(tmp, "bf16")
        for folder, quantized in ((fp8, True), (bf16, False)):
            folder.mkdir()
            _write(folder, n, quantized)
        results: dict[Path, list[dict]] = {fp8: [], bf16: []}
        for _ in range(args.rounds):
            for folder in (fp8, bf16):
                results[folder].append(run(folder, n))
    print(
        f"{LAYERS} Linear({n}, {n}) in {LAYERS // SHARD_LAYERS} shards, target "
        f"{target / 2**20:,.0f} MiB bfloat16; {args.rounds} interleaved rounds, medians"
    )
    rows = {}
    for label, folder in (("FP8 block-scaled", fp8), ("bfloat16", bf16)):
        seconds = statistics.median(r["seconds"] for r in results[folder])
        extra = statistics.median(r["extra"] for r in results[folder])
        rows[label] = seconds
        print(
            f"{label:17s} load {seconds:6.2f}s  peak RSS above start "
            f"{extra / 2**20:,.0f} MiB = {extra / target:4.2f}x the target"
        )
    ratio = rows["FP8 block-scaled"] / rows["bfloat16"]
    print(f"time FP8 / bfloat16: {ratio:4.2f}")


if __name__ == "__main__":
    main()
