"""A layer that is a product: loose arrays a traced forward pass computes with as a
`Dense` layer does, read as one.

An array no codec claims is a loose one-array layer (`_layer.ARRAY`): an
`nnx.Einsum`'s per-head kernel `(D, H, hd)`, a custom module's `kernel (out, in)`
and `bias`, a parameter a module multiplies by hand. Where the forward pass on
example inputs contracts such an array of two axes or more in a `dot_general` (no
axis of it run in parallel: `Contraction.batch` empty), the computation says what
it is: the contracted axes are the inputs, the others the outputs (in the order
the result has them), and it is a `Dense` kernel of `(prod(inputs),
prod(outputs))` read through `_general.dense_view`. A sibling loose array (same
module) spanning those outputs, in stored order, and first used on the product's
result (added to it: the other operands of its first use are computed from the
kernel) is its bias.

The layer is named by its module (`.attn.q_proj`, the kernel's and bias's own
names kept in `Layer.paths`), so that it pairs with a PyTorch `nn.Linear` by path
or by order of use; where a module holds several such kernels, each is a layer of
its own path (without a bias).

Nothing is read this way without a trace: a loose array's shapes never say which
axes meet the input. An array whose shape the other side holds as a loose array
too stays loose (both sides keep today's one-array pairing; no trace is made for
it).
"""

from __future__ import annotations

from typing import Any

from . import _errors
from ._general import Reading, dense_view, embed_view
from ._layer import ARRAY, Layer, read_specs
from ._trace import Trace


def products(
    sides: tuple[list[Layer], list[Layer]],
    traces: tuple[Trace | None, Trace | None],
    problems: list[str],
) -> None:
    """Each side's loose arrays that its traced forward pass contracts as a `Dense`
    kernel replaced, in place, by one `Dense` layer (kernel, and bias where one is
    added to the product). A side is traced only when it has a loose array of two
    axes or more whose shape the other side holds as no loose array."""
    for side, (layers, trace) in enumerate(zip(sides, traces)):
        if trace is None:
            continue
        kept = {_shape(x) for x in sides[1 - side] if x.kinds == (ARRAY,)}
        wanted = [
            x
            for x in layers
            if x.kinds == (ARRAY,)
            and x.index is None
            and len(_shape(x)) >= 2
            and _shape(x) not in kept
        ]
        if not wanted or not trace():
            continue
        made = _made(layers, wanted, trace)
        if not made:
            continue
        replaced = {id(x): new for new, parts in made for x in parts[:1]}
        dropped = {id(x) for _, parts in made for x in parts[1:]}
        layers[:] = [replaced.get(id(x), x) for x in layers if id(x) not in dropped]
        for new, _ in made:
            read_specs(new, problems)


def lookups(
    sides: tuple[list[Layer], list[Layer]],
    traces: tuple[Trace | None, Trace | None],
    problems: list[str],
) -> None:
    """Each side's loose 2-D arrays its traced pass first uses as a table to look
    rows up in (a `gather`: KerasHub's `ReversibleEmbedding.embeddings`, which no
    codec claims beside its `reverse_embeddings`) replaced, in place, by one
    `Embed` layer each, `embedding (rows, features)` as stored."""
    for side, (layers, trace) in enumerate(zip(sides, traces)):
        kept = {_shape(x) for x in sides[1 - side] if x.kinds == (ARRAY,)}
        wanted = [
            x
            for x in layers
            if x.kinds == (ARRAY,)
            and x.index is None
            and len(_shape(x)) == 2
            and _shape(x) not in kept  # the other side's loose array pairs with it
        ]
        if trace is None or not wanted or not trace():
            continue
        table = trace.lookups()
        for i, x in enumerate(layers):
            if x in wanted and x.path in table:
                framework = x.codecs[0].framework
                new = Layer(
                    x.path,
                    (embed_view(framework),),
                    {"embedding": x.leaves["array"]},
                    {"embedding": ()},
                    {},
                )
                read_specs(new, problems)
                if new.codecs:
                    layers[i] = new


def unread(
    lone: tuple[list[Layer], list[Layer]], traces: tuple[Trace | None, Trace | None]
) -> list[str]:
    """Per side with no forward pass traced, one problem naming its unpaired loose
    arrays of two axes or more where the other side has unpaired `Dense` layers:
    the trace would say whether they are products (a rule cannot pair an array
    with a layer)."""
    out = []
    for side, trace in enumerate(traces):
        arrays = [
            x
            for x in lone[side]
            if x.kinds == (ARRAY,) and x.index is None and len(_shape(x)) >= 2
        ]
        if not arrays or not any("Dense" in y.kinds for y in lone[1 - side]):
            continue
        if trace is not None and trace():
            continue  # traced: they are not products the trace recognises
        some = ", ".join(f"{x.where} {_shape(x)}" for x in arrays[:3])
        out.append(
            _errors.PRODUCT_UNREAD.format(
                side=("source", "target")[side],
                arrays=some + (", ..." if len(arrays) > 3 else ""),
                why=_errors.PRODUCT_GIVE
                if trace is None
                else _errors.PRODUCT_FAILED.format(side=("source", "target")[side]),
            )
        )
    return out


def _shape(x: Layer) -> tuple[int, ...]:
    return tuple(x.leaves["array"].shape)


def _made(
    layers: list[Layer], wanted: list[Layer], trace: Trace
) -> list[tuple[Layer, list[Layer]]]:
    """`[(new Dense layer, the loose layers it replaces, kernel first)]`."""
    contracted = trace.contractions()
    needs = trace.upstream()
    kernels = []
    for x in wanted:
        c = contracted.get(x.path)
        rank = len(_shape(x))
        if c is None or c.batch or not c.inputs or not c.outputs:
            continue
        if sorted(c.inputs + c.outputs) != list(range(rank)):
            continue
        kernels.append((x, Reading(tuple(c.inputs), tuple(c.outputs))))
    modules: dict[tuple, list[tuple[Layer, Reading]]] = {}
    for x, reading in kernels:
        modules.setdefault(x.path[:-1], []).append((x, reading))
    loose = [x for x in layers if x.kinds == (ARRAY,) and x.index is None]
    out = []
    for module, found in modules.items():
        if len(found) > 1:  # several kernels in one module: each its own layer
            for x, reading in found:
                out.append((_layer(x.path, x, reading, {"kernel": ()}), [x]))
            continue
        x, reading = found[0]
        paths: dict[str, Any] = {"kernel": x.path[-1:]}
        parts = [x]
        bias = _bias(x, reading, [y for y in loose if y.path[:-1] == module], needs)
        if bias is not None:
            paths["bias"] = bias.path[-1:]
            parts.append(bias)
        out.append((_layer(module, x, reading, paths, bias), parts))
    return out


def _bias(
    kernel: Layer,
    reading: Reading,
    siblings: list[Layer],
    needs: Any,
) -> Layer | None:
    """The one sibling spanning the kernel's outputs (in stored order) whose first
    use is on the product's result, or None."""
    shape = _shape(kernel)
    outputs = tuple(shape[a] for a in sorted(reading.outputs))
    bit = needs.get(kernel.path, (0, 0))[0]
    found = [
        y
        for y in siblings
        if y is not kernel
        and _shape(y) == outputs
        and bit
        and needs.get(y.path, (0, 0))[1] & bit
    ]
    return found[0] if len(found) == 1 else None


def _layer(
    path: tuple,
    kernel: Layer,
    reading: Reading,
    paths: dict[str, Any],
    bias: Layer | None = None,
) -> Layer:
    framework = kernel.codecs[0].framework
    leaves = {"kernel": kernel.leaves["array"]}
    if bias is not None:
        leaves["bias"] = bias.leaves["array"]
    return Layer(path, (dense_view(framework, reading),), leaves, paths, {})


def biases_apart(
    pairs: list[Any],
    lone: tuple[list[Layer], list[Layer]],
    traces: tuple[Trace | None, Trace | None],
    problems: list[str],
) -> tuple[list[Layer], list[Layer]]:
    """A `Dense` paired with one that has a bias, whose side holds that bias apart
    as a loose array the traced pass adds to its product (ESM's `lm_head.bias` after
    the tied `lm_head.decoder`): that array is the layer's bias (`Layer.held`),
    and no longer unpaired. Returns the unpaired layers left per side."""
    out = [list(lone[0]), list(lone[1])]
    for pair in pairs:
        s, t = pair.source, pair.target
        for side, x, other in ((0, s, t), (1, t, s)):
            if not _bias_apart(x, other) or traces[side] is None:
                continue
            found = _added_to(x, out[side], traces[side])
            if found is None:
                continue
            x.leaves["bias"] = found.leaves["array"]
            x.paths["bias"] = ("bias",)
            x.held = {**x.held, "bias": found.path}
            read_specs(x, problems)
            out[side].remove(found)
    return out[0], out[1]


def _bias_apart(x: Layer, other: Layer) -> bool:
    """A `Dense` without a bias of its own paired with one that has one."""
    if "Dense" not in x.kinds or "Dense" not in other.kinds or x.index is not None:
        return False
    mine, theirs = x.specs.get("Dense", {}), other.specs.get("Dense", {})
    return "bias" not in mine and "bias" in theirs and "kernel" in mine


def _added_to(x: Layer, lone: list[Layer], trace: Trace) -> Layer | None:
    """The one unpaired loose 1-D array of `x`'s module or its parent's that the
    traced pass adds to `x`'s product (first used on a value computed from its
    kernel), of its outputs' size; None otherwise."""
    if not trace():
        return None
    added, needs = trace.biases(), trace.upstream()
    kernel = next(e for e in x.paths if e != "bias")
    bit = needs.get(x.leaf(kernel), (0, 0))[0]
    size = x.specs["Dense"]["kernel"].shape[-1]
    near = (x.path[:-1], x.path)
    found = [
        y
        for y in lone
        if y.kinds == (ARRAY,)
        and y.index is None
        and y.path[:-1] in near
        and y.path in added
        and _shape(y) == (size,)
        and bit
        and needs.get(y.path, (0, 0))[1] & bit
    ]
    return found[0] if len(found) == 1 else None
