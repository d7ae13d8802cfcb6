"""The port's plan at the speed of the bytes (issue 50): bridge against transformers'
own PyTorch-to-Flax loading, as a model gets deeper and as it gets bigger.

Three measures, each side in a fresh process (imports untimed), rounds interleaved,
medians; the Flax model is transformers' own `FlaxLlamaForCausalLM` (transformers
4.x: v5 has no Flax classes), given as bridge's target with its abstract variables
and the example inputs it is called with (`ids, mask, positions`), so that both
forward passes are traced and paired (what `example=` costs):

- **depth**: a tiny Llama folder (`save_pretrained`) of 4 / 16 / 64 layers:
  `bridge.load(folder, like=(module, variables), example=...)` against
  `FlaxLlamaForCausalLM.from_pretrained(folder, from_pt=True)`; the ratio at the
  deepest, and each side's cost per added layer (16 -> 64). Goal: <= 1.5x.
- **port**: `bridge.port(torch_model, (module, variables), example=...)` against
  transformers' `convert_pytorch_state_dict_to_flax` + `jnp.asarray` of every
  array, a ~450 MiB Llama (quick: ~25 MiB). Goal: <= 1.2x.
- **load**: `bridge.load(folder, like=..., example=...)` of a ~1.6 GiB folder (quick:
  ~64 MiB) against the bytes' floor, `safetensors.numpy.load_file` of its shards.
  Goal: <= 1.5x.

    python benchmarks/port_depth.py            # full (minutes)
    python benchmarks/port_depth.py --quick    # 4 / 16 layers, small sizes

Imports are untimed on every side: bridge's lazy modules, and transformers'
PyTorch Llama class, which bridge builds (on the meta device) to trace a folder's
model; the example inputs are made before the clock starts too.

Measured (2 shared cores, transformers 4.57; medians of interleaved rounds):

| measure | 8963ebd | f48e4e1 | now | goal |
|---|---|---|---|---|
| depth, 64 layers: bridge / transformers | 1.03 | 0.51 | 0.17-0.26 | 1.5 |
| ms per added layer (16 -> 64): bridge | 53 | 45 | 10-18 | |
| ms per added layer (16 -> 64): transformers | 13 | 34 | 3-23 | |
| port, ~450 MiB: bridge / convert | 2.42 | 1.67 | 1.02-1.39 (1.05) | 1.2 |
| load, ~1.6 GiB: bridge / floor | 2.25 | 1.83 | 1.22-1.27 | 1.5 |

8963ebd (the round's start): one round of an earlier version of this script, which
timed the example inputs' creation and the import of transformers' PyTorch Llama
on bridge's side. f48e4e1 (issue 50's first stop): this script, 3 rounds, on a busy
machine. Now: 3 to 5 rounds, three or four runs (the port's middle run in
parentheses). transformers' cost per layer is within its noise (about 4 s, most of
it the XLA compilations of its random initialisation, which `from_pt=True` cannot
skip: `_do_init=False` is refused with it). The port's spread is its trace, the
model's first PyTorch pass in the process (the first touch of every weight, and
PyTorch's first calls): 0.11-0.45 s from one process to the next, 0.07-0.09 s when
run again in one process.

What changed since f48e4e1: a meta pass through `torch.autocast(device_type="meta")`
(it ran again on fake tensors, 5-10x slower: 1.0 s of 64 layers), a Linen model's
setups walked once per kind of block, which layer feeds which as one product of bit
matrices, and a port's layout copies of a module's weights on both threads (they
waited for a budget meant for lazily read bytes: one copy at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
BATCH, SEQ = 1, 8
GOALS = {"depth": 1.5, "port": 1.2, "load": 1.5}


def config(layers: int, dim: int = 16, vocab: int = 128):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        # transformers' Flax rotary table keeps only max_position_embeddings of
        # its head_dim columns (`out[:, :, :num_pos]`): at least one per column
        max_position_embeddings=max(64, dim),
        tie_word_embeddings=False,
    )


def sizes(measure: str, quick: bool) -> list[tuple[int, int, int]]:
    """`(layers, dim, vocab)` per model of a measure."""
    if measure == "depth":
        return [(n, 16, 128) for n in ((4, 16) if quick else (4, 16, 64))]
    if measure == "port":
        return [(4, 256, 4096)] if quick else [(8, 1024, 16384)]
    return [(4, 512, 8192)] if quick else [(16, 1536, 16384)]


def write(folder: Path, layers: int, dim: int, vocab: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(layers, dim, vocab))
    model.save_pretrained(folder, max_shard_size="200MB")


def example():
    import jax.numpy as jnp

    ids = jnp.zeros((BATCH, SEQ), jnp.int32)
    mask = jnp.ones((BATCH, SEQ), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
    return ids, mask, positions


def flax_like(layers: int, dim: int, vocab: int):
    """transformers' Flax Llama module and its abstract variables."""
    import jax
    import transformers

    module = transformers.FlaxLlamaForCausalLM(
        config(layers, dim, vocab), _do_init=False
    ).module
    variables = jax.eval_shape(lambda: module.init(jax.random.key(0), *example()))
    return module, variables


def prepare(side: str, folder: Path, size: tuple[int, int, int]):
    """`side`'s timed call, everything before it done."""
    import jax
    import jax.numpy as jnp

    if side == "floor":
        import safetensors.numpy

        files = sorted(folder.glob("*.safetensors"))
        return lambda: [safetensors.numpy.load_file(f) for f in files]
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    if side == "transformers":
        cls = transformers.FlaxLlamaForCausalLM
        return lambda: cls.from_pretrained(folder, from_pt=True)
    if side == "convert":
        from transformers.modeling_flax_pytorch_utils import (
            convert_pytorch_state_dict_to_flax,
        )

        torch_model = transformers.LlamaForCausalLM.from_pretrained(folder)
        flax_model = transformers.FlaxLlamaForCausalLM(config(*size))
        state = torch_model.state_dict()

        def convert():
            params = convert_pytorch_state_dict_to_flax(state, flax_model)
            return jax.block_until_ready(jax.tree.map(jnp.asarray, params))

        return convert
    import bridge

    # the lazy imports, untimed too: bridge's modules, and transformers' PyTorch
    # Llama, which bridge builds (on the meta device) to trace the folder's model
    bridge.load, bridge.port, transformers.LlamaForCausalLM
    like = flax_like(*size)
    given = example()  # the inputs a user has at hand (made by XLA: 0.09 s)
    if side == "bridge-port":
        torch_model = transformers.LlamaForCausalLM.from_pretrained(folder)

        def port():
            _, variables = bridge.port(torch_model, like, example=given)
            return jax.block_until_ready(variables)

        return port

    def load():
        _, variables = bridge.load(folder, like=like, example=given)
        return jax.block_until_ready(variables)

    return load


def child(side: str, folder: Path, size: tuple[int, int, int]) -> None:
    run = prepare(side, folder, size)
    start = time.perf_counter()
    run()
    print(json.dumps({"seconds": time.perf_counter() - start}))


def timed(side: str, folder: Path, size: tuple[int, int, int]) -> float:
    command = [sys.executable, __file__, "--child", side, "--dir", str(folder)]
    command += ["--size", ",".join(map(str, size))]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{side} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


SIDES = {
    "depth": ("bridge", "transformers"),
    "port": ("bridge-port", "convert"),
    "load": ("bridge", "floor"),
}


def measure(name: str, quick: bool, rounds: int) -> list[dict]:
    rows = []
    for size in sizes(name, quick):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write(folder, *size)
            times: dict[str, list[float]] = {s: [] for s in SIDES[name]}
            for _ in range(rounds):
                for side in SIDES[name]:
                    times[side].append(timed(side, folder, size))
        med = {s: statistics.median(t) for s, t in times.items()}
        a, b = SIDES[name]
        rows.append({"size": size, **med, "ratio": med[a] / med[b]})
        print(
            f"{name} {size[0]} layers, dim {size[1]}: {a} {med[a]:.2f} s, "
            f"{b} {med[b]:.2f} s, ratio {med[a] / med[b]:.2f}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measures", default="depth,port,load")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.dir, tuple(map(int, args.size.split(","))))
        return
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        print("port_depth needs torch and transformers 4.x (for their Flax Llama)")
        return
    if not hasattr(transformers, "FlaxLlamaForCausalLM"):
        print(f"transformers {transformers.__version__} has no Flax classes: use 4.x")
        return
    measures = []
    for name in args.measures.split(","):
        rows = measure(name, args.quick, args.rounds)
        measures.append(
            {"measure": f"{name}: {SIDES[name][0]} / {SIDES[name][1]}",
             "now": round(rows[-1]["ratio"], 2), "goal": GOALS[name]}
        )  # fmt: skip
        if name == "depth" and len(rows) > 1:
            (n0, *_), (n1, *_) = rows[-2]["size"], rows[-1]["size"]
            for side in SIDES[name]:
                per = (rows[-1][side] - rows[-2][side]) / (n1 - n0) * 1000
                print(f"depth: {side} {per:.1f} ms per added layer ({n0} -> {n1})")
    if args.json:
        print(json.dumps({"benchmark": "port_depth", "measures": measures}))


if __name__ == "__main__":
    main()
