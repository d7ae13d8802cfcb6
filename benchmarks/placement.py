"""Loading a large model into an abstract sharded target: peak host memory.

A Linen MLP (8 Dense layers, 8192 wide: 2 GiB of float32) is saved as safetensors by
one process; fresh processes with 8 CPU devices (a (4, 2) mesh) then load it into an
abstract target (`jax.eval_shape` / `nnx.eval_shape`, every array a `ShapeDtypeStruct`
with a `NamedSharding`), so the model is never materialised unsharded:

- `load` (Linen target, the file's own framework): each array read once and sent to
  the devices shard by shard;
- `port` (`load` into an NNX target: another framework): the file ported while it is
  read, each array read when its layer is converted, placed, then dropped.

Each child reports the peak RSS (VmHWM) above its RSS before the load, as a multiple
of the model's size (target for both: <= 1.2), and checks that every array has its
target's sharding. The children run interleaved (`--runs` of each); medians.

    python benchmarks/placement.py [--quick] [--runs N]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _common import reset_peak, rss


DEPTH = 8


def child(mode, width, path):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import bridge

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(DEPTH):
                x = nn.Dense(width)(x)
            return x

    if mode == "save":
        x = jnp.ones((1, width))
        bridge.save(path, MLP().init(jax.random.key(0), x))
        return
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def sharded(x):
        spec = P("data", "model") if len(x.shape) == 2 else P("model")
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, spec)
        )

    if mode == "load":
        init = jax.eval_shape(MLP().init, jax.random.key(0), jnp.ones((1, width)))
        target = jax.tree_util.tree_map(sharded, init)
    else:

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.List(
                    [nnx.Linear(width, width, rngs=rngs) for _ in range(DEPTH)]
                )

        graphdef, state = nnx.split(nnx.eval_shape(lambda: Net(nnx.Rngs(0))))
        target = nnx.merge(graphdef, jax.tree_util.tree_map(sharded, state))
    before = rss("VmRSS")
    reset_peak()  # VmHWM: from the current RSS on
    out = bridge.load(path, like=target)
    peak = rss("VmHWM")
    want = jax.tree_util.tree_leaves(bridge.to_neutral(target))
    got = jax.tree_util.tree_leaves(bridge.to_neutral(out))
    placed = all(
        a.sharding.is_equivalent_to(b.sharding, len(b.shape))
        for a, b in zip(got, want, strict=True)
    )
    print(json.dumps({"above": peak - before, "peak": peak, "placed": placed}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3, help="runs of each (median)")
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.child[2])
    width = 1024 if args.quick else 8192
    model = DEPTH * width * (width + 1) * 4
    results = {"load": [], "port": []}

    def run(mode, path):
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, str(width), path],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return out.strip().splitlines()[-1] if out.strip() else ""

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mlp.safetensors")
        run("save", path)
        for _ in range(args.runs):
            for mode in results:
                results[mode].append(json.loads(run(mode, path)))
    print(
        f"a {model / 2**30:.2f} GiB Linen MLP into an abstract target on a (4, 2) "
        f"mesh, medians of {args.runs} interleaved runs"
    )
    for mode, runs in results.items():
        above = statistics.median(r["above"] for r in runs) / model
        peak = statistics.median(r["peak"] for r in runs) / model
        print(
            f"{mode:<5} peak RSS above the start {above:5.2f}x the model "
            f"(whole process {peak:5.2f}x), every array placed: "
            f"{all(r['placed'] for r in runs)}"
        )
    print("target: <= 1.2x")


if __name__ == "__main__":
    main()
