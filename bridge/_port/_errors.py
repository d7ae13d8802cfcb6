"""`PortError`, `PortWarning` and the messages of every problem a port can meet."""

from __future__ import annotations

import re
import string
from typing import Any


class PortError(ValueError):
    """Raised by `bridge.port` and `bridge.port_plan`, once, listing every problem.

    **Attributes:**

    - `problems`: a list of strings, one per problem, each naming the path(s), what was
      expected and what was found: missing and unexpected layers, shape and dtype
      mismatches, ambiguous pairings, unsupported layer kinds, rules that do not apply.
      Arrays of one dtype where the target holds another (a bfloat16 folder into a
      float32 model) are one problem, with their count.
    """

    def __init__(self, problems: list[str]):
        self.problems = grouped(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(_HEADER.format(n=len(self.problems), problems=lines))


class PortWarning(UserWarning):
    """A hyperparameter that changes the layer's function differs between the source
    and the target layer (`epsilon`, `momentum`, `use_bias`, `heads`, ...). The weights
    are ported anyway; the plan lists every mismatch."""


_HEADER = """\
Cannot port: {n} problem(s), nothing was written.
{problems}
See `bridge.port_plan(source, target)` for the pairing, and docs/guides/porting.md."""

METADATA = (
    "metadata: {path} is recorded as {cls}, whose settings lack {name!r} ({found}): "
    "the checkpoint's metadata does not describe its arrays (damaged or edited). "
    "Load it into the model that wrote it (bridge.load(path, like=model)), or save "
    "it again from that model."
)

MISSING = (
    "missing: target layer {target} ({kind}: {shapes}) has no source layer. Pair it "
    "with rules={{r'<source path>': '{target}'}}, or pass strict=False to keep its "
    "current values."
)
UNEXPECTED = (
    "unexpected: source layer {source} ({kind}: {shapes}) has no target layer. Pair "
    "it with rules={{r'{source_re}': '<target path>'}}, or pass strict=False to leave "
    "it out."
)
COMPUTED_BY_TARGET = (
    "computed by the target: source layer {where} ({kind}: {shapes}) is a stored "
    "{variant}, which the target computes (it has no array for it); pass "
    "strict=False to leave it out."
)
COMPUTED_BY_SOURCE = (
    "computed by the source: target layer {where} ({kind}: {shapes}) holds a "
    "{variant}, which the source computes (it has no array for it); pass "
    "strict=False to keep its values."
)
FUSED = (
    "fused: source layer {source} (Dense, {out} outputs) holds {parts} side by side; "
    "a rule cannot split it. Split a PyTorch-layout source as it is read: "
    "bridge.from_torch(bridge.to_torch(source), split={{r'{pattern}': {{...}}}}), "
    "with `...` each part's name and rows, `'name': rows`, in the order the source's "
    "forward pass cuts its output: the shapes do not tell it, and a wrong order ports "
    "without an error. Port back into a Tree made with the same split to write the "
    "fused layer again (docs/guides/torch-layouts.md, Fused QKV)."
)
ONE_PLUS_WEIGHT = (
    "norm: {n} source layer(s) ({some}) compute x * (1 + weight), as Gemma's "
    "RMSNorm does (layer kind GemmaRMSNorm); Flax's and Equinox's RMSNorm compute "
    "x * scale, so these weights cannot go into them as they are. Write the norm as "
    "x * (1 + scale), its array named `scale` (as Google's JAX Gemma does), and "
    'register it: bridge.register_codec(*bridge.Codec.same_layout("GemmaRMSNorm", '
    "[MyNorm])) (docs/guides/torch-layouts.md, Gemma)."
)
SHAPE = (
    "shape: {source} -> {target} ({kind}): `{entry}` is {actual} in the "
    "source, the target expects {expected}. These are different layers: build the "
    "target with the source's sizes, pair it with another layer through `rules`, or "
    "pass strict=False to keep the target's values for it (fine-tuning a new head, "
    "as Hugging Face's ignore_mismatched_sizes=True)."
)
PREFIX = (
    "prefix: {n} of the {total} target layers that names did not pair are source "
    "layers under {prefix!r}: strip it with bridge.load(path, like=model, "
    "prefix={prefix!r}), or with rules={{r'{where}(.*)': r'\\1'}}."
)
PREFIX_ADD = (
    "prefix: {n} target layers under {where} are source layers without {prefix!r}: "
    "put the source under it with rules={{r'(.*)': r'{where}\\1'}} (or strip it "
    "from the target's names)."
)
DTYPE = (
    "dtype: {source} -> {target} ({kind}): `{entry}` is {actual} in the source, the "
    "target expects {expected}. Pass dtype=jnp.{expected} to cast on the way (or "
    "strict=False to cast to the target's dtypes with a PortWarning), or cast one "
    "model first, e.g. jax.tree_util.tree_map(lambda x: x.astype(jnp.{expected}), "
    "tree)."
)
DTYPES = (
    "dtype: {n} arrays are {actual} in the source, the target expects {expected} "
    "({some}). Pass dtype=jnp.{expected} to cast them on the way "
    "(bridge.load(path, like=model, dtype=jnp.{expected}), bridge.port(source, "
    "target, dtype=jnp.{expected})), or strict=False to cast to the target's dtypes."
)


def _template(text: str) -> re.Pattern:
    """A regex matching what `text.format(...)` makes, its fields as named groups
    (a field used twice must be equal both times)."""
    out, seen = "", set()
    for literal, field, _, _ in string.Formatter().parse(text):
        out += re.escape(literal)
        if field is not None:
            out += f"(?P={field})" if field in seen else f"(?P<{field}>.*?)"
            seen.add(field)
    return re.compile(out, re.DOTALL)


_DTYPE = _template(DTYPE)


def grouped(problems: list[str]) -> list[str]:
    """`problems`, with the dtype problems of one kind (the same dtype in the
    source, the same expected) as one problem counting them, where the first was."""
    kinds: dict[tuple[str, str], list[tuple[str, re.Match]]] = {}
    out: list[Any] = []
    for problem in problems:
        match = _DTYPE.fullmatch(problem)
        if match is None:
            out.append(problem)
            continue
        key = (match["actual"], match["expected"])
        if key not in kinds:
            kinds[key] = []
            out.append(key)
        kinds[key].append((problem, match))
    return [item if isinstance(item, str) else _one(kinds[item]) for item in out]


def _one(kind: list[tuple[str, re.Match]]) -> str:
    """The dtype problems of one kind as one."""
    if len(kind) == 1:
        return kind[0][0]
    where = [f"{m['source']}: {m['entry']}" for _, m in kind[:3]]
    some = ", ".join(where) + (f" and {len(kind) - 3} more" if len(kind) > 3 else "")
    match = kind[0][1]
    return DTYPES.format(
        n=len(kind), actual=match["actual"], expected=match["expected"], some=some
    )


CAST = "dtypes differ, cast to the target's (pass dtype= to choose):\n    {casts}"
HIDDEN_WRAPPER = (
    "the {side}'s arrays {loose} are in no layer bridge knows. If they belong to a "
    "model of another framework inside a Linen model (bridge.as_linen), {fix}"
)
AMBIGUOUS = (
    "ambiguous: source layer {source} ({kind}) could pair with {choices}: kind, shapes "
    "and order leave a choice. {decide} Or say which with rules={{r'{source_re}': "
    "'<target path>'}} (nothing is offered here: a guess is not a port)."
)
AMBIGUOUS_ORDER = (
    "ambiguous: source layers {sources} could pair with target layers {targets} "
    "({kind}: {shapes}): their names differ, and the {side}'s order is not known to "
    "be the order the layers were created in ({why}). {decide} Or say which with "
    "rules, one per pair: rules={{r'{source_re}': '<target path>', ...}} (nothing "
    "is offered here: pairing by names or their order would be a guess)."
)
ONE_SIDE_TRACED = (
    "ambiguous: source layers {sources} could pair with target layers {targets} "
    "({kind}: {shapes}): their names differ, and only the {traced}'s forward pass "
    "was traced: it uses these layers in another order than it created them, and "
    "the {other} (arrays without their model: a file or a state dict) records only "
    "the order its layers were created in, which might be either. Port from the "
    "model that wrote them (its forward pass traced too), or say which with rules, "
    "one per pair: rules={{r'{source_re}': '<target path>', ...}}."
)
SIDE_BY_SIDE = (
    "ambiguous: source layers {sources} could pair with target layers {targets} "
    "({kind}: {shapes}): their names differ, and each side uses them side by side "
    "(on one input, neither computed from the other), so which it computes first "
    "is its own choice and the order of use does not pair them. {why} Say which "
    "with rules, one per pair: rules={{r'{source_re}': '<target path>', ...}}."
)
SIDE_BY_SIDE_ALIKE = (
    "What each one's output flows into until they meet is the same on the "
    "{side} [{layers}], so the computation does not tell them apart either."
)
SIDE_BY_SIDE_DIFFER = (
    "What their outputs flow into until they meet differs between the two "
    "forward passes (source [{sources}], target [{targets}]), so the computation "
    "does not say which is which."
)
LOOSE_ALIKE = (
    "Each is a loose array added to (or computed with) the same arrays as the "
    "others, none from another (two heads' biases after products of one input "
    "with one table), so the computation does not tell them apart either."
)
SIDE_BY_SIDE_ONE = (
    "Only the {side} reads them from one input (the {other} computes their inputs "
    "apart), so the computation does not say which is which."
)
GIVE_EXAMPLE = (
    "Give example inputs (example=(x,), as bridge.compare takes them) so that the "
    "order in which each forward pass uses its layers decides."
)
UNTRACED = (
    "The example inputs were given, but the {sides} has no forward pass to trace "
    "(arrays without their model: a file or a state dict). Port from the model "
    "itself (a torch.nn.Module, a Flax or Equinox model), or from a Hugging Face "
    "folder whose config.json names the model (with torch and transformers "
    "installed), or from a file saved with bridge.save(path, model, example=(x,)), "
    "which records the order its model's forward pass uses its layers."
)
NOT_TRACED = (
    "{why} Without the {side}'s trace, example= cannot pair its layers whose names "
    "differ."
)
"""The one problem in place of those a side's trace would have decided, where the
side cannot be traced for a reason its adapter gives (torch not installed)."""
TRACED_ALIKE = (
    "Both forward passes were traced on the example inputs and use these layers "
    "alike (in parallel, or not at all): inputs that reach every layer would decide."
)
ORDER_SORTED = (
    "its attributes are in sorted order, as NNX leaves a module after nnx.jit, "
    "nnx.eval_shape or nnx.clone"
)
ORDER_DICT = (
    "its layers are the keys of a dict, as Linen variables and the names in a "
    "checkpoint file are, which do not record the order they were created in"
)
POSITIONAL = (
    "paired by their place, not by name: layers of one framework whose names differ "
    "were paired because they are the only ones (or the n-th) of their kind and "
    "shapes:\n    {pairs}\n  Check that each pair is the same layer; say so with "
    "rules={{...}} to silence this. {decide}"
)
OPEN_KIND = (
    "kind: {source} -> {target} fit a {kinds} alike ({shapes}), which store their "
    "arrays in different layouts, and nothing tells which the source is (a file "
    "records no classes; the shapes are square). Give example inputs "
    "(example=(x,), as bridge.compare takes them) so that the forward passes "
    "decide, or port from the model itself (a torch.nn.Module, whose classes say)."
)
TRACE = (
    "trace: the {side}'s forward pass on the example inputs failed ({error}), so it "
    "cannot order its layers.{called} Give inputs (and keyword arguments: "
    "example_kwargs=, a pair for the two sides) that the model takes, as "
    "bridge.compare takes them."
)
PRODUCT_UNREAD = (
    "unread: the {side}'s loose arrays {arrays} are read by no codec (an "
    "nnx.Einsum's per-head kernel, a kernel a module multiplies by hand), and the "
    "other side has Dense layers left unpaired. Which axes of such an array meet "
    "the input is what its forward pass computes, not what its shape says: {why}"
)
PRODUCT_GIVE = (
    "give example inputs (example=(x,), as bridge.compare takes them), and each "
    "array the pass contracts with the input becomes a Dense layer read that way."
)
PRODUCT_FAILED = (
    "the {side} has no traced forward pass (see the trace problem), so they stay "
    "loose arrays."
)
TRACE_CALLED = " The {side} was called with the keyword arguments {names}"
TRACE_WITHOUT = (
    "the {side}'s forward pass failed with the example_kwargs given for both sides "
    "alike, {names} ({error}), and ran on the example inputs alone: its layers are "
    "paired by that pass. To trace it with keyword arguments of its own, give a "
    "pair, (source's, target's); bridge.load's are (the file's model's, like's)."
)
TRACE_SHARED = (
    ", the example_kwargs given for both sides alike (one dict): where the two "
    "models' calls take different ones (an NNX model's cache, a PyTorch model's "
    "attention_mask), give a pair, (source's, target's); bridge.load's are "
    "(the file's model's, like's)."
)
UNSUPPORTED = (
    "unsupported: {where} ({cls}) holds {names} but no codec recognises it. Register "
    "one with bridge.register_codec(bridge.Codec(...)) (see docs/guides/codecs.md)."
)
MISNAMED = (
    "unsupported: Linen layer {where} is named like a {name} but holds {names}, which "
    "a {name} does not. Rename the submodule, or register a codec for it."
)
STACK_AXIS = (
    "stack: {where} reads as a stack of layers (nn.scan) with the layer axis at "
    "any of positions {axes} (lengths {lengths}), and neither the shapes nor the "
    "other side's layers say which axis the scan put the layers on "
    "(variable_axes={{'params': k}}). Give the other side as a model whose layers "
    "fit one reading (a per-layer model, or a stack of known axis), or port the "
    "stack's layers with rules."
)
AXES = (
    "ambiguous: {where} (per-head kernel {shape}) pairs with {other} as a fused "
    "Dense kernel {fused}, but its shapes fit several readings of which axes meet "
    "the input ({readings}), and nothing says which: no module class that fixes "
    "its layout (an nn.Einsum, or a DenseGeneral under a custom name, can contract "
    "any axis). Give example inputs (example=(x,), as bridge.compare takes them): "
    "the forward pass says which axes it contracts (a file, or variables without "
    "their module, cannot run: give them with the model that holds the kernel). Or "
    "register a codec for its module (bridge.register_codec) whose decode gives the "
    "(in, out) kernel."
)
CONTRADICTED = (
    "order: {a} -> {ta} and {b} -> {tb} were paired by {by}, but the forward "
    "passes on the example inputs disagree: in the source {a} feeds {b} (its "
    "input is computed from {a}'s arrays), in the target {tb} feeds {ta}. The names "
    "(or orders) do not say what the computation does. Check which layers "
    "correspond and say so with rules, e.g. rules={{r'{a_re}': '{tb}', r'{b_re}': "
    "'{ta}'}} if the computation is right."
)
CONTRADICTED_SIDE_BY_SIDE = (
    "order: {pairs} were paired by {by}, but each side uses them side by side and "
    "the forward passes on the example inputs pair them otherwise: {computed}, by "
    "what each one's output flows into until they meet (source [{sources}], "
    "target [{targets}]). The names do not say what the computation does. Check "
    "which layers correspond and say so with rules, one per pair, e.g. "
    "rules={rules} if the computation is right."
)
CONV_AXES = (
    "layout: {where} (Conv kernel {shape}) is read in Flax's layout (spatial axes, "
    "then in, then out), but the forward pass on the example inputs convolves it "
    "with out at axis {out}, in at axis {inp} and spatial axes {spatial}: the port "
    "would move the wrong axes. Register a codec for its module "
    "(bridge.register_codec) that transposes it to Flax's layout."
)
UNREADABLE = "unreadable: {where} ({kind}): {error}"
TOLD = (
    "{where} ({kind}): its setting `{name}` is not recorded (a part of a model or a "
    "state dict), so it is taken from the other side's {kind} layers: {value}. If "
    "it differs, the port is wrong: check it (port(..., check=x))."
)
SETTING = (
    "unreadable: {where} ({kind}): its setting `{name}` is not known (a part of a "
    "model, such as bridge.from_equinox(model).blocks[0], or a state dict, does not "
    "record its modules' settings), and the other side's {kind} layers do not tell "
    "it (their values: {values}). Port the whole model, or give the other side as a "
    "model whose {kind} layers have one `{name}`."
)
WEIGHT_NORM_AXES = (
    "layout: {where} holds a weight-normed `weight_v` {shape} whose `bias` {bias} "
    "does not fit PyTorch's order (out, in, *spatial), and nothing tells which axes "
    "are the output, the input and the kernel's. {why}"
)
TRANSPOSED_WEIGHT_NORM = (
    "unsupported: {where} is a weight-normed convolution that the forward pass "
    "applies transposed (conv_transpose), but nothing reads it as a ConvTranspose "
    "(no nn.ConvTranspose class, and no `bias` spanning `v`'s second axis): pass "
    "the torch module, whose class tells"
)
LINEN_WEIGHT_NORM = (
    "unsupported: {where} is wrapped by a Linen nn.WeightNorm that normalises its "
    "{names}: only a weight norm of the `kernel` alone is read (variable_filter="
    "{{'kernel'}}, the default)"
)
REVERSED_WEIGHT_NORM = (
    "unsupported: {where} is a weight-normed convolution that the forward pass "
    "applies transposed, reversing its stored axes {axes} first, but its kernel "
    "axes are {kernel}: only a reversal of every kernel axis (jax.lax."
    "conv_transpose(..., transpose_kernel=True)) or of none (a stride-dilated "
    "input, as nn.ConvTranspose) is read"
)
PLAIN_WEIGHT_NORM_TRANSPOSE = (
    "unsupported: {where} is a weight-normed ConvTranspose whose weight the forward "
    "pass convolves plainly (conv, not conv_transpose): its layout is not the "
    "class's"
)
SETTINGS = {
    "reduction_axes": (
        "layout: {where} is a Linen {kind} whose `scale`/`bias` span several axes "
        "{shape}, and Linen variables do not say which axes it normalises over "
        "(`reduction_axes`): PyTorch's and Equinox's norms normalise over all the "
        "axes they scale, a Linen norm may not. Give example inputs (example=(x,)): "
        "the forward pass calls the module, whose settings tell."
    ),
    "conv1d": (
        "layout: {where} holds a square weight {shape} under one of GPT-2's Conv1D "
        "names: stored (in, out) as GPT-2's Conv1D, or (out, in) as an nn.Linear "
        "(GPT-Neo keeps GPT-2's names), and nothing tells which. Give example inputs "
        "with the torch module (its forward pass decides), port from the module "
        "itself, or from a Hugging Face folder whose config.json names the "
        "model_type (or pass config= to bridge.save)."
    ),
    "out_in": (
        "layout: {where} holds a square kernel {shape} in a Linen model that stores "
        "other kernels (out, in) (their bias spans the first axis: transformers' "
        "FlaxConv1D), so this one may be stored (in, out) as nn.Dense or (out, in), "
        "and nothing tells which. Give example inputs (example=(x,), as "
        "bridge.compare takes them) with the model: its forward pass says which "
        "axis the product contracts."
    ),
    "feature_axes": (
        "layout: {where} is wrapped by a Linen nn.WeightNorm whose scale's length "
        "fits several axes of its kernel {shape}, and nothing tells which it scales "
        "(its `feature_axes`). Give example inputs (example=(x,)) with the model: "
        "its forward pass shows the axis the scale is reshaped to."
    ),
}
"""Messages of settings nothing told, where the setting decides a layout."""
UNFIT = (
    "shape: {source} -> {target} ({kind}): the {kind} codec made {made} for the "
    "target, which holds {like}."
)
KIND = (
    "kind: the rule pairs {source} ({source_kind}) with {target} ({target_kind}); "
    "layers of different kinds cannot be ported into each other."
)
RULE_TARGET = (
    "rule {pattern!r}: maps {source} to {target!r}, which is not a layer of the "
    "target. Target layers: {layers}."
)
TIED_UNEQUAL = (
    "tied: the target holds {target} once for {names} (one array under several "
    "names), and the source's arrays for them differ ({a} and {b}: largest "
    "difference {diff}); one array cannot hold both. Make the source's arrays "
    "equal first, or untie the target's (give each name its own parameter), or "
    "leave one out with rules={{r'<source path>': None}}."
)
HEAD_ABSENT = (
    "head: the source's files hold no {name} ({why}), so nothing fills the "
    "target's {targets}; do not pair another array with it by a rule. Load a "
    "folder that holds the head, or pass strict=False to keep the target's values."
)
RULE_UNUSED = "rule {pattern!r}: matches no source layer. Source layers: {layers}."
RULE_TWICE = "rule: target layer {target} is paired with {sources}; pair it once."
ENTRY_MISSING = (
    "shape: {source} -> {target} ({kind}): the target has `{entry}` and the source "
    "has not, and `{entry}` has no neutral value to fill in."
)
ENTRY_DROPPED = (
    "value: {source} -> {target} ({kind}): the target has no `{entry}`, and the "
    "source's `{entry}` is not {default} everywhere, so dropping it changes the "
    "output. Give the target a `{entry}` (e.g. use_bias=True)."
)
ENTRY_EXTRA = (
    "shape: {source} -> {target} ({kind}): the source has `{entry}` and the target has "
    "no place for it."
)
CHECK = (
    "check: the ported model's outputs differ from the source's by {diff:.3g} (largest "
    "absolute difference; allowed {tolerance:.3g} for {dtype}). Layers were paired "
    "wrongly or a layer computes something else: see bridge.port_plan(source, "
    "target) and compare the rows marked ~."
)
HYPER = (
    "{source} -> {target} ({kind}): {name} is {a!r} in the source and {b!r} in the "
    "target, so the ported layer computes something else."
)


NORM_FORM = (
    "norm: {offset} computes x * (1 + weight) and {other} is paired with it, but its "
    "forward pass does not show {other} computing x * weight (no array of it scales "
    "a normalisation on the example inputs): whether to add 1 is not known, so "
    "nothing is moved. Give example inputs that run {other}, or a rule pairing it "
    "with a norm of the same form."
)
IDLE = (
    " It is not used by the example's forward pass (the {side}'s traced pass never "
    "reads it), so the computation cannot pair it: pass strict=False to leave it as "
    "it is, or a rule."
)
PART_MISSING = (
    "split: target layer {target} is written whole from its {parts} parts, and "
    "parts {missing} have no source layer: pair them (rules), or leave the fused "
    "layer out (strict=False with no part paired)."
)
SPLIT_UNCHECKED = (
    "split: {layers} read as parts of a fused layer ({pairs}), but which part is "
    "which layer only the outputs tell, and {why}. Give example inputs with values "
    "(arrays, not jax.ShapeDtypeStruct) from models both of which run, or say which "
    "with rules."
)
SPLIT_NONE = (
    "split: no assignment of the parts of {layers} to the other side's layers "
    "computes the source's outputs on the example inputs (the closest is "
    "{diff:.3g} off): the fused layers are not these layers. Say which with rules."
)
SPLIT_SEVERAL = (
    "split: {n} assignments of the parts of {layers} to the other side's layers "
    "compute the source's outputs on the example inputs alike: they do not tell "
    "which part is which. Give other example inputs, or say which with rules."
)
