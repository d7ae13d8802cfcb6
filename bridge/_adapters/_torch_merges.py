"""Where a PyTorch forward pass merges activations, in the words of a JAX program.

Layers side by side (attention's query, key and value; a gated MLP's gate and up)
are told apart by what their outputs flow into (`bridge._port._branches`). On a JAX
side that is read from the traced program; a PyTorch module's recorder
(`_torch_trace`) notes instead, at each operation that takes two or more
activations computed from different parameters, a *merge*: the operation's name as
JAX's primitive for it (`torch.matmul` and `torch.einsum` are `dot_general`,
`torch.cat` is `concatenate`), and per activation its place in it and the bits of
the parameters it is computed from (`Uses.needs`' bits). `_branches.recorded`
reads a group's signatures from these, as `_branches.branches` does from a program.

A place is what it is in `_branches._place`: None where places do not matter
(`add`, `mul`); for a product, 0 if the operand's free axes come first in the
result (`q @ k.T`: the query's rows), else 1; else the operand's position.
`F.scaled_dot_product_attention(q, k, v)` is the two products it computes:
`q @ k.T` (q at 0, k at 1), then the probabilities, computed from q and k, times v
(at 1). A model's outputs are merges of one operand (`"output"`, place None: which
output is which is each framework's own order).

**Example:** `torch.matmul(q, k.transpose(-1, -2))`, with q and k computed from the
parameters of bits `0b01` and `0b10`, is `("dot_general", ((0, 0b01), (1, 0b10)))`.
"""

from __future__ import annotations

from typing import Any


Merge = tuple[str, tuple[tuple[int | None, int], ...]]
"""`(JAX primitive name, ((place, parameter bits), ...) per activation)`."""

_AS_JAX = {
    **dict.fromkeys(
        ("matmul", "mm", "bmm", "einsum", "addmm", "baddbmm", "addbmm"), "dot_general"
    ),
    "cat": "concatenate",
    "maximum": "max",
    "minimum": "min",
}

_COMMUTATIVE = frozenset({"add", "mul", "max", "min", "maximum", "minimum"})

_MATRICES = {"input": 0, "mat1": 0, "batch1": 0, "other": 1, "mat2": 1, "batch2": 1}
"""A product's operand places by argument name (`addmm`'s `input` is added)."""

_ATTENTION = {"query": 0, "key": 1, "value": 2}


def merges(name: str, args: tuple, operands: list[tuple[Any, int, int]]) -> list[Merge]:
    """The merges one operation makes.

    **Arguments:**

    - `name`: the operation's short name (`_torch_trace._name_of`: `matmul`, `add`).
    - `args`: its positional arguments (an einsum's equation).
    - `operands`: per activation operand, `(slot, position, bits)`: the argument's
      name or position (`_torch_trace._Recorder.operands`), its position among the
      operation's tensors, and the bits of the parameters it is computed from.

    **Returns:**

    A list of `Merge`s (two for an attention), empty where the operation takes
    one activation, or several computed from the same parameters (but for a
    product: `q @ k.T` after one norm, `_branches.Branch.product`).
    """
    product = name == "scaled_dot_product_attention" or _AS_JAX.get(name) == (
        "dot_general"
    )
    if len(operands) < 2 or (
        not product and len({bits for _, _, bits in operands}) < 2
    ):
        return []  # (a product of two values of one layer is its `Branch.product`)
    if name == "scaled_dot_product_attention":
        by = {_ATTENTION.get(slot, slot): bits for slot, _, bits in operands}
        q, k, v = (by.get(j, 0) for j in range(3))
        return [
            ("dot_general", ((0, q), (1, k))),
            ("dot_general", ((0, q | k), (1, v))),
        ]
    return [
        (
            _AS_JAX.get(name, name),
            tuple((_place(name, args, slot, at), bits) for slot, at, bits in operands),
        )
    ]


def _place(name: str, args: tuple, slot: Any, at: int) -> int | None:
    if name in _COMMUTATIVE:
        return None
    if name == "einsum" and isinstance(args[0], str) and isinstance(slot, int):
        return _einsum_place(args[0], slot)
    if name in _AS_JAX and _AS_JAX[name] == "dot_general":
        return _MATRICES.get(slot, at)
    return at


def _einsum_place(equation: str, k: int) -> int:
    """Operand `k`'s place in a two-operand einsum: 0 if its free letters come
    first in the result, else 1 (its position where a side has none)."""
    given, arrow, result = equation.replace(" ", "").partition("->")
    terms = given.split(",")
    if len(terms) != 2 or k > 1:
        return k
    if not arrow:
        letters = "".join(terms)
        result = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    free = [
        [result.find(c) for c in t if c in result and c not in o]
        for t, o in ((terms[0], terms[1]), (terms[1], terms[0]))
    ]
    if not free[0] or not free[1]:
        return k
    return 0 if min(free[k]) < min(free[1 - k]) else 1
