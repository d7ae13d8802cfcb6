"""Reading a PyTorch module's computation: what one forward pass does with each weight.

`trace_module(module, inputs, kwargs)` runs the module once under `torch.no_grad()`
and a `torch.overrides.TorchFunctionMode` that sees every torch function and tensor
method called (`F.linear`, `torch.addmm`, `F.conv1d`, `F.layer_norm`, `w.t()`,
`x * w`, ...), before PyTorch dispatches it. Parameters and persistent buffers are
known by object identity (a tie is one object under several names); each tensor an
operation makes carries the parameters it was computed from, so `w.t()`,
`w.view(...)`, `w.to(dtype)`, `1.0 + w`, `torch._weight_norm(v, g)` and a cls
token's `expand` are seen through to the parameter: its first use is the first
operation that computes with it and an activation. There the operation and the
argument decide the layout (`F.linear`'s weight is `(out, in)`, `addmm`'s second
matrix `(in, out)`, `F.conv_transpose1d`'s weight `(in, out, k)`), not a name or a
square shape. A normalisation written by hand is recognised by the activation it
scales: `x * rsqrt(mean(x ** 2) + eps)` with no mean subtracted is an RMS norm.

The module's parameters may be on the `meta` device or fake
(`torch._subclasses.fake_tensor.FakeTensor`): the inputs are made so too, and nothing
is computed. A meta module runs on meta tensors (about 3x cheaper than fake ones:
0.38 s against 1.15 s for a 1 GiB Llama, on a loaded machine) and, where its code
reads a value (transformers' padding and packed-sequence checks call `.item()`),
again on fake copies of its tensors, which such checks recognise and skip: the
record is the same either way. On plain meta tensors the results of elementwise
operations, `mean`, `cat`, `F.linear` and `matmul` are made without PyTorch's
meta kernels (`_torch_meta`: most of them are Python reference implementations).
`_torch_folder.folder_module(folder)` builds such a module, of full size and with
no memory, from a Hugging Face folder's `config.json`. A module of real tensors is
never changed by its trace (a BatchNorm in training mode keeps its statistics): the
pass runs on its parameters and copies of its buffers.

torch is imported here only, when called.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from .._gc import paused
from .._uses import Contraction, Uses
from ._torch_merges import merges
from ._torch_meta import on_meta


class _Source(NamedTuple):
    """A parameter a tensor was computed from: its index, the parameter's stored
    axis each of the tensor's axes is (None: a new axis; `axes` None: unknown), and
    whether `1 + w` was taken."""

    index: int
    axes: tuple[int | None, ...] | None
    plus1: bool


class _Seen:
    """What the recorder knows of one tensor: `sources` when it is computed from
    parameters alone (None for an activation), the parameters it depends on (a bit
    each), and a normalisation tag `(kind, mean subtracted)`."""

    __slots__ = ("branch", "bits", "ref", "root", "sources", "tag")

    def __init__(
        self, tensor: Any, sources, bits: int, tag, branch: Any = None, root=None
    ):
        self.ref = weakref.ref(tensor)
        self.sources = sources
        self.bits = bits
        self.tag = tag
        self.branch = branch
        """The key of the product's kernel this activation is computed from alone
        (a layer's output, relaid out or changed by itself), `_MERGED` where it is
        computed from several, or None."""
        self.root = root
        """The number of the model's input or activation this one is computed
        from alone, with no parameter (`_Recorder.root`; given when first asked
        for), or None: a tensor with a root or parameter bits is computed from the
        model's inputs, one with neither is a constant (a causal mask)."""


_ARITH = frozenset(
    {"add", "sub", "mul", "div", "truediv", "floordiv", "matmul", "pow", "mod"}
)
_ALIASES = {
    "truediv": "div",
    "true_divide": "div",
    "divide": "div",
    "multiply": "mul",
    "subtract": "sub",
    "concat": "cat",
    "concatenate": "cat",
    "swapaxes": "transpose",
    "swapdims": "transpose",
}

_SIGNATURES = {
    "linear": ("input", "weight", "bias"),
    "addmm": ("input", "mat1", "mat2"),
    "baddbmm": ("input", "batch1", "batch2"),
    "addbmm": ("input", "batch1", "batch2"),
    "matmul": ("input", "other"),
    "mm": ("input", "mat2"),
    "bmm": ("input", "mat2"),
    "conv1d": ("input", "weight", "bias"),
    "conv2d": ("input", "weight", "bias"),
    "conv3d": ("input", "weight", "bias"),
    "conv_transpose1d": ("input", "weight", "bias"),
    "conv_transpose2d": ("input", "weight", "bias"),
    "conv_transpose3d": ("input", "weight", "bias"),
    "layer_norm": ("input", "normalized_shape", "weight", "bias"),
    "group_norm": ("input", "num_groups", "weight", "bias"),
    "batch_norm": ("input", "running_mean", "running_var", "weight", "bias"),
    "instance_norm": ("input", "running_mean", "running_var", "weight", "bias"),
    "rms_norm": ("input", "normalized_shape", "weight"),
    "embedding": ("input", "weight"),
    "multi_head_attention_forward": (
        "query",
        *("key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight"),
        *("in_proj_bias", "bias_k", "bias_v", "add_zero_attn", "dropout_p"),
        *("out_proj_weight", "out_proj_bias"),
    ),
}
"""The leading arguments of the operations whose arguments have roles."""

_STAGES = {
    **dict.fromkeys(
        ("linear", "layer_norm", "group_norm", "batch_norm", "instance_norm"),
        {"bias": 1},
    ),
    **dict.fromkeys(("conv1d", "conv2d", "conv3d"), {"bias": 1}),
    **dict.fromkeys(
        ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"), {"bias": 1}
    ),
    **dict.fromkeys(("addmm", "baddbmm", "addbmm"), {"input": 1}),
    "multi_head_attention_forward": {
        "in_proj_bias": 1,
        "out_proj_weight": 2,
        "out_proj_bias": 3,
    },
}
"""The order in which an operation applies its arguments where it does several
things (a bias is added after the product): an argument's `needs` leave out those
applied after it (the JAX side applies them in operations of their own)."""

_ADDED = {"linear": "bias", "addmm": "input", "baddbmm": "input", "addbmm": "input"}
"""The argument an operation adds to its product's result (a bias)."""

_LATER = {"multi_head_attention_forward": {"out_proj_weight": 1, "out_proj_bias": 1}}
"""Arguments an operation applies in a later step of its own, counted as one more
operation (attention's output projection after its input projection)."""

_NORMS = {
    "layer_norm": "mean",
    "group_norm": "mean",
    "batch_norm": "mean",
    "instance_norm": "mean",
    "rms_norm": "rms",
}

_EPS = {
    "layer_norm": 4,
    "group_norm": 4,
    "batch_norm": 7,
    "instance_norm": 8,
    "rms_norm": 3,
}
"""The position of each normalisation function's `eps` argument."""

_PRODUCTS = frozenset({"linear", "addmm", "matmul", "mm", "bmm", "einsum"})
"""Operations whose output starts a layer's branch where a kernel is contracted."""

_STARTS = _PRODUCTS | {"embedding", "conv1d", "conv2d", "conv3d"}
"""Operations whose output starts a layer's branch (`_Recorder.branch`)."""

_RELAYOUTS = frozenset(
    {
        *("to", "float", "half", "double", "bfloat16", "type", "type_as"),
        *("contiguous", "clone", "detach", "view", "reshape", "view_as"),
        *("reshape_as", "unsqueeze", "squeeze", "permute", "transpose", "t", "T"),
        *("expand", "expand_as", "flatten", "unflatten", "movedim", "dropout"),
        *("split", "chunk", "narrow", "getitem", "select", "unbind"),
    }
)
"""Operations that only move, cast or select an activation (no computation of its
own, as `_branches` leaves them out on the JAX side)."""

_MERGED = "merged"
"""The branch of an activation computed from several layers' outputs."""

_FIRST_ONLY = frozenset({"type_as", "to", "expand_as", "view_as", "reshape_as"})
"""Operations whose second tensor gives only a dtype, device or shape."""

_SAME_RANK = frozenset(
    {"cat", "split", "chunk", "narrow", "tensor_split", "repeat", "tile", "flip"}
)
"""Operations that keep the meaning of every axis when they keep the rank."""

_PASS_TAG = frozenset(
    {
        *("to", "float", "half", "double", "bfloat16", "type", "type_as"),
        *("contiguous", "clone", "detach", "view", "reshape", "view_as"),
        *("reshape_as", "unsqueeze", "squeeze", "permute", "transpose"),
    }
)
"""Operations on one activation that keep its normalisation tag."""

_TAGGING = frozenset(
    {"mean", "var", "var_mean", "std", "std_mean", "pow", "square", "mul"}
)
"""Operations that tag an output none of whose operands has a tag (`_Recorder.tag`:
a mean, a variance, a square)."""


def _name_of(func: Any, cache: dict) -> tuple[str, bool]:
    """An operation's short name (`F.linear` -> `linear`, `Tensor.__radd__` ->
    `add`, `Tensor.add_` -> `add`, `Tensor.T.__get__` -> `T`) and whether its
    operands are reflected (`__rsub__`)."""
    known = cache.get(func)
    if known is not None:
        return known
    from torch.overrides import resolve_name

    full = resolve_name(func) or getattr(func, "__name__", "") or ""
    parts = full.split(".")
    short = parts[-1]
    if short == "__get__" and len(parts) > 1:
        short = parts[-2]
    reflected = False
    if short.startswith("__") and short.endswith("__"):
        short = short[2:-2]
        if short[:1] == "i" and short[1:] in _ARITH:
            short = short[1:]
        elif short[:1] == "r" and short[1:] in _ARITH:
            short, reflected = short[1:], True
    elif short.endswith("_") and not short.startswith("_"):
        short = short[:-1]  # in place
    short = _ALIASES.get(short, short)
    cache[func] = (short, reflected)
    return short, reflected


class _Recorder:
    """The `TorchFunctionMode` body: records every operation's effect on the
    tensors it knows (`trace_module` makes one per call)."""

    def __init__(
        self,
        torch: Any,
        objects: list[Any],
        tied: Mapping[int, list[str]] | None = None,
        owners: Mapping[int, list[str]] | None = None,
    ):
        self.torch = torch
        self.tied = dict(tied or {})
        """`{tensor index: its names}` for a tensor under several names (a tie)."""
        self.owners = dict(owners or {})
        """`{id(module): its names}` (one module object may have several)."""
        self.calls: list[Any] = []
        """The modules whose `forward` is running, outermost first."""
        self.seen: dict[int, _Seen] = {}
        for i, t in enumerate(objects):
            source = _Source(i, tuple(range(t.dim())), False)
            self.seen[id(t)] = _Seen(t, (source,), 1 << i, None)
        self.count = 0
        self.names: dict[Any, tuple[str, bool]] = {}
        # by tensor index, or `(index, name)` for a tied one (`key`)
        self.positions: dict[Any, tuple[int, ...]] = {}
        self.needs: dict[Any, tuple[int, int]] = {}
        self.contracted: dict[Any, Contraction] = {}
        self.convolved: dict[Any, tuple[int, ...]] = {}
        self.norms: dict[Any, str] = {}
        self.eps: dict[Any, float] = {}
        self.kwargs: dict = {}  # the keyword arguments of the operation recorded
        self.added: dict[Any, bool] = {}
        self.alone: dict[Any, bool] = {}
        """`{kernel key: whether the layer's output is changed by itself (an
        activation function, a norm) before it meets another layer's output}`."""
        self.merged: set[Any] = set()
        self.reads: dict[Any, frozenset[int]] = {}
        """`{key: the activations its first use reads}` (`_Recorder.root`)."""
        self.merges: list = []
        """Where activations of different parameters meet (`_torch_merges`)."""
        self.roots = 0
        self.products: dict[int, Any] = {}
        """`{id: weak reference}` of the outputs of products with a kernel and
        no bias of their own (`x @ w.T`), as computed (`product`): what is added
        to them is a bias, as JAX's `add` onto a `dot_general`'s result."""
        self.weight_norm: list[tuple[int, int]] = []

    def key(self, index: int) -> Any:
        """What a use of tensor `index` is recorded under: the index, or for a tied
        tensor `(index, name)`, the name of it the running module holds (the
        module's names against the enclosing modules' where one module object has
        several: transformers' T5 calls one embedding as `encoder.embed_tokens`
        and `decoder.embed_tokens`); the first name where no module holds one."""
        names = self.tied.get(index)
        if names is None:
            return index
        found: list[str] = []
        for depth in range(len(self.calls) - 1, -1, -1):
            held = self.owners.get(id(self.calls[depth]), ())
            found = [n for n in names if n.rpartition(".")[0] in held]
            if found:
                break
        else:
            return (index, names[0])
        for outer in reversed(self.calls[:depth]):
            if len(found) == 1:
                break
            prefixes = [p + "." for p in self.owners.get(id(outer), ()) if p]
            inside = [n for n in found if any(n.startswith(p) for p in prefixes)]
            found = inside or found
        return (index, found[0])

    def entry(self, t: Any) -> _Seen | None:
        e = self.seen.get(id(t))
        return e if e is not None and e.ref() is t else None

    def record(
        self, func: Any, args: tuple, kwargs: dict, out: Any, named=None
    ) -> None:
        """Note what `func(*args, **kwargs)` made (`out`) from the tensors it
        knows; `named`: `_name_of(func)`, where the caller has it."""
        name, reflected = named or _name_of(func, self.names)
        self.kwargs = kwargs
        if reflected and len(args) >= 2:
            args = (args[1], args[0], *args[2:])
        operands = self.operands(name, args, kwargs)
        if not operands:
            return
        tensor = self.torch.Tensor
        outs = [out] if isinstance(out, tensor) else _tensors_in(out, tensor)
        derived = [o for o in operands if o[2] is not None and o[2].sources]
        if name in _FIRST_ONLY:
            derived = [d for d in derived if d[0] == 0]
            operands = [o for o in operands if o[0] == 0]
        if derived and len(derived) == len(operands):
            self.relay(name, args, derived, outs)
            return
        if not outs and len(operands) == 1:  # `x.shape`, `x.dtype`: no tensor
            e = operands[0][2]  # made, no merge; numbered as `root` below does
            if e is not None and e.bits and e.root is None:
                e.root = self.new_root()
            return
        bits = 0
        for _, _, e in operands:
            if e is not None:
                bits |= e.bits
        if derived:
            self.count += 1
            tag = self.use(name, args, operands, derived)
        else:
            tag = self.tag(name, args, operands)
        branch = self.branch(name, operands, derived, outs) if outs else None
        acts = [
            (s, k, t, e)
            for k, (s, t, e) in enumerate(operands)
            if e is None or not e.sources
        ]
        if len(acts) > 1:
            found = [(s, k, e.bits) for s, k, _, e in acts if e and e.bits]
            if len(found) > 1:  # activations of parameters meet
                self.merges += merges(name, args, found)
        root = None
        if not derived:
            fed = [
                (t, e) for _, _, t, e in acts if e and (e.bits or e.root is not None)
            ]
            if fed:  # computed from inputs alone: one input (not indices:
                # `(ids + 1) % n` looks up other rows, as on the JAX side)
                roots = {self.root(t, e) for t, e in fed}
                floating = all(t.dtype.is_floating_point for t in outs)
                same = len(roots) == 1 and (floating or name in _PASS_TAG)
                root = roots.pop() if same else self.new_root()
        for t in outs:
            if bits or tag is not None or branch is not None or root is not None:
                self.seen[id(t)] = _Seen(t, None, bits, tag, branch, root)
            else:
                self.seen.pop(id(t), None)

    def root(self, t: Any, e: _Seen | None) -> int:
        """The number of the activation `t` is computed from alone, with no
        parameter (two layers reading `x`, `x.view(...)` or a norm's
        `(x - x.mean()) / x.std()` read one input: `_branches.inputs`)."""
        e = e or self.entry(t)
        if e is None:
            e = self.seen[id(t)] = _Seen(t, None, 0, None)
        if e.root is None:
            e.root = self.new_root()
        return e.root

    def new_root(self) -> int:
        self.roots += 1
        return self.roots

    def product(self, t: Any) -> bool:
        """Whether `t` is a product's output with a kernel, as computed."""
        ref = self.products.get(id(t))
        return ref is not None and ref() is t

    def output(self, out: Any) -> None:
        """The module's outputs: merges of one operand each (`_torch_merges`)."""
        for t in _tensors_in(out, self.torch.Tensor):
            e = self.entry(t)
            if e is not None and e.bits and not _held(e):
                self.merges.append(("output", ((None, e.bits),)))

    def branch(self, name: str, operands: list, derived: list, outs: list) -> Any:
        """The branch of an operation's output (`_Seen.branch`): a product's kernel
        starts one; an operation on one branch's activations keeps it (and marks
        it `alone` unless it only relays or scales it); one on several, or on an
        activation computed from several, ends them (`_MERGED`)."""
        kernels = [
            self.key(e.sources[0].index)
            for slot, _, e in derived
            if slot in ("weight", "mat2", "other", 1) and e.sources[0].axes is not None
        ]
        if kernels and name in _STARTS:
            self.alone.setdefault(kernels[0], False)
            biased = any(slot == _ADDED.get(name) for slot, _, _ in operands)
            if name in _PRODUCTS and not biased:  # `x @ w.T`, its bias not added
                self.products.update((id(t), weakref.ref(t)) for t in outs)
            return kernels[0]
        found = {
            e.branch for _, _, e in operands if e is not None and e.branch is not None
        }
        if not found:
            return None
        if len(found) > 1 or _MERGED in found:
            self.merged |= found
            return _MERGED  # computed from several layers' outputs
        (branch,) = found
        others = [e for _, _, e in operands if e is None or e.branch != branch]
        scaling = (
            name in ("mul", "div")
            and len(others) == len(operands) - 1
            and all(e is None or e.sources for e in others)
        )  # by a constant or a parameter, not by an activation (RoPE's cos) or itself
        if name not in _RELAYOUTS and not scaling and branch not in self.merged:
            self.alone[branch] = True
        return branch

    def operands(self, name: str, args: tuple, kwargs: dict) -> list:
        """`[(slot, tensor, what is known of it)]`: a slot is the argument's name
        for an operation with roles, else its position."""
        signature = _SIGNATURES.get(name, ())
        found = []
        if name == "einsum":
            ops = (
                args[1]
                if len(args) == 2 and isinstance(args[1], list | tuple)
                else args[1:]
            )
            return [
                (k, t, self.entry(t))
                for k, t in enumerate(ops)
                if isinstance(t, self.torch.Tensor)
            ]
        tensor, seen = self.torch.Tensor, self.seen
        for i, a in enumerate(args):
            slot = signature[i] if i < len(signature) else i
            if isinstance(a, tensor):  # most arguments (inlined `entry`)
                e = seen.get(id(a))
                found.append((slot, a, e if e is not None and e.ref() is a else None))
                continue
            if a is None or type(a) in _NO_TENSORS:
                continue
            for t in _tensors_in(a, tensor):
                found.append((slot, t, self.entry(t)))
        for key, a in kwargs.items():
            for t in _tensors_in(a, self.torch.Tensor):
                found.append((key, t, self.entry(t)))
        return found

    def relay(self, name: str, args: tuple, derived: list, outs: list) -> None:
        """An operation on parameters alone: its outputs are those parameters."""
        plus1 = name == "add" and any(
            isinstance(a, int | float) and not isinstance(a, bool) and a == 1
            for a in args[:2]
        )
        bits = 0
        for _, _, e in derived:
            bits |= e.bits
        if name == "_weight_norm" and len(derived) == 2:
            v, g = (d[2].sources[0].index for d in derived)
            self.weight_norm.append((g, v))
        for o in outs:
            sources: dict[int, _Source] = {}
            for slot, t, e in derived:
                for s in e.sources:
                    if s.index in sources:
                        continue
                    axes = None
                    if s.axes is not None and not (
                        name == "_weight_norm" and slot != 0
                    ):
                        axes = _axes_after(name, args, slot, t, o, s.axes)
                    sources[s.index] = _Source(s.index, axes, s.plus1 or plus1)
            self.seen[id(o)] = _Seen(o, tuple(sources.values()), bits, None)

    def use(self, name: str, args: tuple, operands: list, derived: list):
        """The first use of the parameters in `derived`, if it is; returns the
        output's normalisation tag."""
        stages = _STAGES.get(name, {})
        later = _LATER.get(name, {})
        tag = None
        for slot, t, e in derived:
            stage = stages.get(slot, 0)
            others = 0
            for slot2, t2, e2 in operands:
                if t2 is t or e2 is None or stages.get(slot2, 0) > stage:
                    continue
                others |= e2.bits
            for s in e.sources:
                key = self.key(s.index)
                if key not in self.positions:
                    self.positions[key] = (self.count + later.get(slot, 0),)
                    self.needs[key] = (1 << s.index, others)
                    self.reads[key] = frozenset(
                        self.root(t2, e2)
                        for _, t2, e2 in operands
                        if e2 is not None
                        and (e2.bits or e2.root is not None)
                        and not _held(e2)
                    )
                self.roles(name, args, slot, s, operands, key)
                kind = self.scaled(name, slot, operands, s, key)
                if kind is not None:
                    tag = kind
        self.count += max(later.values(), default=0)
        return tag

    def roles(
        self, name: str, args: tuple, slot: Any, s: _Source, operands: list, key: Any
    ) -> None:
        """What the operation makes of the parameter `s` in `slot` (recorded under
        `key`): a norm's weight or bias, a convolution's kernel, a product's
        contracted axes."""
        if name in _NORMS and slot in ("weight", "bias"):
            role = ":bias" if slot == "bias" else ""
            self.norms.setdefault(key, _NORMS[name] + ("+1" if s.plus1 else "") + role)
            at = _EPS.get(name)
            eps = self.kwargs.get("eps", args[at] if len(args) > at else None)
            if isinstance(eps, int | float):
                self.eps.setdefault(key, float(eps))
        if slot == _ADDED.get(name) or (
            name == "add"
            and any(self.product(t) for sl, t, _ in operands if sl != slot)
        ):  # a bias: `F.linear`'s, or added to a product's result (`x @ w.T + b`)
            self.added.setdefault(key, True)
        if s.axes is None or None in s.axes:
            return
        axes = tuple(a for a in s.axes if a is not None)
        if slot == "weight" and name.startswith("conv_transpose"):
            self.convolved.setdefault(key, (axes[1], axes[0], *axes[2:]))
        elif slot == "weight" and name in ("conv1d", "conv2d", "conv3d"):
            self.convolved.setdefault(key, tuple(axes))
        else:
            product = _product(name, args, slot, axes)
            if product is not None:
                self.contracted.setdefault(key, product)

    def scaled(self, name: str, slot: Any, operands: list, s: _Source, key: Any):
        """`w * x` with `x` normalised, then `+ b`: the norm's weight and bias."""
        if name not in ("mul", "add") or len(operands) != 2:
            return None
        other = next((e for sl, _, e in operands if sl != slot), None)
        tag = None if other is None else other.tag
        if tag is None:
            return None
        kind, centred = tag[:2]
        if (name, kind) not in (("mul", "normed"), ("add", "scaled")):
            return None
        what = "mean" if centred else "rms"
        role = "" if name == "mul" else ":bias"
        self.norms.setdefault(key, what + ("+1" if s.plus1 else "") + role)
        if len(tag) > 2 and tag[2] is not None:
            self.eps.setdefault(key, tag[2])
        return ("scaled", centred, *tag[2:]) if name == "mul" else None

    def tag(self, name: str, args: tuple, operands: list):
        """The normalisation tag of an operation's output on activations: a mean,
        a centred value, a square, a variance, its inverse root, a normalised
        value (`x * rsqrt(var + eps)`)."""
        tags = [None if e is None else e.tag for _, _, e in operands]
        if name not in _TAGGING and not any(tags):
            return None  # (a shortcut: every case below needs a tag then)
        first = tags[0] if tags else None
        centred = bool(first and first[1])
        kinds = [t[0] if t else None for t in tags]
        if name in ("mean",):
            return ("var", centred) if kinds[0] == "sq" else ("mean", False)
        if name in ("var", "var_mean"):
            return ("var", True)
        if name in ("std", "std_mean"):
            return ("std", True)
        if name == "sub" and len(kinds) == 2 and kinds[1] == "mean":
            return ("centred", True)
        if name == "pow" and len(args) > 1 and isinstance(args[1], int | float):
            power = args[1]
            if power == 2:
                return ("sq", centred)
            if kinds[0] == "var" and power == -0.5:
                return ("inv", centred, *first[2:])
            if kinds[0] == "var" and power == 0.5:
                return ("std", centred, *first[2:])
        if name == "square" or (
            name == "mul" and len(operands) == 2 and operands[0][1] is operands[1][1]
        ):
            return ("sq", centred)
        if name == "add" and kinds[0] in ("var", "std") and len(operands) <= 2:
            if len(operands) == 1 or operands[1][2] is None:
                eps = next((a for a in args[1:] if isinstance(a, int | float)), None)
                return (*first[:2], float(eps)) if eps is not None else first
        eps = first[2:] if first else ()
        if name == "rsqrt" and kinds[0] == "var":
            return ("inv", centred, *eps)
        if name == "sqrt" and kinds[0] == "var":
            return ("std", centred, *eps)
        if name == "reciprocal" and kinds[0] == "std":
            return ("inv", centred, *eps)
        if name in ("mul", "div") and len(tags) == 2:
            wanted = "inv" if name == "mul" else "std"
            for k in (0, 1) if name == "mul" else (1,):
                scale, x = tags[k], tags[1 - k]
                if scale is not None and scale[0] == wanted:
                    return ("normed", bool(scale[1] or (x and x[1])), *scale[2:])
        if (
            name in _PASS_TAG
            and len(operands) >= 1
            and kinds[0] in ("normed", "scaled", "centred")
        ):
            return first
        return None


_NO_TENSORS = frozenset({int, float, bool, str, slice, type(Ellipsis)})
"""Types of arguments that hold no tensor (`_Recorder.operands` skips them)."""


def _held(e: _Seen | None) -> bool:
    """Whether a tensor is computed from parameters alone (a weight, `w.t()`)."""
    return e is not None and bool(e.sources)


def _tensors_in(x: Any, tensor: type) -> list:
    """The tensors in an argument or a result: itself, or inside lists, tuples
    (named ones too: a model's output) and dicts."""
    if isinstance(x, tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _tensors_in(v, tensor)]
    if isinstance(x, Mapping):
        return [t for v in x.values() for t in _tensors_in(v, tensor)]
    return []


def _axes_after(
    name: str, args: tuple, slot: Any, t: Any, o: Any, axes: tuple
) -> tuple | None:
    """The stored axes of `o`'s axes, `o` made by `name` from `t` whose axes are the
    stored `axes`; None where not known."""
    rank = t.dim()
    if slot == 0:
        if name == "T" or (name == "t" and rank <= 2):
            return tuple(reversed(axes))
        if name == "mT" and rank >= 2:
            return (*axes[:-2], axes[-1], axes[-2])
        if name == "transpose" and len(args) >= 3:
            a, b = (d % rank for d in args[1:3])
            out = list(axes)
            out[a], out[b] = out[b], out[a]
            return tuple(out)
        if name == "permute":
            dims = (
                args[1]
                if len(args) == 2 and isinstance(args[1], list | tuple)
                else args[1:]
            )
            return tuple(axes[d % rank] for d in dims)
        if name == "unsqueeze" and len(args) >= 2:
            d = args[1] % (rank + 1)
            return (*axes[:d], None, *axes[d:])
        if name == "getitem" and len(args) >= 2:
            return _indexed(args[1], axes)
        if name in ("expand", "expand_as", "broadcast_to"):
            return (None,) * (o.dim() - rank) + tuple(axes)
    if tuple(o.shape) == tuple(t.shape):
        return axes
    if name in _SAME_RANK and o.dim() == rank:
        return axes
    if name == "squeeze" and o.dim() < rank:
        kept = [a for a, n in zip(axes, t.shape) if n != 1]
        return tuple(kept) if len(kept) == o.dim() else None
    return None


def _indexed(index: Any, axes: tuple) -> tuple | None:
    """The axes after `w[index]` with slices, integers, None and `...` only."""
    items = index if isinstance(index, tuple) else (index,)
    taken = sum(1 for i in items if i is not None and i is not Ellipsis)
    out: list = []
    k = 0
    for i in items:
        if i is None:
            out.append(None)
        elif i is Ellipsis:
            n = len(axes) - taken
            out.extend(axes[k : k + n])
            k += n
        elif isinstance(i, slice):
            out.append(axes[k])
            k += 1
        elif isinstance(i, int) and not isinstance(i, bool):
            k += 1
        else:
            return None
    return (*out, *axes[k:])


def _product(name: str, args: tuple, slot: Any, axes: tuple) -> Contraction | None:
    """How the parameter in `slot` (its stored `axes`) meets the input in a product."""
    rank = len(axes)
    if name == "linear" and slot == "weight" and rank == 2:
        return Contraction((axes[1],), (axes[0],), ())
    if name == "multi_head_attention_forward" and slot in (
        "in_proj_weight",
        "out_proj_weight",
    ):
        return Contraction((axes[1],), (axes[0],), ())
    right = {
        "addmm": "mat2",
        "matmul": "other",
        "mm": "mat2",
        "bmm": "mat2",
        "baddbmm": "batch2",
        "addbmm": "batch2",
    }
    left = {
        "addmm": "mat1",
        "matmul": "input",
        "mm": "input",
        "bmm": "input",
        "baddbmm": "batch1",
        "addbmm": "batch1",
    }
    if name in right and slot == right[name]:
        if rank == 1:
            return Contraction((axes[0],), (), ())
        return Contraction((axes[-2],), (axes[-1],), tuple(axes[:-2]))
    if name in left and slot == left[name]:
        if rank == 1:
            return Contraction((axes[0],), (), ())
        return Contraction((axes[-1],), (axes[-2],), tuple(axes[:-2]))
    if name == "einsum" and isinstance(args[0], str) and isinstance(slot, int):
        return _einsum(args[0], slot, axes)
    return None


def _einsum(equation: str, k: int, axes: tuple) -> Contraction | None:
    equation = equation.replace(" ", "")
    given, _, result = equation.partition("->")
    terms = given.split(",")
    if k >= len(terms) or "." in terms[k] or len(terms[k]) != len(axes):
        return None
    if not _:
        letters = "".join(terms)
        result = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    mine = terms[k]
    others = [t for j, t in enumerate(terms) if j != k]
    elsewhere = set("".join(others))
    contracted = [c for c in mine if c in elsewhere and c not in result]
    first = next((t for t in others if any(c in t for c in contracted)), "")
    contracted.sort(key=lambda c: first.find(c))
    batch = [c for c in mine if c in elsewhere and c in result]
    free = sorted(
        (c for c in mine if c not in elsewhere and c in result), key=result.find
    )
    at = {c: axes[i] for i, c in enumerate(mine)}
    return Contraction(
        tuple(at[c] for c in contracted),
        tuple(at[c] for c in free),
        tuple(at[c] for c in batch),
    )


def _mode_class(torch: Any) -> type:
    from torch.overrides import TorchFunctionMode

    class _Mode(TorchFunctionMode):
        def __init__(self, recorder: _Recorder):
            super().__init__()
            self.recorder = recorder

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            recorder = self.recorder
            named = recorder.names.get(func) or _name_of(func, recorder.names)
            out = on_meta(named[0], func, args, kwargs, torch)
            if out is None:
                out = func(*args, **kwargs)
            recorder.record(func, args, kwargs, out, named)
            return out

    return _Mode


def _named_tensors(module: Any) -> tuple[list[str], list[Any], list[int]]:
    """The module's state-dict names, the distinct tensors (parameters and
    persistent buffers) in order, and each name's tensor index."""
    names: list[str] = []
    objects: list[Any] = []
    index: dict[int, int] = {}
    of: list[int] = []
    torch = importlib.import_module("torch")
    for name, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        i = index.setdefault(id(t), len(objects))
        if i == len(objects):
            objects.append(t)
        names.append(name)
        of.append(i)
    return names, objects, of


def _fake_mode(objects: list[Any]) -> Any:
    for t in objects:
        mode = getattr(t, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _to_torch(x: Any, torch: Any, fake: Any, meta: bool) -> Any:
    """An input as a torch tensor like the module's parameters (meta, fake, fake
    on the meta device, or real); integer arrays as int64 (PyTorch's index type);
    anything else as it is."""
    if isinstance(x, torch.Tensor):
        t = x
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
        dtype = np.dtype(x.dtype)
        if dtype.kind in "iu":
            dtype = np.dtype(np.int64)
        if hasattr(x, "__array__"):
            t = torch.from_numpy(np.array(x, dtype=dtype))
        else:  # a shape and a dtype only (jax.ShapeDtypeStruct)
            t = torch.zeros(
                tuple(x.shape), dtype=torch.from_numpy(np.zeros(0, dtype)).dtype
            )
    elif isinstance(x, Mapping):
        return {k: _to_torch(v, torch, fake, meta) for k, v in x.items()}
    elif isinstance(x, list | tuple):
        return type(x)(_to_torch(v, torch, fake, meta) for v in x)
    else:
        return x
    if meta and t.device.type != "meta" and not hasattr(t, "fake_mode"):
        t = t.to("meta")
    if fake is not None and not hasattr(t, "fake_mode"):
        t = fake.from_tensor(t)
    return t


def forward_kwargs(module: Any, inputs: tuple, kwargs: dict) -> dict:
    """The keyword arguments the module's `forward` names and the positional inputs
    do not already give: the example's keyword arguments are often the JAX
    model's (Flax's `deterministic=`), which a PyTorch `forward` does not take."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    given = list(params)[: len(inputs)]
    return {k: v for k, v in kwargs.items() if k in params and k not in given}


def _with_mask(module: Any, inputs: tuple, kwargs: dict, torch: Any) -> dict:
    """An attention mask of ones for a text model given token ids alone (fake
    tensors cannot take the data-dependent path taken without one)."""
    if "attention_mask" in kwargs or len(inputs) != 1:
        return kwargs
    ids = inputs[0]
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dtype.is_floating_point
        or ids.dim() != 2
    ):
        return kwargs
    try:
        wanted = "attention_mask" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    return {**kwargs, "attention_mask": torch.ones_like(ids)} if wanted else kwargs


@paused()  # thousands of short-lived records: see bridge/_gc.py
def trace_module(
    module: Any, inputs: Any = (), kwargs: Mapping[str, Any] | None = None
) -> Uses:
    """What one forward pass of a `torch.nn.Module` does with each parameter and
    persistent buffer.

    Runs `module(*inputs, **kwargs)` once, under `torch.no_grad()` and a
    `TorchFunctionMode` that records every operation (see the module docstring).
    A module whose parameters are fake tensors or on the `meta` device computes
    nothing: its inputs are made fake (or meta) too, and a text model given token
    ids alone gets an attention mask of ones. A meta module whose code reads a
    value is run again on fake copies of its tensors (on the CPU, no memory),
    swapped in for the call only (`torch.func.functional_call`). A module of real
    tensors runs on copies of its buffers, swapped in likewise: the module is
    never changed.

    **Arguments:**

    - `module`: a `torch.nn.Module` (its mode, eval or train, as it is).
    - `inputs`: the positional inputs (one array, or a tuple): numpy or JAX arrays,
      `jax.ShapeDtypeStruct`s (zeros of that shape) or torch tensors. Integer
      arrays become int64.
    - `kwargs`: keyword arguments of the call (arrays converted the same way).

    **Returns:**

    A `bridge._uses.Uses`, by state-dict name.

    **Example** (needs torch, so not run as a doctest; `tests/test_torch_trace.py`
    runs it):

    ```python
    import torch
    from bridge._adapters._torch_trace import trace_module

    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    uses = trace_module(m, (torch.ones(2, 3),))
    uses.contracted["0.weight"]  # Contraction(inputs=(1,), outputs=(0,), batch=())
    uses.norms["1.weight"]  # 'mean'
    ```
    """
    names, objects, of = _named_tensors(module)
    fake = _fake_mode(objects)
    meta = fake is None and any(t.device.type == "meta" for t in objects)
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    if fake is not None:
        return _run(module, names, objects, of, inputs, kwargs, fake, None)
    if not meta:
        return _real(module, names, objects, of, inputs, kwargs)
    try:  # the meta device: ~3x cheaper than fake tensors where it runs
        return _run(module, names, objects, of, inputs, kwargs, None, None)
    except (RuntimeError, NotImplementedError):  # a value read (`.item()`)
        fake_tensor = importlib.import_module("torch._subclasses.fake_tensor")
        fake = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [_fake_copy(fake, t) for t in objects]
        return _run(module, names, fakes, of, inputs, kwargs, fake, fakes)


def _real(module, names, objects, of, inputs, kwargs) -> Uses:
    """The record of a module holding real tensors, which the pass never changes:
    it runs on the module's parameters and copies of its buffers, swapped in for
    the call (a BatchNorm in training mode updates its statistics: the caller's
    stay as they were). Not on meta copies, which cost nothing per weight: PyTorch's
    first meta operations in a process take 0.3 s, and transformers' masks read
    values (`.item()`), which meta tensors refuse."""
    buffers = {id(b) for b in module.buffers()}
    copies = [t.clone() if id(t) in buffers else t for t in objects]
    return _run(module, names, copies, of, inputs, kwargs, None, copies)


def _fake_copy(fake: Any, t: Any) -> Any:
    """A fake tensor like the meta tensor `t`, on the CPU."""
    torch = importlib.import_module("torch")
    with fake:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def _run(module, names, objects, of, inputs, kwargs, fake, swapped) -> Uses:
    """One recorded forward pass; `swapped`: the module's tensors replaced, for
    this call only, by these (`torch.func.functional_call`)."""
    torch = importlib.import_module("torch")
    meta = any(t.device.type == "meta" for t in objects)
    args = _to_torch(inputs, torch, fake, meta)
    call: dict[str, Any] = _to_torch(dict(kwargs or {}), torch, fake, meta)
    call = forward_kwargs(module, inputs, call)
    if fake is not None or meta:
        call = _with_mask(module, args, call, torch)
    tied: dict[int, list[str]] = {}
    for n, i in zip(names, of):
        tied.setdefault(i, []).append(n)
    tied = {i: ns for i, ns in tied.items() if len(ns) > 1}
    owners: dict[int, list[str]] = {}
    if tied:  # which name of a tied tensor a use is: the running module's
        for n, m in module.named_modules(remove_duplicate=False):
            owners.setdefault(id(m), []).append(n)
    recorder = _Recorder(torch, objects, tied, owners)
    for t in _tensors_in((args, call), torch.Tensor):  # the model's inputs
        recorder.root(t, recorder.entry(t))
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if tied:
            stack.enter_context(_calls(torch, recorder.calls))
        if fake is not None:
            stack.enter_context(fake)
        if meta:
            stack.enter_context(_autocast_on_meta(torch))
        stack.enter_context(_mode_class(torch)(recorder))
        if swapped is None:
            recorder.output(module(*args, **call))
        else:  # and the non-persistent buffers (BERT's `position_ids`) likewise
            tensors = {n: swapped[i] for n, i in zip(names, of)}
            for n, t in module.named_buffers(remove_duplicate=False):
                if n not in tensors:
                    tensors[n] = t.clone() if fake is None else _fake_copy(fake, t)
            out = torch.func.functional_call(module, tensors, args, call, strict=True)
            recorder.output(out)
    return _uses(recorder, names, of)


@contextlib.contextmanager
def _autocast_on_meta(torch: Any) -> Any:
    """`torch.autocast(device_type="meta", ...)` opened as the CPU's while a meta
    pass runs: transformers 4.x's rotary embeddings open
    `torch.autocast(device_type=x.device.type, enabled=False)`, which PyTorch
    refuses for `meta` ("unsupported scalarType"), and the pass then ran again on
    fake tensors, 5-10x slower (a 64-layer Llama: 1.0 s against 0.1-0.2 s, the
    same record). Autocast changes nothing on meta tensors, whichever device it
    names; any other device is opened as asked."""
    autocast = torch.amp.autocast_mode.autocast
    opened = autocast.__init__

    def init(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        device_type = "cpu" if device_type == "meta" else device_type
        opened(self, device_type, *args, **kwargs)

    autocast.__init__ = init
    try:
        yield
    finally:
        autocast.__init__ = opened


@contextlib.contextmanager
def _calls(torch: Any, calls: list[Any]) -> Any:
    """Keep `calls` the stack of modules whose `forward` runs (global module hooks,
    removed on exit)."""
    hooks = torch.nn.modules.module

    def enter(module: Any, *_: Any) -> None:
        calls.append(module)

    def leave(module: Any, *_: Any) -> None:
        if calls and calls[-1] is module:
            calls.pop()

    handles = [
        hooks.register_module_forward_pre_hook(enter),
        hooks.register_module_forward_hook(leave, always_call=True),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _weight_name(g: str, v: str) -> str:
    """The weight that weight normalisation computes from `g` and `v`."""
    for a, b in ((".weight_g", ".weight_v"), ("_g", "_v")):
        if g.endswith(a) and v.endswith(b) and g[: -len(a)] == v[: -len(b)]:
            return g[: -len(a)] + a[: -len("_g")]
    tail = ".original0", ".original1"
    if g.endswith(tail[0]) and v.endswith(tail[1]):
        head = g[: -len(tail[0])]
        module, _, name = head.rpartition(".parametrizations.")
        if name:
            return f"{module}.{name}"
    return v


_PER_NAME = (
    *("positions", "contracted", "convolved", "norms", "needs", "added", "alone"),
    *("reads", "eps"),
)
"""The fields of a `Uses` that map each name to a value."""


def _made(pick: Any, of: Any, weight_norm: dict, unused: tuple) -> Uses:
    """A `Uses` whose per-name fields are `pick` of `of`'s fields of that name."""
    fields = {f: pick(getattr(of, f)) for f in _PER_NAME}
    return Uses(
        **fields, weight_norm=weight_norm, unused=unused, merges=tuple(of.merges)
    )


def _uses(r: _Recorder, names: list[str], of: list[int]) -> Uses:
    ranks: dict[int, int] = {}  # inputs numbered in the order first read
    r.reads = {
        k: frozenset(ranks.setdefault(x, len(ranks)) for x in sorted(v))
        for k, v in r.reads.items()
    }
    first: dict[int, str] = {}
    for name, i in zip(names, of):
        first.setdefault(i, name)
    weight_norm = {
        _weight_name(first[g], first[v]): (first[g], first[v]) for g, v in r.weight_norm
    }
    # a tied tensor's names each have the uses made through their own module
    keys = [(i, n) if i in r.tied else i for n, i in zip(names, of)]
    unused = tuple(n for n, k in zip(names, keys) if k not in r.positions)
    tied = {n: first[i] for n, i in zip(names, of) if n != first[i]}
    return _made(
        lambda d: {n: d[k] for n, k in zip(names, keys) if k in d},
        r,
        weight_norm,
        unused,
    )._replace(tied=tied)


def rekeyed(uses: Uses, names: Mapping[Any, str], path: Any) -> Uses:
    """`uses` keyed by `path(names[name])`: `names` maps the module's state-dict
    names to those of a Tree (a folder's keys, a prefix taken off), `path` a Tree
    name to its leaf path. Names `names` lacks (a tie's second name, a fused weight
    that was split) are left out; a weight-normed weight is keyed by the weight
    its `g` and `v` make under the Tree's names."""
    weight_norm = {
        path(_weight_name(names[g], names[v])): (path(names[g]), path(names[v]))
        for g, v in uses.weight_norm.values()
        if g in names and v in names
    }
    unused = tuple(path(names[n]) for n in uses.unused if n in names)
    return _made(
        lambda d: {path(names[n]): v for n, v in d.items() if n in names},
        uses,
        weight_norm,
        unused,
    )
