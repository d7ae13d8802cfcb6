"""Mixture-of-experts layouts of Hugging Face checkpoints: model-family data, and the
renaming between them.

- **per expert** (transformers v4, and what v5's `save_pretrained` still writes):
  one `nn.Linear` per expert and projection, `mlp.experts.{e}.gate_proj.weight`
  `(F, D)`, `up_proj` `(F, D)`, `down_proj` `(D, F)` (Qwen2-MoE, Qwen3-MoE,
  DeepSeek, OLMoE, ...); Mixtral names them `block_sparse_moe.experts.{e}.w1`
  (gate), `w3` (up), `w2` (down), its router `block_sparse_moe.gate`.
- **packed** (transformers v5 in memory; `from_pretrained` reads it from files too):
  `mlp.experts.gate_up_proj` `(E, 2F, D)` (each expert's gate rows, then its up
  rows) and `mlp.experts.down_proj` `(E, D, F)`, the router `mlp.gate.weight`.
- **gpt-oss** (`GptOssExperts`): packed only, with biases: `mlp.experts.gate_up_proj`
  `(E, D, 2F)` with gate and up columns interleaved (gate `[..., ::2]`, up
  `[..., 1::2]`), `gate_up_proj_bias` `(E, 2F)`, `down_proj` `(E, F, D)`,
  `down_proj_bias` `(E, D)`; told from Qwen's layout by those bias names (never by
  shape: `(E, D, 2F)` and `(E, 2F, D)` agree when D == 2F).
- **JAX**: an expert axis is a stack axis: experts made under `nnx.vmap` or
  `eqx.filter_vmap` hold `gate_proj.kernel` `(E, D, F)`; `bridge` ports them to and
  from per-expert layers as any stack.

Files and state dicts in the packed layout are read as per expert (`unpack`), so they
port into JAX stacks; `bridge.save_pretrained(..., packed_experts=family)` writes the
packed layout by placing each expert's rows into the packed tensor (`packing`), never
building it in memory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from .._lazy import LazyArray


class ExpertFamily(NamedTuple):
    """How one model family names its experts: the per-expert projection names
    (`gate`, `up`, `down`), the module holding the per-expert experts relative to a
    layer (`per_expert`), and the router's per-expert and packed names."""

    name: str
    per_expert: str
    gate: str
    up: str
    down: str
    router: tuple[str, str] | None = None


QWEN2_MOE = ExpertFamily(
    "qwen2_moe", "mlp.experts", "gate_proj", "up_proj", "down_proj"
)
MIXTRAL = ExpertFamily(
    "mixtral",
    "block_sparse_moe.experts",
    "w1",
    "w3",
    "w2",
    ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
)
FAMILIES = {f.name: f for f in (QWEN2_MOE, MIXTRAL)}
PACKED = "mlp.experts"  # the packed experts' module, in every family
GATE_UP, DOWN = "gate_up_proj", "down_proj"

_UNKNOWN = (
    "`packed_experts` must be one of {known} (a model family's names), got {value!r}."
)


def family(name: str) -> ExpertFamily:
    """The `ExpertFamily` called `name`, or `ValueError` listing the known ones."""
    if name not in FAMILIES:
        raise ValueError(_UNKNOWN.format(known=sorted(FAMILIES), value=name))
    return FAMILIES[name]


def _per_expert_re(f: ExpertFamily) -> re.Pattern:
    projections = "|".join(re.escape(p) for p in (f.gate, f.up, f.down))
    return re.compile(
        rf"(?P<layer>(?:.+\.)?){re.escape(f.per_expert)}\.(?P<e>\d+)\."
        rf"(?P<proj>{projections})\.weight"
    )


_PACKED_RE = re.compile(
    rf"(?P<layer>(?:.+\.)?){re.escape(PACKED)}\.(?P<proj>{GATE_UP}|{DOWN})"
)


class Place(NamedTuple):
    """Where a per-expert weight goes in a packed tensor: `packed[expert, row:...]`."""

    packed: str
    expert: int
    row: int


def packing(
    tensors: list[tuple[str, tuple[int, ...], Any]], f: ExpertFamily
) -> tuple[list[tuple[str, tuple[int, ...], Any]], dict[str, Place]]:
    """The packed layout of per-expert `tensors` (`(name, shape, dtype)` in order):
    the tensors as written (each packed tensor where its first expert was, the
    router renamed) and where each per-expert weight goes.

    ```python
    >>> projections = ("gate_proj", "up_proj", "down_proj")
    >>> t = [(f"m.mlp.experts.{e}.{p}.weight", (2, 3) if p != "down_proj" else (3, 2),
    ...       "float32") for e in range(2) for p in projections]
    >>> out, places = packing(t, QWEN2_MOE)
    >>> [(n, s) for n, s, _ in out]
    [('m.mlp.experts.gate_up_proj', (2, 4, 3)), ('m.mlp.experts.down_proj', (2, 3, 2))]
    >>> places["m.mlp.experts.1.up_proj.weight"]
    Place(packed='m.mlp.experts.gate_up_proj', expert=1, row=2)

    ```
    """
    pattern = _per_expert_re(f)
    shapes = {name: (tuple(shape), dtype) for name, shape, dtype in tensors}
    layers: dict[tuple[str, str], set[int]] = {}  # (layer, packed kind): experts
    for name in shapes:
        m = pattern.fullmatch(name)
        if m:
            kind = DOWN if m["proj"] == f.down else GATE_UP
            layers.setdefault((m["layer"], kind), set()).add(int(m["e"]))
    places: dict[str, Place] = {}
    packed: dict[str, tuple[str, tuple[int, ...], Any]] = {}
    for (layer, kind), experts in layers.items():
        name = f"{layer}{PACKED}.{kind}"
        projections = (f.gate, f.up) if kind == GATE_UP else (f.down,)
        parts = [
            f"{layer}{f.per_expert}.{e}.{p}.weight"
            for e in range(len(experts))
            for p in projections
        ]
        if experts != set(range(len(experts))) or not all(p in shapes for p in parts):
            raise ValueError(_INCOMPLETE.format(layer=layer, names=parts))
        first, dtype = shapes[parts[0]]
        if any(shapes[p] != (first, dtype) for p in parts):
            raise ValueError(_UNEQUAL.format(layer=layer))
        for i, part in enumerate(parts):
            e, j = divmod(i, len(projections))
            places[part] = Place(name, e, j * first[0])
        rows = first[0] * len(projections)
        packed[name] = (name, (len(experts), rows, *first[1:]), dtype)
    router = dict([f.router]) if f.router else {}
    out: list[tuple[str, tuple[int, ...], Any]] = []
    emitted: set[str] = set()
    for name, shape, dtype in tensors:
        place = places.get(name)
        if place is None:
            out.append((_rename(name, router), shape, dtype))
        elif place.packed not in emitted:
            emitted.add(place.packed)
            out.append(packed[place.packed])
    return out, places


_INCOMPLETE = """\
{layer}: the experts cannot be packed: every expert needs each projection ({names}, \
...), numbered from 0."""
_UNEQUAL = (
    "{layer}: the experts cannot be packed: their weights differ in shape or dtype."
)


def _rename(name: str, renames: Mapping[str, str]) -> str:
    """`name` with a final part in `renames` (`block_sparse_moe.gate.weight` ->
    `mlp.gate.weight`) renamed."""
    for old, new in renames.items():
        if name == old or name.endswith("." + old):
            return name[: len(name) - len(old)] + new
    return name


def unpack(state: Mapping[str, Any], f: ExpertFamily = QWEN2_MOE) -> dict[str, Any]:
    """A state dict (`{name: array}`, numpy arrays or `LazyArray`s) with packed
    experts given per expert in family `f`'s names (the router renamed back); other
    entries as they are, in order. A packed `LazyArray` is read once, when its first
    expert is used.

    gpt-oss's experts (a layer with `mlp.experts.gate_up_proj_bias`: `gate_up_proj`
    `(E, D, 2F)` with gate and up columns interleaved, `down_proj` `(E, F, D)`, their
    biases `(E, 2F)` and `(E, D)`) are told by those bias names, never by shape, and
    given as `mlp.experts.{e}.gate_proj.weight` `(F, D)`, `.bias` `(F,)`, `up_proj`
    the same, `down_proj.weight` `(D, F)`, `.bias` `(D,)`. `ValueError` when such a
    layer's four tensors are not all there with those shapes.

    ```python
    >>> import numpy as np
    >>> packed = {"m.mlp.experts.gate_up_proj": np.zeros((2, 4, 3), "f4"),
    ...           "m.mlp.experts.down_proj": np.zeros((2, 3, 2), "f4")}
    >>> out = unpack(packed)
    >>> len(out), out["m.mlp.experts.1.up_proj.weight"].shape
    (6, (2, 3))

    ```
    """
    router = {new: old for old, new in [f.router]} if f.router else {}
    gpt_oss = _gpt_oss_layers(state)
    out: dict[str, Any] = {}
    for name, array in state.items():
        m = _PACKED_RE.fullmatch(name) or _PACKED_BIAS_RE.fullmatch(name)
        if m is not None and m["layer"] in gpt_oss:
            _unpack_gpt_oss(out, m["layer"], m["proj"], array)
            continue
        if m is None or "bias" in m["proj"] or len(array.shape) != 3:
            out[_rename(name, router)] = array
            continue
        count, rows = array.shape[0], array.shape[1]
        projections = (f.gate, f.up) if m["proj"] == GATE_UP else (f.down,)
        step = rows // len(projections)
        whole = _Once(array)
        for e in range(count):
            for j, proj in enumerate(projections):
                key = f"{m['layer']}{f.per_expert}.{e}.{proj}.weight"
                out[key] = whole.part(e, slice(j * step, (j + 1) * step))
    return out


_PACKED_BIAS_RE = re.compile(
    rf"(?P<layer>(?:.+\.)?){re.escape(PACKED)}\.(?P<proj>{GATE_UP}_bias|{DOWN}_bias)"
)

_GPT_OSS_SHAPES = """\
{layer}{packed}: gpt-oss's packed experts (told by their biases) need {gate_up} \
(E, D, 2F), {gate_up}_bias (E, 2F), {down} (E, F, D) and {down}_bias (E, D); found \
{found}. The experts are not read: give all four tensors of the layer as transformers' \
GptOssExperts holds them."""


def _gpt_oss_layers(state: Mapping[str, Any]) -> set[str]:
    """The layers whose packed experts are gpt-oss's (they have a
    `gate_up_proj_bias` or `down_proj_bias`); `ValueError` listing every such layer
    whose tensors are missing or inconsistent in shape."""
    layers = {m["layer"] for n in state if (m := _PACKED_BIAS_RE.fullmatch(n))}
    problems = []
    for layer in sorted(layers):
        names = [f"{layer}{PACKED}.{p}" for p in (GATE_UP, DOWN)]
        names = [n for p in names for n in (p, p + "_bias")]
        shapes = [tuple(state[n].shape) if n in state else None for n in names]
        gate_up, gate_up_bias, down, down_bias = shapes
        ok = False  # a missing tensor's None equals no shape
        if gate_up is not None and len(gate_up) == 3:
            e, d, f2 = gate_up
            ok = (
                f2 % 2 == 0
                and gate_up_bias == (e, f2)
                and down == (e, f2 // 2, d)
                and down_bias == (e, d)
            )
        if not ok:
            found = ", ".join(
                f"{n.rsplit('.', 1)[-1]} {'missing' if s is None else s}"
                for n, s in zip(names, shapes)
            )
            problems.append(
                _GPT_OSS_SHAPES.format(
                    layer=layer, packed=PACKED, gate_up=GATE_UP, down=DOWN, found=found
                )
            )
    if problems:
        raise ValueError("\n".join(problems))
    return layers


def _unpack_gpt_oss(out: dict[str, Any], layer: str, proj: str, array: Any) -> None:
    """One of gpt-oss's packed tensors (`proj`) put into `out` per expert, in
    PyTorch's `(out, in)` orientation: gate = `gate_up[..., ::2]`, up =
    `gate_up[..., 1::2]`, as `GptOssExperts` computes `x @ gate_up_proj[e] + bias`."""
    f = QWEN2_MOE  # gpt-oss's experts are `mlp.experts`, as Qwen's
    whole = _Once(array)
    base = f"{layer}{f.per_expert}"
    for e in range(array.shape[0]):
        if proj == GATE_UP:
            for p, cols in ((f.gate, slice(0, None, 2)), (f.up, slice(1, None, 2))):
                out[f"{base}.{e}.{p}.weight"] = whole.part(e, (slice(None), cols), True)
        elif proj == DOWN:
            out[f"{base}.{e}.{f.down}.weight"] = whole.part(e, (), True)
        elif proj == GATE_UP + "_bias":
            for p, cols in ((f.gate, slice(0, None, 2)), (f.up, slice(1, None, 2))):
                out[f"{base}.{e}.{p}.bias"] = whole.part(e, cols)
        else:
            out[f"{base}.{e}.{f.down}.bias"] = whole.part(e, ())


class _Once:
    """A packed array, read at most once (a `LazyArray` when first needed), and its
    parts `array[e][index]` (transposed with `t`): views of host arrays, `LazyArray`s
    of lazy ones."""

    def __init__(self, array: Any):
        self.array = array
        self.read: np.ndarray | None = None

    def _host(self) -> np.ndarray:
        if self.read is None:
            self.read = np.asarray(self.array.read())
        return self.read

    def part(self, e: int, index: Any, t: bool = False) -> Any:
        if not isinstance(self.array, LazyArray):
            a = self.array[e][index]
            return a.T if t else a
        shape = np.broadcast_to(np.bool_(0), self.array.shape[1:])[index].shape
        shape = shape[::-1] if t else shape

        def load() -> np.ndarray:
            a = self._host()[e][index]
            return a.T if t else a

        return LazyArray(shape, self.array.dtype, self.array.order, load)


def has_packed(names: Any) -> bool:
    """Whether any name is a packed experts tensor."""
    return any(_PACKED_RE.fullmatch(n) for n in names)
