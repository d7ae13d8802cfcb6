"""Normalisations in a traced JAX program, read from what they compute.

A weight that scales (or shifts) an activation divided by its own root mean square
is a norm's, whatever its module or name: `x * rsqrt(mean(x ** 2) + eps) * w` is an
RMS norm's scale; with `x - mean(x)` and a centred variance, a mean-subtracting
norm's (LayerNorm, GroupNorm); `... * (1 + w)` the offset form (Gemma's, Griffin's);
the weight added after the scale, its bias. The same facts the PyTorch recorder reads
(`bridge/_adapters/_torch_trace.py`), read here from a jaxpr, one equation at a time:
each activation carries a tag (`Tag`): a mean, a centred value, a square, a
variance (with the `eps` added to it), its inverse root, a normalised value, a
scaled one. Seen through: casts, broadcasts, reshapes, `jit`s and `custom_jvp`s (the
caller carries the tags across: `Norms.enter`, `Norms.leave`).

Recorded per leaf (`Norms.found`): `"mean"`, `"rms"`, `"mean+1"` or `"rms+1"` for a
scale, the same with `":bias"` for a bias; and the `eps` the variance was given
(`Norms.eps`).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Tag(NamedTuple):
    """What an activation is, as far as normalisation goes: `kind` one of `sum`,
    `mean`, `sqmean` (a mean squared), `centred`, `sq`, `ssq` (a sum of squares),
    `var`, `std`, `inv` (1 / std), `normed`, `scaled`; `centred` whether the
    mean was subtracted; `eps` the constant added to the variance (None: none
    seen)."""

    kind: str
    centred: bool = False
    eps: float | None = None


_PASS = frozenset(
    {
        "convert_element_type",
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "copy",
        "copy_p",
        "reduce_precision",
        "max",
        "min",
        "stop_gradient",
    }
)
"""Operations that keep an activation's tag (`max(var, 0)` included)."""


def _literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _value(v: Any) -> float | None:
    """A literal's value as a float, else None."""
    if not _literal(v):
        return None
    try:
        return float(v.val)
    except (TypeError, ValueError):
        return None


class Norms:
    """The normalisation tags of one traced program (`step` per equation)."""

    def __init__(self) -> None:
        self.tags: dict[Any, Tag] = {}
        self.plus1: dict[Any, int] = {}  # variables that are a weight plus one
        self.found: dict[int, str] = {}
        self.eps: dict[int, float] = {}

    def enter(self, outer: list[Any], inner: list[Any]) -> None:
        """A sub-computation's inputs get the tags (and offsets) of the operands
        they are."""
        for o, i in zip(outer, inner):
            if _literal(o):
                continue
            if o in self.tags:
                self.tags[i] = self.tags[o]
            if o in self.plus1:
                self.plus1[i] = self.plus1[o]

    def leave(self, inner: list[Any], outer: list[Any]) -> None:
        """A sub-computation's results get the tags of what it returns."""
        for i, o in zip(inner, outer):
            if not _literal(i) and i in self.tags:
                self.tags[o] = self.tags[i]

    def step(self, eqn: Any, weights: dict[int, int], fed: set[Any]) -> None:
        """Read one equation. `weights`: `{operand position: leaf}` of its
        operands that are weights (as stored, or only relaid out or changed element
        by element: `1 + w`); `fed`: the variables computed from the inputs."""
        name = eqn.primitive.name
        ins, outs = eqn.invars, eqn.outvars
        if len(outs) != 1:
            return
        out = outs[0]
        weights = {  # a weight plus one (`1 + w`, broadcast since): that weight
            **weights,
            **{
                i: self.plus1[v]
                for i, v in enumerate(ins)
                if not _literal(v) and v in self.plus1
            },
        }
        if weights:
            self._weighted(name, ins, out, weights)
            return
        tags = [None if _literal(v) else self.tags.get(v) for v in ins]
        tag = self._tag(eqn, name, ins, tags, fed)
        if tag is not None:
            self.tags[out] = tag

    def _weighted(
        self, name: str, ins: list[Any], out: Any, weights: dict[int, int]
    ) -> None:
        """A weight meets an activation: a norm's scale (a `mul` with an inverse
        root or a normalised value) or bias (an `add` to a scaled value); a
        weight plus one (`1 + w`) is kept as one."""
        if name == "add" and len(ins) == 2 and len(weights) == 1:
            ((i, leaf),) = weights.items()
            other = ins[1 - i]
            if _value(other) == 1.0:
                self.plus1[out] = leaf
                return
            tag = None if _literal(other) else self.tags.get(other)
            if tag is not None and tag.kind in ("scaled", "normed"):
                self._record(leaf, tag, False, ":bias")
            return
        if name in _PASS and len(ins) >= 1 and ins[0] in self.plus1:
            self.plus1[out] = self.plus1[ins[0]]
            return
        if name != "mul" or len(ins) != 2 or len(weights) != 1:
            return
        ((i, leaf),) = weights.items()
        other = ins[1 - i]
        tag = None if _literal(other) else self.tags.get(other)
        if tag is None or tag.kind not in ("inv", "normed"):
            return
        self._record(leaf, tag, ins[i] in self.plus1)
        self.tags[out] = tag if tag.kind == "inv" else Tag("scaled", *tag[1:])

    def _record(self, leaf: int, tag: Tag, plus1: bool, role: str = "") -> None:
        if leaf in self.found:
            return
        kind = ("mean" if tag.centred else "rms") + ("+1" if plus1 else "")
        self.found[leaf] = kind + role
        if tag.eps is not None:
            self.eps[leaf] = tag.eps

    def _tag(
        self, eqn: Any, name: str, ins: list[Any], tags: list, fed: set[Any]
    ) -> Tag | None:
        """The tag of an equation's result computed from activations alone."""
        first = tags[0] if tags else None
        activation = [not _literal(v) and v in fed for v in ins]
        if name in _PASS:
            tagged = [t for t in tags if t is not None]
            return tagged[0] if len(tagged) == 1 else None
        if name == "select_n":  # jnp.where(n > 0, var, nan): the value kept
            tagged = [t for t in tags[1:] if t is not None]
            return tagged[0] if len(tagged) == 1 else None
        square = (
            name == "square"
            or (name == "integer_pow" and eqn.params.get("y") == 2)
            or (name == "pow" and len(ins) == 2 and _value(ins[1]) == 2.0)
            or (name == "mul" and len(ins) == 2 and ins[0] is ins[1])
        )
        if square and activation[0]:
            if first is not None and first.kind == "mean":
                return Tag("sqmean")
            return Tag("sq", first is not None and first.kind == "centred")
        if name == "reduce_sum" and activation[0]:
            if first is None:
                return Tag("sum")
            if first.kind == "sq":
                return Tag("ssq", first.centred)
            return None
        if name in ("div", "mul") and len(ins) == 2:
            return self._product(name, ins, tags, activation)
        if name == "sub" and len(ins) == 2:
            a, b = tags
            if b is not None and b.kind == "mean" and activation[0]:
                if a is None or a.kind == "centred":
                    return Tag("centred", True)
            if a is not None and a.kind == "var" and b is not None:
                if b.kind == "sqmean":  # mean(x ** 2) - mean(x) ** 2
                    return Tag("var", True, a.eps)
            return None
        if name == "add" and len(ins) == 2 and first is not None:
            if first.kind in ("var", "std") and not activation[1]:
                eps = _value(ins[1])
                eps = first.eps if eps is None else eps
                return Tag(first.kind, first.centred, eps)
            return None
        if name == "add" and len(ins) == 2 and tags[1] is not None:
            if tags[1].kind in ("var", "std") and not activation[0]:
                eps = _value(ins[0])
                return Tag(tags[1].kind, tags[1].centred, eps)
            return None
        if first is not None and first.kind == "var":
            if name == "rsqrt":
                return Tag("inv", first.centred, first.eps)
            if name == "sqrt":
                return Tag("std", first.centred, first.eps)
            if name == "pow" and _value(ins[1]) == -0.5:
                return Tag("inv", first.centred, first.eps)
        return None

    def _product(
        self, name: str, ins: list[Any], tags: list, activation: list[bool]
    ) -> Tag | None:
        a, b = tags
        if a is not None and not activation[1]:  # by a constant: a mean
            if a.kind == "ssq":
                return Tag("var", a.centred)
            if a.kind == "sum":
                return Tag("mean")
        if name == "div":
            if b is not None and b.kind == "std" and activation[0]:
                centred = b.centred or (a is not None and a.kind == "centred")
                return Tag("normed", centred, b.eps)
            if b is not None and b.kind == "std" and not activation[0]:
                return Tag("inv", b.centred, b.eps)  # 1 / std
            return None
        for inv, x, xa in ((a, b, activation[1]), (b, a, activation[0])):
            if inv is not None and inv.kind == "inv" and xa:
                if x is None or x.kind == "centred":
                    centred = inv.centred or x is not None
                    return Tag("normed", centred, inv.eps)
        return None
