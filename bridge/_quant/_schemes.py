"""Which tensors of a PyTorch-layout checkpoint are quantized weights, and how.

A quantized weight is stored as several tensors (its companions) and is read as one:

- `fp8-block`: `weight` float8 with `weight_scale_inv` `(ceil(out/128), ceil(in/128))`
  (`quant_method: fp8`, its `weight_block_size`);
- `fp8`: `weight` float8 with `weight_scale` `(1,)`, `(out, 1)` or per group;
- `int`: `weight` int8 with `weight_scale` (and `weight_zero_point`): compressed-tensors
  `int-quantized`;
- `int-packed`: `weight_packed` int32, `weight_scale`, `weight_shape` (and
  `weight_zero_point`, `weight_g_idx`): compressed-tensors' `pack-quantized` (its
  config group's `num_bits`, `symmetric`, `actorder`);
- `gptq`: `qweight`, `qzeros`, `scales` (and `g_idx`): `quant_method: gptq` (`bits`
  2, 3, 4, 8, `group_size`, `checkpoint_format`, `desc_act`);
- `awq`: `qweight` `(in, out / 8)`, `qzeros`, `scales`: `quant_method: awq`
  (`bits` 4, `group_size`, `version: gemm`);
- `nvfp4`, `mxfp4`: `weight_packed` uint8, `weight_scale` (and `weight_global_scale`):
  compressed-tensors' `nvfp4-pack-quantized`, `mxfp4-pack-quantized`;
- `mxfp4-blocks`: `<name>_blocks` and `<name>_scales` uint8: gpt-oss's experts
  (`quant_method: mxfp4`).

`recognise` finds them from the tensor names, shapes and dtypes and the folder's
`quantization_config` (`config.json`), and refuses, naming each tensor and what is
missing, anything it cannot establish: a quantized tensor is never read as dense.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeGuard

import numpy as np

from .._families import _experts
from .._io._errors import CheckpointError
from . import _awq, _fp4, _fp8, _gptq, _packed


class Quantized(NamedTuple):
    """One quantized weight: `name` as a dense model has it (`...q_proj.weight`),
    its `scheme`, `bits` per value, dequantized `shape`, `parts` (`{part: stored
    tensor name}`: `weight`, `scale`, `zero`, `shape`, `g_idx`) and `settings`
    (`block`, `group_size`, `zero_plus_one`)."""

    name: str
    scheme: str
    bits: int
    shape: tuple[int, ...]
    parts: dict[str, str]
    settings: dict[str, Any]

    def describe(self) -> str:
        """`"fp8-block 128x128, 8-bit"`, `"int-packed group 32, 4-bit"`, ..."""
        extra = ""
        if "block" in self.settings:
            extra = " " + "x".join(map(str, self.settings["block"]))
        elif self.settings.get("group_size"):
            extra = f" group {self.settings['group_size']}"
        return f"{self.scheme}{extra}, {self.bits}-bit"


class Scan(NamedTuple):
    """What `recognise` found: the quantized weights by name, and the stored tensors
    that only describe them and are not read into a dense model (activation scales,
    KV-cache scales)."""

    quantized: dict[str, Quantized]
    dropped: frozenset[str]

    def hidden(self) -> set[str]:
        """Every stored name a dense reading does not show (parts and dropped)."""
        names = set(self.dropped)
        for q in self.quantized.values():
            names.update(q.parts.values())
        return names


class QuantizationError(CheckpointError):
    """A quantized tensor whose scheme cannot be established: nothing is loaded."""


_REFUSED = """\
{path}: {n} quantized tensor(s) cannot be read, so nothing was loaded (bridge never \
reads a quantized tensor as a dense one):
{problems}
A quantized checkpoint is described by the `quantization_config` of the config.json \
next to it (as Hugging Face's save_pretrained writes it): load the folder, or the file \
with its config.json beside it."""

_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
# stored next to a quantized weight, needed by no dense model
_ACTIVATION = (
    "input_scale",
    "activation_scale",
    "input_zero_point",
    "input_global_scale",
)
_KV = ("k_scale", "v_scale")

Stored = Mapping[str, tuple[tuple[int, ...], str]]
"""`{stored name: (shape, dtype name)}`."""


def recognise(
    path: Any,
    tensors: Stored,
    config: Mapping[str, Any] | None,
    read_small: Callable[[str], np.ndarray],
) -> Scan:
    """The quantized weights among `tensors`.

    **Arguments:**

    - `path`: the checkpoint, for messages.
    - `tensors`: `{name: (shape, dtype name)}` as stored.
    - `config`: the `quantization_config` of the folder's `config.json`, or None.
    - `read_small`: reads a stored tensor (used for compressed-tensors'
      `weight_shape`, two integers).

    **Returns:** a `Scan`.

    **Raises:** `QuantizationError` listing every tensor that looks quantized but
    cannot be read: an FP8 weight without its scale (in a checkpoint that declares
    quantization), a scale of the wrong shape, a scale without its weight, packed
    integers without a config saying how they were packed, a scheme not supported.
    """
    config = dict(config or {})
    method = str(config.get("quant_method", ""))
    modules: dict[str, dict[str, str]] = {}
    for name in tensors:
        prefix, _, part = name.rpartition(".")
        modules.setdefault(prefix, {})[part] = name
    declared = bool(method) or any(
        part in ("weight_scale_inv", "weight_scale", "qweight", "weight_packed")
        for parts in modules.values()
        for part in parts
    )
    problems: list[str] = []
    found: dict[str, Quantized] = {}
    dropped: set[str] = set()
    for prefix, parts in modules.items():
        blocks = _blocks(prefix, parts, tensors, method)
        rest = {p: n for p, n in parts.items() if not _in(n, blocks)}
        one = _module(prefix, rest, tensors, config, method, declared, read_small)
        for q in [*blocks, one]:
            if isinstance(q, Quantized):
                q = _check_parts(q, tensors)
            if isinstance(q, str):
                problems.append(q)
            elif q is not None:
                found[q.name] = q
    for prefix, parts in modules.items():
        weight = _join(prefix, "weight")
        for part, name in parts.items():
            if part in _ACTIVATION and weight in found:
                dropped.add(name)
            elif part in _KV and declared:
                dropped.add(name)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise QuantizationError(
            _REFUSED.format(path=path, n=len(problems), problems=lines)
        )
    return Scan(found, frozenset(dropped))


_FLOATS = ("float32", "float16", "bfloat16", "float64")
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
# the dtypes each part of a scheme may have, as its library writes them (a weight's
# own dtype decides its scheme, so it is checked there); bool is never an integer
_PART_DTYPES: dict[str, dict[str, tuple[str, ...]]] = {
    "fp8-block": {"scale": _FLOATS},
    "fp8": {"scale": _FLOATS, "zero": _INTS + _FP8},
    "int": {"scale": _FLOATS, "zero": _INTS},
    "int-packed": {"scale": _FLOATS, "zero": _INTS, "shape": _INTS},
    "gptq": {"weight": ("int32",), "zero": ("int32",), "scale": _FLOATS},
    "awq": {"weight": ("int32",), "zero": ("int32",), "scale": _FLOATS},
}


def _check_parts(q: Quantized, tensors: Stored) -> Quantized | str:
    """`q`, or the problem with its parts' dtypes (a float `qweight` read as packed
    integers would be a silent wrong weight) or its zero point's shape."""
    for part, allowed in _PART_DTYPES.get(q.scheme, {}).items():
        name = q.parts.get(part)
        if name is not None and tensors[name][1] not in allowed:
            return (
                f"{name}: {tensors[name][1]}, but a {q.scheme} {part} is "
                f"{' or '.join(allowed)}"
            )
    zero, scale = q.parts.get("zero"), q.parts.get("scale")
    if (
        zero is not None
        and scale is not None
        and q.scheme in ("fp8", "int", "int-packed")
    ):
        want = tuple(tensors[scale][0])
        got = tuple(tensors[zero][0])
        packed = (math.ceil(want[0] * q.bits / 32), *want[1:]) if want else want
        if got != want and not (q.scheme == "int-packed" and got == packed):
            return f"{zero}: shape {got}, but its weight_scale is {want}"
    return q


_GPT_OSS = """\
{name}: gpt-oss's MXFP4 experts are not read yet (bridge reads gpt-oss's packed \
{weight}, (experts, D, 2F) with gate and up columns interleaved, from dense files \
only): save the model dequantized first, e.g. with transformers' \
from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True)) then \
save_pretrained"""


def _in(name: str, found: list[Quantized | str]) -> bool:
    return any(isinstance(q, Quantized) and name in q.parts.values() for q in found)


def _blocks(
    prefix: str, parts: Mapping[str, str], tensors: Stored, method: str
) -> list[Quantized | str]:
    """gpt-oss's MXFP4 experts of module `prefix`: `<name>_blocks` with
    `<name>_scales`, both uint8 (each a weight or the problem)."""
    out: list[Quantized | str] = []
    for part, name in parts.items():
        if not part.endswith("_blocks") or tensors[name][1] != "uint8":
            continue
        base = part.removesuffix("_blocks")
        scales = parts.get(base + "_scales")
        if method != "mxfp4":
            if scales is not None and tensors[scales][1] == "uint8":
                out.append(
                    f"{name}: uint8 blocks with {base}_scales (MXFP4, as gpt-oss "
                    "stores its experts), but no quantization_config with quant_method "
                    "'mxfp4'"
                )
            continue
        if scales is None:
            out.append(f"{name}: MXFP4 blocks without {_join(prefix, base)}_scales")
            continue
        shape, scale_shape = tuple(tensors[name][0]), tuple(tensors[scales][0])
        if len(shape) != 4 or shape[-1] != 16 or shape[:-1] != scale_shape:
            out.append(
                f"{name}: shape {shape} with {base}_scales {scale_shape}, expected "
                "(experts, out, groups, 16) with (experts, out, groups)"
            )
            continue
        experts, rows, groups, _ = shape
        dense = (experts, groups * 32, rows)
        kept = {"weight": name, "scale": scales}
        weight = _join(prefix, base)
        if _experts.has_packed([weight]):
            out.append(_GPT_OSS.format(name=name, weight=weight))
            continue
        out.append(
            Quantized(weight, "mxfp4-blocks", 4, dense, kept, {"group_size": 32})
        )
    return out


def _integer(value: Any) -> TypeGuard[int]:
    """An int from JSON (not a bool, not `4.0`)."""
    return isinstance(value, int) and not isinstance(value, bool)


# a block of more values than this is a config that lies: a block of [1, 2**31]
# would make a weight's scale grid the weight's size
_MOST_BLOCK = 1 << 16


def _join(prefix: str, part: str) -> str:
    return f"{prefix}.{part}" if prefix else part


def _module(
    prefix: str,
    parts: Mapping[str, str],
    tensors: Stored,
    config: Mapping[str, Any],
    method: str,
    declared: bool,
    read_small: Callable[[str], np.ndarray],
) -> Quantized | str | None:
    """The quantized weight of one module (its tensors `parts`), None for a dense
    one, or the problem."""
    weight = _join(prefix, "weight")
    if "qweight" in parts:
        return _gptq_weight(prefix, parts, tensors, config, method, read_small)
    if "weight_packed" in parts:
        return _packed_weight(prefix, parts, tensors, config, read_small)
    if "weight" not in parts:
        orphans = [
            n for p, n in parts.items() if p in ("weight_scale_inv", "weight_scale")
        ]
        if orphans:
            return f"{orphans[0]}: a scale without its weight (no {weight!r})"
        return None
    shape, dtype = tensors[weight]
    if "weight_scale_inv" in parts:
        if dtype not in _FP8:
            return f"{weight}: has a weight_scale_inv but is {dtype}, not FP8"
        return _fp8_block(weight, parts["weight_scale_inv"], shape, tensors, config)
    if "weight_scale" in parts:
        if dtype in _FP8:
            scheme, bits = "fp8", 8
        elif dtype == "int8":
            scheme, bits = "int", 8
        else:
            return f"{weight}: has a weight_scale but is {dtype}, not FP8 or int8"
        scale = parts["weight_scale"]
        problem = _scale_shape(weight, shape, scale, tensors[scale][0])
        if problem:
            return problem
        out = {"weight": weight, "scale": scale}
        if "weight_zero_point" in parts:
            out["zero"] = parts["weight_zero_point"]
        args = _ct_args(prefix, config) if method == "compressed-tensors" else ""
        if isinstance(args, dict):  # its activation order, if any
            problem = _ct_g_idx(weight, parts, tensors, args, shape, read_small)
        elif "weight_g_idx" in parts:
            groups = tensors[scale][0][-1]
            g_idx = parts["weight_g_idx"]
            problem = _g_idx(g_idx, tensors, read_small, shape[-1], groups)
        if problem:
            return problem
        if "weight_g_idx" in parts:
            out["g_idx"] = parts["weight_g_idx"]
        return Quantized(weight, scheme, bits, shape, out, {})
    if dtype in _FP8 and declared:
        return (
            f"{weight}: {dtype} without its scale (no "
            f"{_join(prefix, 'weight_scale_inv')!r} or "
            f"{_join(prefix, 'weight_scale')!r} in the checkpoint)"
        )
    return None


def _fp8_block(
    weight: str,
    scale: str,
    shape: tuple[int, ...],
    tensors: Stored,
    config: Mapping[str, Any],
) -> Quantized | str:
    block = config.get("weight_block_size")
    scale_shape = tensors[scale][0]
    if block is None:  # no config: the published default, if the grid fits it
        block = [128, 128]
        if tuple(scale_shape) != _fp8.grid(shape, (128, 128)):
            return (
                f"{weight}: its weight_scale_inv {tuple(scale_shape)} is not a 128x128 "
                "block grid and there is no quantization_config with weight_block_size"
            )
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(_integer(b) and 0 < b <= _MOST_BLOCK for b in block)
    ):
        return (
            f"{weight}: weight_block_size {block!r} is not two integers from 1 to "
            f"{_MOST_BLOCK:,}"
        )
    block = (int(block[0]), int(block[1]))
    if len(shape) < 2:
        return f"{weight}: a block-scaled FP8 weight must be 2-D, got shape {shape}"
    expected = _fp8.grid(shape, block)
    if tuple(scale_shape) != expected:
        return (
            f"{scale}: shape {tuple(scale_shape)}, but a weight {shape} in blocks of "
            f"{block[0]}x{block[1]} needs {expected}"
        )
    parts = {"weight": weight, "scale": scale}
    return Quantized(weight, "fp8-block", 8, shape, parts, {"block": block})


def _scale_shape(
    weight: str, shape: tuple[int, ...], scale: str, scale_shape: tuple[int, ...]
) -> str | None:
    """The problem with a per-tensor, per-row or per-group scale's shape, if any."""
    scale_shape = tuple(scale_shape)
    if math.prod(scale_shape) == 1 and len(scale_shape) <= 2:
        return None
    if len(shape) == 2 and len(scale_shape) == 2 and scale_shape[0] == shape[0]:
        if scale_shape[1] and shape[1] % scale_shape[1] == 0:
            return None
    return (
        f"{scale}: shape {scale_shape} does not scale a weight {shape} (per tensor: "
        f"(1,); per row: ({shape[0] if shape else 1}, 1); per group: (rows, groups) "
        "with groups dividing the columns)"
    )


def _ct_args(
    prefix: str, config: Mapping[str, Any], kind: str = "int"
) -> dict[str, Any] | str:
    """The compressed-tensors weight arguments of module `prefix` (`type` `kind`:
    `"int"` or `"float"`), or the problem."""
    groups = config.get("config_groups")
    if config.get("quant_method") != "compressed-tensors" or not isinstance(
        groups, dict
    ):
        return "no compressed-tensors quantization_config (with config_groups)"
    schemes = [g for g in groups.values() if isinstance(g, dict)]
    for g in schemes:
        targets = g.get("targets", [])
        if not isinstance(targets, list):
            return f"a config group's targets are {str(targets)[:60]}, not a list"
        for t in targets:
            if isinstance(t, str) and t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    return (
                        f"config group target {t[:60]!r} is no regular expression ({e})"
                    )
    by_regex = [
        g
        for g in schemes
        if any(
            isinstance(t, str) and t.startswith("re:") and re.match(t[3:], prefix)
            for t in g.get("targets", ())
        )
    ]
    by_class = [
        g
        for g in schemes
        if any(
            isinstance(t, str) and not t.startswith("re:") for t in g.get("targets", ())
        )
    ]
    chosen = by_regex or by_class
    if len(chosen) != 1:
        return (
            f"{'no' if not chosen else 'several'} config_groups target it "
            f"({len(schemes)} groups)"
        )
    args = chosen[0].get("weights")
    if not isinstance(args, dict) or args.get("type", "int") != kind:
        return f"its config group has no {kind} `weights` arguments"
    return {**args, "format": chosen[0].get("format") or config.get("format")}


def _ct_g_idx(
    name: str,
    parts: Mapping[str, str],
    tensors: Stored,
    args: Mapping[str, Any],
    shape: tuple[int, ...],
    read_small: Callable[[str], np.ndarray],
) -> str | None:
    """The problem with compressed-tensors' activation ordering of a weight of
    `shape` (`actorder: group` and its `weight_g_idx`), if any."""
    actorder = args.get("actorder")
    if "weight_g_idx" not in parts:
        if actorder in ("group", "dynamic", True):
            return f"{name}: actorder {actorder!r}, but no weight_g_idx"
        return None
    if args.get("strategy") != "group":
        strategy = args.get("strategy")
        return f"{parts['weight_g_idx']}: activation order, but strategy {strategy!r}"
    groups = tensors[parts["weight_scale"]][0]
    return _g_idx(parts["weight_g_idx"], tensors, read_small, shape[-1], groups[-1])


def _packed_weight(
    prefix: str,
    parts: Mapping[str, str],
    tensors: Stored,
    config: Mapping[str, Any],
    read_small: Callable[[str], np.ndarray],
) -> Quantized | str:
    packed = parts["weight_packed"]
    weight = _join(prefix, "weight")
    if tensors[packed][1] == "uint8":
        return _fp4_weight(prefix, parts, tensors, config)
    missing = [p for p in ("weight_scale", "weight_shape") if p not in parts]
    if missing:
        return f"{packed}: packed integers without {' and '.join(missing)}"
    if tensors[packed][1] != "int32":
        return (
            f"{packed}: {tensors[packed][1]} packing is not supported (int32 "
            "pack-quantized and uint8 NVFP4/MXFP4 are)"
        )
    args = _ct_args(prefix, config)
    if isinstance(args, str):
        return f"{packed}: packed integers, but {args}; bits per value unknown"
    bits = args.get("num_bits")
    if not _integer(bits) or not 1 <= bits <= 8:
        return f"{packed}: num_bits {bits!r} is not 1 to 8"
    stored_shape, stored_dtype = tensors[parts["weight_shape"]]
    if tuple(stored_shape) != (2,) or not stored_dtype.startswith(("int", "uint")):
        return (
            f"{parts['weight_shape']}: {stored_dtype} of shape {tuple(stored_shape)}, "
            "expected 2 integers (the weight's rows and columns, as compressed-tensors "
            "writes them): the file is not a pack-quantized checkpoint"
        )
    shape = tuple(int(v) for v in np.asarray(read_small(parts["weight_shape"])))
    packed_shape = tensors[packed][0]
    if min(shape) <= 0:
        return f"{parts['weight_shape']}: {shape[:4]} is not two positive sizes"
    if tuple(packed_shape) != (
        shape[0],
        math.ceil(shape[1] * bits / 32),
    ):
        return (
            f"{packed}: shape {tuple(packed_shape)} does not hold a weight {shape} "
            f"at {bits} bits"
        )
    problem = _scale_shape(
        weight, shape, parts["weight_scale"], tensors[parts["weight_scale"]][0]
    )
    if problem:
        return problem
    symmetric = args.get("symmetric", True)
    out = {
        "weight": packed,
        "scale": parts["weight_scale"],
        "shape": parts["weight_shape"],
    }
    if not symmetric:
        if "weight_zero_point" not in parts:
            return f"{packed}: asymmetric, but no weight_zero_point"
        out["zero"] = parts["weight_zero_point"]
    problem = _ct_g_idx(packed, parts, tensors, args, shape, read_small)
    if problem:
        return problem
    if "weight_g_idx" in parts:
        out["g_idx"] = parts["weight_g_idx"]
    settings = {"group_size": args.get("group_size")}
    return Quantized(weight, "int-packed", bits, shape, out, settings)


_FP4 = {  # compressed-tensors format: (scheme, group size, strategy, scale dtype)
    "nvfp4-pack-quantized": ("nvfp4", 16, "tensor_group", "float8_e4m3fn"),
    "mxfp4-pack-quantized": ("mxfp4", 32, "group", "uint8"),
}


def _fp4_weight(
    prefix: str, parts: Mapping[str, str], tensors: Stored, config: Mapping[str, Any]
) -> Quantized | str:
    """compressed-tensors' NVFP4 or MXFP4 packing (uint8 `weight_packed`)."""
    packed = parts["weight_packed"]
    args = _ct_args(prefix, config, "float")
    if isinstance(args, str):
        return f"{packed}: uint8 packed values (FP4?), but {args}"
    fmt = args.get("format")
    if not isinstance(fmt, str) or fmt not in _FP4:  # a list is unhashable
        known = ", ".join(_FP4)
        return (
            f"{packed}: uint8 packing of format {fmt!r} is not supported ({known} are)"
        )
    scheme, group, strategy, scale_dtype = _FP4[fmt]
    wanted = {
        "num_bits": 4,
        "group_size": group,
        "strategy": strategy,
        "symmetric": True,
    }
    for key, want in wanted.items():
        if args.get(key, True if key == "symmetric" else None) != want:
            return f"{packed}: {fmt} with {key} {args.get(key)!r}, expected {want!r}"
    needed = ["weight_scale"] + (["weight_global_scale"] if scheme == "nvfp4" else [])
    missing = [p for p in needed if p not in parts]
    if missing:
        return f"{packed}: {fmt} without {' and '.join(missing)}"
    rows_cols = tuple(tensors[packed][0])
    if len(rows_cols) != 2:
        return f"{packed}: shape {rows_cols}, expected (rows, cols / 2)"
    shape = (rows_cols[0], rows_cols[1] * 2)
    scale = parts["weight_scale"]
    expected: dict[str, tuple[tuple[int, ...], str]] = {
        scale: ((shape[0], shape[1] // group), scale_dtype)
    }
    if scheme == "nvfp4":
        expected[parts["weight_global_scale"]] = ((1,), "float32")
    for name, (want, dtype) in expected.items():
        got, got_dtype = tuple(tensors[name][0]), tensors[name][1]
        if shape[1] % group or got != want or got_dtype != dtype:
            return (
                f"{name}: {got_dtype} {got}, but a {fmt} weight {shape} needs "
                f"{dtype} {want}"
            )
    out = {"weight": packed, "scale": scale}
    if scheme == "nvfp4":
        out["global"] = parts["weight_global_scale"]
    return Quantized(
        _join(prefix, "weight"), scheme, 4, shape, out, {"group_size": group}
    )


def _gptq_weight(
    prefix: str,
    parts: Mapping[str, str],
    tensors: Stored,
    config: Mapping[str, Any],
    method: str,
    read_small: Callable[[str], np.ndarray],
) -> Quantized | str:
    qweight = parts["qweight"]
    missing = [p for p in ("qzeros", "scales") if p not in parts]
    if missing:
        return f"{qweight}: GPTQ/AWQ-packed without {' and '.join(missing)}"
    if method == "awq":
        return _awq_weight(prefix, parts, tensors, config)
    if method != "gptq":
        return (
            f"{qweight}: GPTQ-packed integers, but no quantization_config with "
            "quant_method 'gptq' or 'awq' says how they were packed"
        )
    bits, group_size = config.get("bits"), config.get("group_size", -1)
    if not _integer(bits) or bits not in (2, 3, 4, 8):
        return f"{qweight}: GPTQ with {bits!r} bits is not supported (2, 3, 4, 8 are)"
    if not _integer(group_size) or not (group_size == -1 or group_size > 0):
        return f"{qweight}: GPTQ group_size {group_size!r} is not -1 or positive"
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        return f"{qweight}: GPTQ checkpoint_format {fmt!r} is not supported"
    shape = tuple(tensors[qweight][0])
    if len(shape) != 2 or (shape[0] * 32) % bits:
        return (
            f"{qweight}: shape {shape}, expected (in * {bits} / 32, out) with a whole "
            "number of input rows"
        )
    packed_rows, out_features = shape
    in_features = packed_rows * 32 // bits
    groups = tensors[parts["scales"]][0]
    zeros = tensors[parts["qzeros"]][0]
    if len(groups) != 2 or groups[1] != out_features:
        expected = f"(groups, {out_features})"
        return f"{parts['scales']}: shape {tuple(groups)}, expected {expected}"
    if tuple(zeros) != (groups[0], math.ceil(out_features * bits / 32)):
        return (
            f"{parts['qzeros']}: shape {tuple(zeros)} does not match the scales "
            f"{tuple(groups)}"
        )
    out = {"weight": qweight, "zero": parts["qzeros"], "scale": parts["scales"]}
    if "g_idx" in parts:
        problem = _g_idx(parts["g_idx"], tensors, read_small, in_features, groups[0])
        if problem:
            return problem
        out["g_idx"] = parts["g_idx"]
    else:
        if config.get("desc_act"):
            return f"{qweight}: desc_act (activation order), but no {prefix}.g_idx"
        want = 1 if group_size == -1 else math.ceil(in_features / group_size)
        if groups[0] != want:
            return (
                f"{parts['scales']}: {groups[0]} groups, but {in_features} input rows "
                f"in groups of {group_size} need {want}"
            )
    settings = {"group_size": group_size, "zero_plus_one": fmt == "gptq"}
    weight = _join(prefix, "weight")
    return Quantized(weight, "gptq", bits, (out_features, in_features), out, settings)


def _g_idx(
    name: str,
    tensors: Stored,
    read_small: Callable[[str], np.ndarray],
    columns: int,
    groups: int,
) -> str | None:
    """The problem with an activation-order group index `name` (one group per input
    column, each below `groups`), if any."""
    shape, dtype = tensors[name]
    if tuple(shape) != (columns,) or not dtype.startswith(("int", "uint")):
        return (
            f"{name}: {dtype} {tuple(shape)}, expected integers ({columns},): the "
            "group of each input column"
        )
    values = np.asarray(read_small(name))
    if values.size and (values.min() < 0 or values.max() >= groups):
        return (
            f"{name}: group indices from {values.min()} to {values.max()}, expected "
            f"0 to {groups - 1} ({groups} groups of scales)"
        )
    return None


def _awq_weight(
    prefix: str, parts: Mapping[str, str], tensors: Stored, config: Mapping[str, Any]
) -> Quantized | str:
    qweight = parts["qweight"]
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        return (
            f"{qweight}: AWQ version {version!r} is not supported (the GEMM packing, "
            "version 'gemm', is)"
        )
    bits, group_size = (
        config.get("bits", config.get("w_bit")),
        config.get("group_size", config.get("q_group_size")),
    )
    if not _integer(bits) or bits != 4:
        return f"{qweight}: AWQ with {bits!r} bits is not supported (4 is)"
    if config.get("zero_point", True) is not True:
        return f"{qweight}: AWQ without zero points is not supported"
    if not _integer(group_size) or not (group_size == -1 or group_size > 0):
        return f"{qweight}: AWQ group_size {group_size!r} is not -1 or positive"
    shape, dtype = tensors[qweight]
    if len(shape) != 2 or dtype != "int32":
        return f"{qweight}: {dtype} {tuple(shape)}, expected int32 (in, out / 8)"
    in_features, out_features = shape[0], shape[1] * 8
    groups = 1 if group_size == -1 else -(-in_features // group_size)
    expected = {
        parts["scales"]: (groups, out_features),
        parts["qzeros"]: (groups, shape[1]),
    }
    for name, want in expected.items():
        if tuple(tensors[name][0]) != want:
            actual = tuple(tensors[name][0])
            return (
                f"{name}: shape {actual}, but a qweight {tuple(shape)} in groups "
                f"of {group_size} needs {want}"
            )
    if group_size != -1 and in_features % group_size:
        return f"{qweight}: {in_features} input rows are not groups of {group_size}"
    if "g_idx" in parts:
        return f"{parts['g_idx']}: AWQ has no g_idx (is this a GPTQ checkpoint?)"
    out = {"weight": qweight, "zero": parts["qzeros"], "scale": parts["scales"]}
    weight = _join(prefix, "weight")
    settings = {"group_size": group_size}
    return Quantized(weight, "awq", 4, (out_features, in_features), out, settings)


_NOT_FINITE = """\
{path}: {name} ({part} of {weight}) holds {count} {what} value(s), first at index \
{index}: the weight would be {what}, so nothing was loaded. The checkpoint is \
damaged: quantize the model again, or download the file again"""


def read_parts(
    path: Any, q: Quantized, read: Callable[[str], np.ndarray]
) -> dict[str, np.ndarray]:
    """`{part: array}` of `q`'s parts read by `read(stored name)`, its scales
    checked: finite (an MXFP4 E8M0 scale is never 255, its NaN), an NVFP4 global
    scale not 0 (the weight is divided by it). Raises `QuantizationError` naming the
    tensor; the dequantizing load and `keep_quantized=True` both read through here."""
    out = {}
    for part, name in q.parts.items():
        array = np.asarray(read(name))
        if part in ("scale", "global"):
            if array.dtype == np.uint8 and q.scheme.startswith("mxfp4"):
                bad, what = array == 255, "NaN (E8M0 255)"
            else:
                values = array.astype(np.float32)
                bad, what = ~np.isfinite(values), "NaN or infinite"
                if part == "global":
                    bad, what = bad | (values == 0), "zero, NaN or infinite"
            if bad.any():
                index = tuple(int(i) for i in np.argwhere(bad)[0])
                raise QuantizationError(
                    _NOT_FINITE.format(
                        path=path,
                        name=name,
                        part=part,
                        weight=q.name,
                        count=int(bad.sum()),
                        what=what,
                        index=index,
                    )
                )
        out[part] = array
    return out


def dequantize(
    q: Quantized, read: Callable[[str], np.ndarray], dtype, path: Any = ""
) -> np.ndarray:
    """The dense weight of `q` (PyTorch layout, `q.shape`) as `dtype`, from its parts
    read by `read(stored name)` (checked by `read_parts`; `path` names the
    checkpoint), bit for bit as the scheme's own library gives it (see the scheme
    modules)."""
    arrays = read_parts(path, q, read)
    parts = {part: part for part in arrays}
    read = arrays.__getitem__
    if q.scheme == "fp8-block":
        return _fp8.dequantize_blocks(
            read(parts["weight"]), read(parts["scale"]), q.settings["block"], dtype
        )
    if q.scheme == "gptq":
        g_idx = read(parts["g_idx"]) if "g_idx" in parts else None
        return _gptq.dequantize(
            read(parts["weight"]),
            read(parts["zero"]),
            read(parts["scale"]),
            g_idx,
            q.bits,
            q.settings["group_size"],
            q.settings["zero_plus_one"],
            dtype,
        )
    if q.scheme == "nvfp4":
        return _fp4.dequantize_nvfp4(
            read(parts["weight"]), read(parts["scale"]), read(parts["global"]), dtype
        )
    if q.scheme == "mxfp4":
        return _fp4.dequantize_mxfp4(read(parts["weight"]), read(parts["scale"]), dtype)
    if q.scheme == "mxfp4-blocks":
        return _fp4.dequantize_blocks(
            read(parts["weight"]), read(parts["scale"]), dtype
        )
    if q.scheme == "awq":
        return _awq.dequantize(
            read(parts["weight"]),
            read(parts["zero"]),
            read(parts["scale"]),
            q.settings["group_size"],
            dtype,
        )
    scale = read(parts["scale"])
    if q.scheme == "int-packed":
        values = _packed.unpack(read(parts["weight"]), q.bits, q.shape[1])
    else:
        values = read(parts["weight"])
    zero = None
    if "zero" in parts:
        zero = read(parts["zero"])
        if q.scheme == "int-packed" and zero.shape != scale.shape:  # packed by rows
            zero = _packed.unpack(zero.T, q.bits, scale.shape[0]).T
    g_idx = read(parts["g_idx"]) if "g_idx" in parts else None
    return _packed.dequantize(values, scale, zero, dtype, g_idx)
