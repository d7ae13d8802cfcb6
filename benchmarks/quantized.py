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
from _common import backend, compiled_bytes, interleaved, sampled
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
BATCHES = (8, 1024)


def keep_child(folder: Path, n: int, rounds: int) -> None:
    """Forward (batch 8 and 1024) and LoRA-step compiled bytes and median times,
    dequantized (a dense model) then kept (`bridge.quantized_matmuls`; the step
    through `bridge.make_step`), interleaved, in this process."""
    import optax

    abstract = nnx.eval_shape(lambda: Model(n))
    out: dict = {"backend": backend()}
    forwards, steps, outputs = {}, {}, []
    probe = jax.random.normal(jax.random.key(0), (BATCHES[0], n), DTYPE)
    for keep in (False, True):
        model = bridge.load(folder, like=abstract, dtype=DTYPE, keep_quantized=keep)
        forward = jax.jit(bridge.quantized_matmuls(lambda m, x: m(x)))
        first = jax.jit(bridge.quantized_matmuls(lambda m, x: m.layers[0](x)))
        outputs.append(np.asarray(first(model, probe), np.float32))
        for b in BATCHES:
            x = jnp.ones((b, n), DTYPE)
            out[f"forward{b}_{keep}"] = compiled_bytes(forward.lower(model, x))
            forwards[f"forward{b}_{keep}"] = _runner(forward, model, x)
        adapted = bridge.lora(model, "layers", rank=8, key=jax.random.key(0))
        tree = bridge.to_neutral(adapted)
        spec = bridge.trainable(tree, "lora")
        step = bridge.make_step(
            lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2),
            optax.adam(1e-3),
            spec,
            donate=False,
        )
        opt_state = step.init(tree)
        x = jnp.ones((BATCHES[-1], n), DTYPE)
        out[f"step_{keep}"] = compiled_bytes(step.lower(tree, opt_state, x))
        steps[f"step_{keep}"] = _runner(step, tree, opt_state, x)
    # kept vs dequantizing: the first layer's outputs for one random batch (16
    # layers of random weights amplify any rounding: not a measure of the product)
    difference = np.abs(outputs[1] - outputs[0]).max() / np.abs(outputs[0]).max()
    out["forward_max_difference"] = float(difference)
    for fns in (forwards, steps):
        for name, seconds in interleaved(fns, rounds, warmup=2).items():
            out[name + "_s"] = seconds
    print(json.dumps(out))


def _runner(fn, *args):
    return lambda: jax.block_until_ready(fn(*args))


GOALS = {"forward8 time": 0.8, "forward1024 time": 1.2, "step memory": 0.6}
GOALS["step time"] = 1.3


def keep_main(n: int, rounds: int, as_json: bool) -> None:
    import os

    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        folder = Path(tmp, "fp8")
        folder.mkdir()
        _write(folder, n, True)
        runs = {}
        for name, flags in (("default", ""), ("memory", MEMORY_SCHEDULER)):
            if name == "memory" and not runs["default"]["backend"].startswith("cpu"):
                break  # XLA CPU's flag (this process opens no backend: a child does)
            env = dict(os.environ)
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
            done = subprocess.run(
                [sys.executable, __file__, "--keep-child", str(folder), "--n", str(n)]
                + ["--rounds", str(rounds)]
                + (["--f32"] if DTYPE == jnp.float32 else []),
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    dense = LAYERS * n * n * jnp.dtype(DTYPE).itemsize
    print(
        f"{runs['default']['backend']}: {LAYERS} Linear({n}, {n}) "
        f"{jnp.dtype(DTYPE).name} ({dense / 2**20:,.0f} MiB dense), FP8 128x128 "
        f"blocks; XLA's footprint (arguments + outputs + temporaries) and median "
        f"time of {rounds} interleaved rounds; LoRA rank 8, adam, batch {BATCHES[-1]}"
    )
    print(
        "kept vs dequantizing, the first layer's outputs (batch 8, random): largest "
        "difference / largest output "
        f"{runs['default']['forward_max_difference']:.2e}"
    )
    measures = []
    for name, r in runs.items():
        for what in [f"forward{b}" for b in BATCHES] + ["step"]:
            d, k = r[f"{what}_False"], r[f"{what}_True"]
            ds, ks = r[f"{what}_False_s"], r[f"{what}_True_s"]
            print(
                f"{name:7s} scheduler {what:11s} dense {d / 2**20:8,.1f} MiB "
                f"{ds * 1e3:8.2f} ms  kept {k / 2**20:8,.1f} MiB {ks * 1e3:8.2f} ms  "
                f"kept/dense memory {k / d:4.2f} time {ks / ds:4.2f}"
            )
            for kind, ratio in (("memory", k / d), ("time", ks / ds)):
                goal = GOALS.get(f"{what} {kind}")
                if name == "default" and goal is not None:
                    measure = f"kept/dense {what} {kind}"
                    measures.append({"measure": measure, "now": ratio, "goal": goal})
    if as_json:
        report = {"benchmark": "quantized", "platform": runs["default"]["backend"]}
        print(json.dumps({**report, "measures": measures}))


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
    parser.add_argument("--json", action="store_true", help="--keep: a JSON line")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--keep-child", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(Path(args.child), args.n)
        return
    if args.keep_child is not None:
        keep_child(Path(args.keep_child), args.n, args.rounds)
        return
    if args.keep:
        size = args.size_mb or (16 if args.quick else 256)
        keep_main(width(size), args.rounds, args.json)
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
