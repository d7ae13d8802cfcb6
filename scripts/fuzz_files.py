"""Fuzz bridge's readers with damaged files: GGUF files, safetensors headers and
sharded indexes, each a valid file with bytes flipped or cut off.

Every damaged file is loaded (`bridge.load(path)`, every array read) and inspected
(`bridge inspect`) in a fresh process (forked from a server that imported bridge
once, so that no load sees another's state), under a memory cap (`RLIMIT_AS`) and a
timeout. A load may succeed (the damage hit array bytes) or be refused with a
`bridge.CheckpointError`; anything else is a crash (another exception, a signal, a
memory error: a header believed) and a timeout is a hang. Prints one line per kind
of file and mutation and exits 1 on any crash or hang, listing each with the seed
and index that rebuild it:

    python scripts/fuzz_files.py                      # 300 files of each kind
    python scripts/fuzz_files.py --files 20 --kinds safetensors,sharded
    python scripts/fuzz_files.py --only gguf:truncate:17 --seed 0   # one case again

Kinds: `safetensors` (a bridge file and a PyTorch-layout one: bytes of the 8-byte
length and the JSON header flipped, or the file cut), `sharded` (a Hugging Face
folder of three shards: its `model.safetensors.index.json` flipped or cut, or a
shard's header flipped), `gguf` (a llama file with string, integer and array
key-values and F32, F16 and Q8_0 tensors: bytes of its header, key-values and tensor
infos flipped, a length set to an extreme, or the file cut; needs `gguf`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import shutil
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple


ROOT = Path(__file__).resolve().parent.parent
MUTATIONS = ("flip", "extreme", "truncate", "json")
KINDS = ("safetensors", "sharded", "gguf")


class Case(NamedTuple):
    kind: str
    mutation: str
    index: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.mutation}:{self.index}"


class Outcome(NamedTuple):
    case: Case
    result: str  # "loaded", "refused", "crash", "hang"
    detail: str


# --- the valid files ------------------------------------------------------------------


def _seed_safetensors(directory: Path) -> list[Path]:
    import ml_dtypes
    import numpy as np

    import bridge

    rng = np.random.default_rng(0)
    tree = {
        "params": {
            "Dense_0": {
                "kernel": rng.normal(size=(4, 3)).astype(np.float32),
                "bias": np.zeros(3, np.float16),
            },
            "Embed_0": {
                "embedding": rng.normal(size=(5, 4)).astype(ml_dtypes.bfloat16)
            },
        },
        "batch_stats": {"BatchNorm_0": {"mean": np.ones(3, np.float32)}},
    }
    own = directory / "bridge.safetensors"
    bridge.save(own, tree)
    plain = directory / "torch.safetensors"
    bridge.save_state_dict(plain, {"params": tree["params"]})
    return [own, plain]


def _seed_sharded(directory: Path) -> Path:
    import numpy as np

    import bridge

    tree = {
        "params": {
            f"Dense_{i}": {"kernel": np.full((8, 8), i, np.float32)} for i in range(3)
        }
    }
    folder = directory / "folder"
    bridge.save_pretrained(folder, tree, max_shard_size=300)
    return folder


def _seed_gguf(directory: Path) -> Path:
    import gguf
    import numpy as np

    path = directory / "llama.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_string("general.name", "fuzz")
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("token_embd.weight", rng.normal(size=(8, 32)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, np.float16))
    q = rng.normal(size=(32, 32)).astype(np.float32)
    writer.add_tensor(
        "blk.0.attn_q.weight",
        gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- damage ---------------------------------------------------------------------------


def _header_end(kind: str, data: bytes) -> int:
    """Where the part a reader parses ends: a safetensors file's JSON header, a GGUF
    file's data section (its header, key-values and tensor infos before it), an
    index's whole text."""
    if kind == "safetensors":
        return min(len(data), 8 + int.from_bytes(data[:8], "little"))
    if kind == "gguf":
        return _gguf_data_start(data)
    return len(data)


def _gguf_data_start(data: bytes) -> int:
    """The offset of a valid GGUF v3 file's data section (alignment 32)."""
    (count, kvs) = struct.unpack_from("<QQ", data, 8)
    at = 24

    def string(at: int) -> int:
        (n,) = struct.unpack_from("<Q", data, at)
        return at + 8 + n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(kind: int, at: int) -> int:
        if kind == 8:
            return string(at)
        if kind == 9:
            item, n = struct.unpack_from("<IQ", data, at)
            at += 12
            for _ in range(n):
                at = value(item, at)
            return at
        return at + sizes[kind]

    for _ in range(kvs):
        at = string(at)
        (kind,) = struct.unpack_from("<I", data, at)
        at = value(kind, at + 4)
    for _ in range(count):
        at = string(at)
        (dims,) = struct.unpack_from("<I", data, at)
        at += 4 + 8 * dims + 4 + 8
    return at + (-at % 32)


_EXTREMES = (
    b"\xff" * 8,
    b"\x7f" + b"\xff" * 7,
    b"\x00" * 8,
    struct.pack("<Q", 2**31),
    struct.pack("<Q", 2**63),
    struct.pack("<q", -1),
)


_VALUES = (
    -1,
    0,
    2**31,
    2**63,
    2**64 + 1,
    10**400,
    1.5,
    -0.0,
    1e308,
    "",
    "..",
    "../../etc/passwd",
    "\x1b[2J",
    "x" * 10_000,
    None,
    True,
    [],
    {},
    [[[[[[[[]]]]]]]],
    {"a": {"b": {"c": 1}}},
)


def _json_damaged(text: bytes, rng: random.Random) -> bytes | None:
    """`text` (JSON) with one value replaced by a hostile one (a huge, negative or
    fractional number, a path, an escape, another type), a key dropped, or a
    nested JSON string (bridge's metadata) damaged the same way; None if `text`
    is no JSON object."""
    import json

    try:
        root = json.loads(text)
    except ValueError:
        return None
    nodes: list[tuple[Any, Any]] = []  # (container, key)

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            nodes.append((node, key))
            if isinstance(child, (dict, list)):
                walk(child)

    if not isinstance(root, (dict, list)):
        return None
    walk(root)
    if not nodes:
        return None
    container, key = rng.choice(nodes)
    value = container[key]
    inner = None
    if isinstance(value, str) and value[:1] in "[{" and rng.random() < 0.7:
        inner = _json_damaged(value.encode(), rng)
    if inner is not None:
        container[key] = inner.decode()
    elif isinstance(container, dict) and rng.random() < 0.2:
        del container[key]
    else:
        container[key] = rng.choice(_VALUES)
    return json.dumps(root).encode()


def damaged(kind: str, data: bytes, mutation: str, rng: random.Random) -> bytes:
    """`data` (a valid file of `kind`) damaged by `mutation`: `flip` (1 to 8 bytes of
    its parsed part replaced by random ones, or one bit flipped), `extreme` (8
    bytes of it set to a length or count no file has), `truncate` (cut anywhere),
    `json` (a safetensors header or an index: one value of its JSON replaced by a
    hostile one, `_json_damaged`; a GGUF file: `extreme`)."""
    out = bytearray(data)
    end = _header_end(kind, data)
    if mutation == "json" and kind == "safetensors":
        header = _json_damaged(data[8:end], rng)
        if header is not None:
            return struct.pack("<Q", len(header)) + header + data[end:]
    if mutation == "json" and kind == "sharded":
        text = _json_damaged(data, rng)
        if text is not None:
            return text
    if mutation in ("json", "extreme") and kind == "gguf":
        mutation = "extreme"
    if mutation == "truncate":
        return bytes(out[: rng.randrange(len(out))])
    if mutation == "extreme":
        at = rng.randrange(max(1, end - 8))
        value = rng.choice(_EXTREMES)
        out[at : at + 8] = value
        return bytes(out)
    for _ in range(rng.randint(1, 8)):
        at = rng.randrange(end)
        if rng.random() < 0.5:
            out[at] ^= 1 << rng.randrange(8)
        else:
            out[at] = rng.randrange(256)
    return bytes(out)


def write_case(case: Case, seed: int, seeds: dict[str, Any], into: Path) -> Path:
    """The damaged file (or folder) of `case` under `into`, rebuilt from `seed`."""
    rng = random.Random(f"{seed}:{case}")
    if case.kind == "safetensors":
        source = rng.choice(seeds["safetensors"])
        path = into / source.name
        path.write_bytes(
            damaged("safetensors", source.read_bytes(), case.mutation, rng)
        )
        return path
    if case.kind == "gguf":
        source = seeds["gguf"]
        path = into / source.name
        path.write_bytes(damaged("gguf", source.read_bytes(), case.mutation, rng))
        return path
    folder = into / "folder"
    shutil.copytree(seeds["sharded"], folder)
    index = folder / "model.safetensors.index.json"
    if rng.random() < 0.75:  # the index
        index.write_bytes(damaged("sharded", index.read_bytes(), case.mutation, rng))
    else:  # a shard's header
        shard = rng.choice(sorted(folder.glob("model-*.safetensors")))
        data = damaged("safetensors", shard.read_bytes(), case.mutation, rng)
        shard.write_bytes(data)
    return folder


# --- one load in a fresh process ------------------------------------------------------


def _load(path: str, memory: int, pipe: Any) -> None:
    """In the child: cap the memory, then load and inspect `path`; send the outcome."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    try:
        import contextlib
        import io

        import jax

        import bridge
        from bridge import _cli

        tree = bridge.load(path)
        jax.block_until_ready(jax.tree.leaves(tree))
        with contextlib.redirect_stdout(io.StringIO()):
            with contextlib.redirect_stderr(io.StringIO()) as err:
                code = _cli.main(["inspect", path])
        if code != 0:  # inspect refused what load read
            pipe.send(("crash", f"inspect exited {code}: {err.getvalue()[-300:]}"))
            return
        pipe.send(("loaded", ""))
    except BaseException as e:  # noqa: BLE001  (every outcome is reported)
        import bridge

        kind = "refused" if isinstance(e, bridge.CheckpointError) else "crash"
        pipe.send((kind, f"{type(e).__module__}.{type(e).__name__}: {e}"[:600]))


def _context() -> Any:
    """Processes forked from a server that imported bridge (and gguf) once."""
    import importlib.util

    import bridge

    context = multiprocessing.get_context("forkserver")
    modules = {
        importlib.util.resolve_name(m, "bridge") for m in bridge._PUBLIC.values()
    }
    preload = ["bridge", "bridge._cli", *sorted(modules), "jax.numpy"]
    try:
        import gguf  # noqa: F401

        preload.append("gguf")
    except ImportError:
        pass
    context.set_forkserver_preload(preload)
    return context


def run(
    cases: list[Case],
    seed: int = 0,
    workers: int = 2,
    memory_gb: float = 6.0,
    timeout: float = 60.0,
    report: Callable[[Outcome], None] = lambda _: None,
) -> list[Outcome]:
    """Load each of `cases` in a fresh process, `workers` at a time; the outcomes."""
    context = _context()
    memory = int(memory_gb * 2**30)
    out: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="bridge-fuzz-") as tmp:
        root = Path(tmp)
        seeds = _seeds(root / "seeds", {c.kind for c in cases})
        pending = list(enumerate(cases))
        running: dict[int, tuple[Case, Any, Any, float, Path]] = {}
        while pending or running:
            while pending and len(running) < workers:
                n, case = pending.pop(0)
                into = root / f"case{n}"
                into.mkdir()
                path = write_case(case, seed, seeds, into)
                receive, send = context.Pipe(duplex=False)
                proc = context.Process(target=_load, args=(str(path), memory, send))
                proc.start()
                send.close()
                running[n] = (case, proc, receive, time.monotonic(), into)
            time.sleep(0.01)
            for n, (case, proc, receive, started, into) in list(running.items()):
                outcome = None
                if receive.poll():
                    try:
                        result, detail = receive.recv()
                    except EOFError:
                        result, detail = "crash", "the process ended with no outcome"
                    proc.join(timeout)
                    outcome = Outcome(case, result, detail)
                elif not proc.is_alive():
                    code = proc.exitcode
                    outcome = Outcome(case, "crash", f"exit code {code}, no outcome")
                elif time.monotonic() - started > timeout:
                    proc.kill()
                    proc.join()
                    outcome = Outcome(case, "hang", f"still running after {timeout} s")
                if outcome is not None:
                    receive.close()
                    shutil.rmtree(into, ignore_errors=True)
                    del running[n]
                    out.append(outcome)
                    report(outcome)
    return out


def _seeds(directory: Path, kinds: set[str]) -> dict[str, Any]:
    directory.mkdir()
    seeds: dict[str, Any] = {}
    if "safetensors" in kinds:
        seeds["safetensors"] = _seed_safetensors(directory)
    if "sharded" in kinds:
        seeds["sharded"] = _seed_sharded(directory)
    if "gguf" in kinds:
        seeds["gguf"] = _seed_gguf(directory)
    return seeds


def cases(kinds: list[str], files: int) -> list[Case]:
    """`files` cases of each kind, the mutations in turn."""
    return [
        Case(kind, MUTATIONS[i % len(MUTATIONS)], i)
        for kind in kinds
        for i in range(files)
    ]


def table(outcomes: list[Outcome]) -> Iterator[str]:
    counts = Counter((o.case.kind, o.case.mutation, o.result) for o in outcomes)
    groups = sorted({(o.case.kind, o.case.mutation) for o in outcomes})
    yield (
        f"{'kind':12} {'mutation':9} {'files':>5} {'loaded':>6} {'refused':>7} "
        "crashes hangs"
    )
    for kind, mutation in groups:
        n = [counts[kind, mutation, r] for r in ("loaded", "refused", "crash", "hang")]
        yield (f"{kind:12} {mutation:9} {sum(n):5} {n[0]:6} {n[1]:7} {n[2]:7} {n[3]:5}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=300, help="files of each kind")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-gb", type=float, default=6.0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a load")
    parser.add_argument("--only", help="one case, as printed: KIND:MUTATION:INDEX")
    args = parser.parse_args(argv)
    if args.only:
        kind, mutation, index = args.only.split(":")
        todo = [Case(kind, mutation, int(index))]
    else:
        todo = cases(args.kinds.split(","), args.files)
    started = time.monotonic()
    outcomes = run(todo, args.seed, args.workers, args.memory_gb, args.timeout)
    for line in table(outcomes):
        print(line)
    bad = [o for o in outcomes if o.result in ("crash", "hang")]
    for o in bad:
        print(f"{o.result}: {o.case} (--seed {args.seed}): {o.detail}")
    print(
        f"{len(outcomes)} files in {time.monotonic() - started:.0f} s: "
        f"{sum(o.result == 'crash' for o in outcomes)} crashes, "
        f"{sum(o.result == 'hang' for o in outcomes)} hangs"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
