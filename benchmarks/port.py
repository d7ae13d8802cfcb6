"""Port a large float32 model Linen -> Equinox: throughput and peak memory.

Each measurement runs in its own subprocess, so that its peak resident set size
(Linux `VmHWM`, reset through `/proc/self/clear_refs` just before the timed part) is
its own. Runs alternate (numpy, port, numpy, port, ...); the figures are medians:

- throughput: port's bytes/s as a fraction of a plain numpy transpose-copy
  (`np.ascontiguousarray(a.T)`) of the same arrays (goal >= 0.5);
- peak RSS over model size: the process's peak during the port, minus its size
  before the source model existed (interpreter and JAX), over the model's size: the
  source (1x) and the ported copy (1x) are both resident (goal <= 2.2).

The Equinox target is abstract (`eqx.filter_eval_shape`), so it costs no memory.
With `--stacked`, the source is one `nn.scan` stack (`blocks.Dense_0.kernel` of shape
`(layers, n, n)`) and the target a list of per-layer Equinox Linears: each layer is a
slice of the stack, so the peak is the source, the ported copy and about one layer.

    python benchmarks/port.py            # ~1 GB, 4 layers
    python benchmarks/port.py --stacked --layers 8
    python benchmarks/port.py --quick    # 16 MB smoke run (fixed costs dominate)
    python benchmarks/port.py --size-mb 512 --layers 2 --repeats 5

Measured on a 2-core machine shared with other jobs (1 GiB, 4 layers): port 3.3-4.8 s
vs numpy 10.8-14.1 s for the transpose-copy, throughput ratio 2.9-3.2; peak RSS 2.08x
the model. `--stacked --layers 8` (1 GiB, medians of 3 interleaved runs, load average
about 5): port 1.97 s vs numpy 1.70 s, ratio 0.86; peak RSS 2.18x the model (+1.13x
during the port: the ported copy and about one layer; numpy 2.05x, +1.00x). Each
source layer is sliced and transposed in one XLA computation, and the timed check
reads the source through a numpy view: the 2.29x measured before counted a JAX slice
of one layer made by the check itself (at 512 MiB, with the check fixed, the old and
the new port both peak at 2.23x). At 256 MiB: ratio 0.70, peak 2.71x (fixed costs
weigh more).
`--trace` (1 GiB, 4 layers, medians of 3 interleaved runs, load average 11-12):
the trace itself, timed inside the port (both sides' `first_uses`), 483 ms = 4.0%
of that port (10.9 s), whatever the weights' size (16 MiB: 89 ms); the whole ports
differ by more than that from run to run: with example= where the trace pairs
+9.4%, where names decide (no trace is made at all) +27.9%; in an earlier run of 3
-11.6% and -2.1%. So the +55% of a run of 2 (load above 10) was noise, and the
figure to read is the trace's own share.
`--json` prints the ratios as one JSON line, in `benchmarks/table.py`'s format.
`--to-stacked`: per-layer Equinox Linears into an abstract Linen `nn.scan` stack (the
port fills a fresh stack in place, layer by layer, the old stack donated; each layer
is transposed inside that write, one XLA computation per layer shape).
Issue 28's goal for a stacked <-> per-layer port, peak <= the model + one layer + 10%,
read as what the port allocates (the source is the caller's and stays whole; a port
that consumed it is not offered): 1 GiB, 8 layers (goal 1.225x), 3 interleaved runs
in fresh processes, load 1.5-6.6: per-layer -> stack +1.00x (peak 2.05-2.06x with
the source; numpy's transpose into a preallocated stack also +1.00x), within the
goal; before, each layer was transposed into an array of its own and then written,
+1.26x (2.31x) in all 3 runs (and 2 more). Time: the transpose fused into the write
is slower than XLA's own transpose: in 2 pairs at load 2.2-2.6 the port took 4.39 s
and 4.12 s (0.93x and 0.88x numpy's throughput) against 3.08 s and 3.47 s before
(1.24x, 1.37x); still above the 0.5 goal. Stack -> per-layer +1.13x (peak 2.18x),
unchanged.
XLA's tiled transpose beats numpy's strided
copy; under load a full run takes 1-3 minutes (each subprocess imports JAX and
builds 1 GiB).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

from _common import reset_peak, rss


def _result(seconds, nbytes, base, before, traced=0.0) -> dict:
    """One run's figures: its peak RSS over the model's bytes, counted from `base` (the
    interpreter, JAX and bridge, no model yet) and from `before` (the source in memory,
    just before the port)."""
    peak = rss("VmHWM")
    return {
        "seconds": seconds,
        "bytes": nbytes,
        "peak_over_model": (peak - base) / nbytes,
        "extra_over_model": (peak - before) / nbytes,
        "trace_seconds": traced,
    }


def _to_stack_worker(kind: str, size_mb: float, layers: int) -> dict:
    """Per-layer Equinox Linears -> an abstract Linen `nn.scan` stack
    (`blocks.Dense_0.kernel` of shape `(layers, n, n)`): the port fills the stack in
    place, layer by layer."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import bridge

    jnp.zeros(1).block_until_ready()
    base = rss("VmRSS")
    n = int((size_mb * 2**20 / 4 / layers) ** 0.5)
    abstract = eqx.filter_eval_shape(
        lambda: eqx.nn.Sequential(
            [eqx.nn.Linear(n, n, key=jax.random.key(i)) for i in range(layers)]
        )
    )
    count = iter(range(2 * layers))

    def fill(leaf):  # each array from numpy, its values telling it apart
        i = next(count)
        return jnp.asarray(
            np.arange(np.prod(leaf.shape), dtype=np.float32) + i
        ).reshape(leaf.shape)

    source = jax.tree_util.tree_map(fill, abstract)
    arrays = jax.tree_util.tree_leaves(source)
    nbytes = sum(a.nbytes for a in arrays)
    stack = {
        "kernel": jax.ShapeDtypeStruct((layers, n, n), jnp.float32),
        "bias": jax.ShapeDtypeStruct((layers, n), jnp.float32),
    }
    target = {"params": {"blocks": {"Dense_0": stack}}}
    jax.block_until_ready(arrays)
    # warm up the conversions' compilation on a tiny model (3 layers: one reading)
    small = eqx.nn.Sequential(
        [eqx.nn.Linear(2, 2, key=jax.random.key(i)) for i in range(3)]
    )
    tiny = {
        "kernel": jax.ShapeDtypeStruct((3, 2, 2), jnp.float32),
        "bias": jax.ShapeDtypeStruct((3, 2), jnp.float32),
    }
    jax.block_until_ready(bridge.port(small, {"params": {"blocks": {"Dense_0": tiny}}}))
    import gc

    gc.collect()
    reset_peak()
    before = rss("VmRSS")
    start = time.perf_counter()
    if kind == "numpy":  # each layer's weight transposed into one stacked array
        out = np.empty((layers, n, n), np.float32)
        for i, layer in enumerate(source.layers):
            out[i] = np.asarray(layer.weight).T
    else:
        out = jax.block_until_ready(bridge.port(source, target))
        kernel = out["params"]["blocks"]["Dense_0"]["kernel"]
        first = np.asarray(source.layers[1].weight)
        assert kernel.shape == (layers, n, n)
        assert float(kernel[1, 0, 1]) == float(first[1, 0])
    seconds = time.perf_counter() - start
    del out
    return _result(seconds, nbytes, base, before)


def _worker(kind: str, size_mb: float, layers: int, stacked: bool) -> dict:
    import equinox as eqx
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    import bridge

    jnp.zeros(1).block_until_ready()  # start the CPU backend
    base = rss("VmRSS")  # the interpreter, JAX and its backend, bridge: no model yet

    n = int((size_mb * 2**20 / 4 / layers) ** 0.5)
    params = {}
    if stacked:  # nn.scan's layout: one array per name, the layer axis first
        flat = np.arange(layers * n * n, dtype=np.float32).reshape(layers, n, n)
        kernel = jnp.asarray(flat)
        del flat
        bias = jnp.zeros((layers, n), jnp.float32)
        params = {"blocks": {"Dense_0": {"kernel": kernel, "bias": bias}}}
    # "traced": names that do not pair (`layer_z`, `layer_y`, ... applied in that
    # order, the dict sorted as after an optax step): only the trace orders them
    names = [f"layer_{chr(ord('z') - i)}" for i in range(layers)]
    for i in range(0 if stacked else layers):
        kernel = jnp.asarray(np.arange(n * n, dtype=np.float32).reshape(n, n) + i)
        name = names[i] if kind == "traced" else f"Dense_{i}"
        params[name] = {"kernel": kernel, "bias": jnp.zeros(n, jnp.float32)}
    if kind == "traced":
        params = dict(sorted(params.items()))
    variables = {"params": params}

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for name in names[:layers]:
                x = nn.Dense(n, name=name)(x)
            return x

    example = jax.ShapeDtypeStruct((1, n), jnp.float32)  # batched, as compare's
    arrays = jax.tree_util.tree_leaves(variables)
    nbytes = sum(a.nbytes for a in arrays)
    target = eqx.filter_eval_shape(
        lambda: eqx.nn.Sequential(
            [eqx.nn.Linear(n, n, key=jax.random.key(i)) for i in range(layers)]
        )
    )
    jax.block_until_ready(arrays)
    # warm up the transposes' compilation on a tiny model
    small = {"params": {"Dense_0": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}}
    jax.block_until_ready(
        bridge.port(small, eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    )
    # the trace's own time, measured inside the port (both sides' first_uses)
    import bridge._port._trace as trace_module

    tracing, first_uses = [0.0], trace_module.first_uses

    def timed_first_uses(*a, **k):
        begin = time.perf_counter()
        try:
            return first_uses(*a, **k)
        finally:
            tracing[0] += time.perf_counter() - begin

    trace_module.first_uses = timed_first_uses
    traced = 0.0
    import gc

    gc.collect()
    reset_peak()  # VmHWM: from the current RSS on
    before = rss("VmRSS")
    start = time.perf_counter()
    if kind == "numpy":
        if stacked:  # each layer's kernel transposed, as the port does
            out = [
                np.ascontiguousarray(np.asarray(a)[i].T)
                for a in arrays
                for i in range(layers)
            ]
        else:
            out = [np.ascontiguousarray(np.asarray(a).T) for a in arrays]
    elif kind == "traced":
        source = (MLP(), variables)
        out = jax.block_until_ready(bridge.port(source, target, example=example))
        traced = tracing[0]
    elif kind == "named":  # example inputs given, names decide: no trace is made
        out = jax.block_until_ready(bridge.port(variables, target, example=example))
    else:
        out = jax.block_until_ready(bridge.port(variables, target))
    if kind != "numpy":
        check = out.layers[1].weight
        # numpy views of the source (a JAX slice would be a copy of one layer)
        first = (
            np.asarray(params["blocks"]["Dense_0"]["kernel"])[1]
            if stacked
            else np.asarray(
                params[names[1] if kind == "traced" else "Dense_1"]["kernel"]
            )
        )
        assert check.shape == (n, n) and float(check[0, 1]) == float(first[1, 0])
    seconds = time.perf_counter() - start
    del out
    return _result(seconds, nbytes, base, before, traced)


def _run(kind: str, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--size-mb",
        str(args.size_mb),
        "--layers",
        str(args.layers),
        *(["--stacked"] if args.stacked else []),
        *(["--to-stacked"] if args.to_stacked else []),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="16 MB, 1 repeat")
    parser.add_argument(
        "--stacked", action="store_true", help="an nn.scan stack -> per-layer Equinox"
    )
    parser.add_argument(
        "--to-stacked",
        action="store_true",
        help="per-layer Equinox -> an abstract nn.scan Linen stack",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="also print the ratios as one JSON line",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also port with example inputs: names that do not pair (the trace "
        "orders them), and Dense_i names (they decide: no trace)",
    )
    parser.add_argument(
        "--worker",
        choices=["numpy", "port", "traced", "named"],
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    if args.worker:
        if args.to_stacked:
            result = _to_stack_worker(args.worker, args.size_mb, args.layers)
        else:
            result = _worker(args.worker, args.size_mb, args.layers, args.stacked)
        print(json.dumps(result))
        return
    if args.quick:
        args.size_mb, args.repeats = 16, 1
    runs = {"numpy": [], "port": []}
    if args.trace:
        runs.update(traced=[], named=[])
    for _ in range(args.repeats):  # interleaved: numpy, port, numpy, port, ...
        for kind in runs:
            runs[kind].append(_run(kind, args))
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in v[0]}
        for k, v in runs.items()
    }
    size = med["port"]["bytes"] / 2**20
    if args.to_stacked:
        what = "Equinox -> one Linen nn.scan stack"
    else:
        what = (
            "Linen (one nn.scan stack) -> Equinox"
            if args.stacked
            else "Linen -> Equinox"
        )
    print(f"model: {args.layers} Dense layers, {size:.0f} MiB float32, {what}")
    for kind, m in med.items():
        rate = m["bytes"] / m["seconds"] / 2**30
        print(
            f"  {kind:6s} median {m['seconds'] * 1e3:8.1f} ms  {rate:6.2f} GiB/s  "
            f"peak RSS {m['peak_over_model']:.2f}x model "
            f"(+{m['extra_over_model']:.2f}x during the copy)"
        )
    ratio = med["numpy"]["seconds"] / med["port"]["seconds"]
    print(f"port throughput / numpy transpose-copy: {ratio:.2f}  (goal >= 0.5)")
    peak = med["port"]["peak_over_model"]
    print(f"port peak RSS / model size: {peak:.2f}  (goal <= 2.2)")
    # issue 28: a stacked <-> per-layer port's peak <= the model + one layer + 10%,
    # read as what the port itself allocates (the source stays the caller's)
    extra = med["port"]["extra_over_model"]
    one_layer = 1 + 1 / args.layers + 0.1
    stacking = args.stacked or args.to_stacked
    if stacking:
        print(
            f"port allocates {extra:.2f}x the model (goal <= {one_layer:.2f}x: the "
            "ported copy, one layer, 10%)"
        )
    if args.json:  # benchmarks/table.py's format
        what = (
            "to_stacked" if args.to_stacked else "stacked" if args.stacked else "port"
        )
        measures = [
            {
                "measure": f"{what}: throughput / numpy transpose-copy",
                "now": round(ratio, 2),
                "goal": 0.5,
                "better": "higher",
            },
            {
                "measure": f"{what}: peak RSS / model",
                "now": round(peak, 2),
                "goal": 2.2,
            },
        ]
        if stacking:
            measures.append(
                {
                    "measure": f"{what}: allocated / model ({args.layers} layers)",
                    "now": round(extra, 2),
                    "goal": round(one_layer, 3),
                }
            )
        print(json.dumps({"benchmark": "port", "measures": measures}))
    if args.trace:
        for kind, what in (("traced", "paired by the trace"), ("named", "names")):
            extra = med[kind]["seconds"] / med["port"]["seconds"] - 1
            print(f"port with example= ({what}) / port: {extra:+.1%}  (goal <= 10%)")
        share = med["traced"]["trace_seconds"] / med["traced"]["seconds"]
        print(
            f"the trace itself (both forward passes, timed inside the port): "
            f"{med['traced']['trace_seconds'] * 1e3:.0f} ms, {share:.1%} of that "
            "port (goal <= 10%)"
        )


if __name__ == "__main__":
    main()
