"""What a traced forward pass decides about a layer that its arrays leave open: its
kind among the candidates names and shapes allow, and its layout.

A file records no classes, and some shapes fit several kinds alike: a square
convolution is a `Conv` or a `ConvTranspose`; a square weight under one of GPT-2's
names is an `nn.Linear` `(out, in)` or a `Conv1D` `(in, out)`; a 1-D `weight` alone
scales a mean-subtracting norm, an RMS norm or `x * (1 + weight)`. The forward pass
on example inputs (`_trace.Trace`: JAX's `make_jaxpr`, PyTorch's recorder) tells:
the class each Linen submodule is called as, the axes a product contracts (a 2-D
`weight` alone, an `Embed` or a `Dense` by its shape, that a product first uses is
a `Dense`), the kernel axes a convolution reads, whether a norm subtracts the mean.
Only the candidates that computation allows are kept; where it says nothing,
nothing changes (and `_checks._open_kinds` refuses what is still open).

A module holding a `bias` alone reads as a norm without scale (`LayerNorm`,
`GroupNorm`); where the forward pass adds that bias to a product's result (a
masked-LM head's `bias` after the product with the tied embedding: transformers'
`FlaxBertLMPredictionHead`), it is none of them: it is read as what it is, a loose
array (`_layer.ARRAY`), as PyTorch's `BertLMPredictionHead.bias` is, and pairs
with it.
"""

from __future__ import annotations

from .._adapters._registry import (
    CANONICAL_LAYOUT,
    TORCH_LAYOUT,
    layout_of,
    reads_classes,
)
from .._tree import Path
from ._general import reading_of
from ._layer import Layer, loose_layer, read_specs
from ._trace import Trace


_NORMS = {
    "mean": frozenset({"LayerNorm", "GroupNorm", "BatchNorm"}),
    "rms": frozenset({"RMSNorm"}),
    "rms+1": frozenset({"GemmaRMSNorm"}),
}
"""The kinds a normalisation may be, by what its trace computes."""


def computed(
    sides: tuple[list[Layer], list[Layer]],
    traces: tuple[Trace | None, Trace | None],
    problems: list[str],
) -> None:
    """Each side's layers that their arrays leave open (several candidate kinds, or
    a layout setting nothing gave) narrowed by that side's trace, made only when
    such a layer exists."""
    for layers, trace in zip(sides, traces):
        open_ = [x for x in layers if len(x.codecs) > 1 or x.unknown]
        if not open_ or trace is None or not trace():
            continue
        for x in open_:
            _by_class(x, trace)
            _by_module(x, trace, problems)
            _by_computation(x, trace, problems)
        added = trace.biases()
        layers[:] = [_as_bias(x, added) for x in layers]


def _as_bias(x: Layer, added: frozenset) -> Layer:
    """`x`, or where it holds a `bias` alone (read as a norm without scale) that
    the forward pass adds to a product's result, that bias as a loose array."""
    if x.index is not None or set(x.leaves) != {"bias"} or x.held:
        return x
    leaf = x.path + x.paths["bias"]
    if leaf not in added:
        return x
    return loose_layer(leaf, x.codecs[0].framework, x.leaves["bias"])


def _by_class(x: Layer, trace: Trace) -> None:
    """A layer whose forward pass calls it as a class of known kind (Linen's
    compact submodules, by `nn.intercept_methods`): that kind."""
    module = trace.modules().get(x.real if x.index is not None else x.path)
    name = None if module is None else type(module).__name__
    named = [c for c in x.codecs if name in c.names]
    if any(c.kind == "DenseGeneral" for c in named):  # and its per-head Dense view
        named += [c for c in x.codecs if reading_of(c) is not None]
    if named:
        _keep(x, tuple(c for c in x.codecs if c in named))


def _by_module(x: Layer, trace: Trace, problems: list[str]) -> None:
    """A layer lacking settings its arrays do not hold (a Linen norm's
    `reduction_axes`, over several axes) reads them from the module the forward
    pass called at its path (Linen's compact submodules)."""
    if x.index is not None or "reduction_axes" not in x.unknown.values():
        return
    module = trace.modules().get(x.path)
    if module is None:
        return
    for codec in x.codecs:
        if x.unknown.get(codec.kind) == "reduction_axes":
            for name, value in codec.hyperparameters(module).items():
                x.hyper.setdefault(name, value)
    read_specs(x, problems)


def _by_computation(x: Layer, trace: Trace, problems: list[str]) -> None:
    """What the trace shows done with the layer's `weight`: a convolution's kernel
    axes (PyTorch's `conv` reads `(out, in, *k)`, `conv_transpose` `(in, out,
    *k)`), the axis a product contracts (`F.linear`: `(out, in)`; GPT-2's `addmm`:
    `(in, out)`) and whether a product, not a lookup, first uses it (a `Dense`,
    not an `Embed`), the norm it scales."""
    if x.index is not None:  # a stack's layers: names decide
        return
    where = x.path + x.paths.get("weight", ("weight",))
    torch = tuple(c for c in x.codecs if layout_of(c.framework) == TORCH_LAYOUT)
    spec = trace.kernels().get(where)
    if spec is not None and torch:
        kind = {(0, 1): "Conv", (1, 0): "ConvTranspose"}.get((spec[0], spec[1]))
        _keep(x, tuple(c for c in x.codecs if c.kind == kind or c not in torch))
    contraction = trace.contractions().get(where)
    if contraction is not None and torch and _first_use_a_product(trace, where):
        _keep(x, tuple(c for c in x.codecs if c.kind != "Embed" or c not in torch))
    kernel = x.paths.get("kernel")
    product = None if kernel is None else trace.contractions().get(x.path + kernel)
    if product is not None and _flax_dense(x) and product.inputs in ((0,), (1,)):
        x.hyper["out_in"] = product.inputs == (1,)  # FlaxConv1D: (out, in)
        read_specs(x, problems)
    if contraction is not None and x.hyper.get("conv1d", False) is None:
        if contraction.inputs in ((0,), (1,)):
            x.hyper["conv1d"] = contraction.inputs == (0,)
            read_specs(x, problems)
    norm = trace.norms().get(where)
    if norm in _NORMS and torch:
        allowed = _NORMS[norm]
        _keep(x, tuple(c for c in x.codecs if c.kind in allowed or c not in torch))


def _first_use_a_product(trace: Trace, where: Path) -> bool:
    """Whether the array at `where`, which a product contracts, is first used by
    one: its first use reads values computed from other weights (an activation),
    where an embedding's lookup reads indices computed from none. A table looked
    up and then contracted under one name (DeBERTa's LM head reads
    `word_embeddings.weight` itself) stays an `Embed` candidate; so does a product
    on the model's inputs alone, which the trace does not tell from a lookup."""
    _, upstream = trace.upstream().get(where, (0, 0))
    return upstream != 0


def _flax_dense(x: Layer) -> bool:
    """A class-less layer (a framework recording no classes: Linen) read as a Flax
    `Dense` (kernel `(in, out)`)."""
    return any(
        c.kind == "Dense"
        and layout_of(c.framework) == CANONICAL_LAYOUT
        and not reads_classes(c.framework)
        for c in x.codecs
    ) and (x.leaves["kernel"].ndim == 2)


def _keep(x: Layer, codecs: tuple) -> None:
    """Narrow the layer to `codecs` (where any is left), dropping a per-head view
    no codec reads any more."""
    if not codecs or codecs == x.codecs:
        return
    x.codecs = codecs
    x.unknown = {k: v for k, v in x.unknown.items() if any(c.kind == k for c in codecs)}
    if all(reading_of(c) is None for c in codecs):
        x.readings = ()
