"""Results of common operations on plain meta tensors, made without PyTorch's kernels.

On the `meta` device an operation computes nothing, but PyTorch still works out its
result's shape and dtype, for many operations in its Python reference
implementations (`torch._refs`, `torch._prims_common`): most of a meta forward
pass's time. `trace_module` (`_torch_trace`) asks `on_meta` first: for the
operations below on plain (not fake, not subclassed) floating meta tensors it makes
the result here, an empty contiguous meta tensor of the shape and dtype PyTorch
gives; for anything else (another operation, an argument it does not read, shapes
that do not fit: the operation then raises as it would) it returns None and the
operation runs as usual.

- elementwise operations (`_ELEMENTWISE`, not in place) of tensors and numbers:
  NumPy's broadcast shape, `torch.result_type`'s dtype (`silu`, `gelu`, `relu`
  with `inplace=False` too);
- `x.mean(dims, keepdim)`;
- `torch.cat(tensors, dim)` of tensors of one dtype and rank, whose last axis is
  their innermost (not channels-last);
- `F.linear(x, w, b)` of one dtype: `(*x.shape[:-1], w.shape[0])`;
- `torch.matmul(a, b)` of one dtype with both of rank 2 or more: the broadcast batch
  axes, then `(a.shape[-2], b.shape[-1])`.

**Example:** `F.linear` of a meta `x (2, 8, 16)` and `w (32, 16)` is an empty meta
tensor of shape `(2, 8, 32)`, made with `torch.empty`.
"""

from __future__ import annotations

from typing import Any


_ELEMENTWISE = frozenset(
    {
        *("add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp"),
        *("tanh", "sigmoid", "silu", "gelu", "relu", "reciprocal"),
    }
)
"""Operations whose result is the broadcast of their tensors' shapes."""

_ACTIVATIONS = frozenset({"silu", "gelu", "relu"})
"""Elementwise operations that take `inplace=False` (`F.silu(x, inplace=False)`)."""


def on_meta(name: str, func: Any, args: tuple, kwargs: dict, torch: Any) -> Any:
    """The result of `func(*args, **kwargs)` (short name `name`, as
    `_torch_trace._name_of` gives it) made here, or None where it is not (see the
    module docstring)."""
    make = _MAKERS.get(name)
    return None if make is None else make(func, args, kwargs, torch)


def _plain(t: Any, torch: Any) -> bool:
    """Whether `t` is a plain floating meta tensor."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.is_meta
        and t.dtype.is_floating_point
    )


def _elementwise(func: Any, args: tuple[Any, ...], kwargs: dict, torch: Any) -> Any:
    name = getattr(func, "__name__", "")
    if kwargs and not (
        kwargs == {"inplace": False} and name in _ACTIVATIONS and len(args) == 1
    ):
        return None
    dunder = name.startswith("__") and name.endswith("__")
    if name.startswith("__i") or (name.endswith("_") and not dunder):
        return None  # in place (`x += y`, `x.add_(y)`), not `x * y` (`__mul__`)
    if not args or len(args) > 2:
        return None
    tensors = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if not _plain(a, torch):
                return None
            tensors.append(a)
        elif not isinstance(a, int | float) or isinstance(a, bool):
            return None
    if not tensors:
        return None
    shape = _broadcast([tuple(t.shape) for t in tensors])
    if shape is None:
        return None
    dtype = tensors[0].dtype  # (a number does not promote a floating tensor)
    if len(tensors) == 2 and tensors[1].dtype != dtype:
        dtype = torch.result_type(*args)
    return torch.empty(shape, dtype=dtype, device="meta")


def _broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """NumPy's broadcast of `shapes` (None where they do not broadcast: the
    operation itself then raises as it would)."""
    first = shapes[0]
    if all(s == first for s in shapes):
        return first
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for s in shapes:
        for i, n in enumerate(s, rank - len(s)):
            if n != 1:
                if out[i] not in (1, n):
                    return None
                out[i] = n
    return tuple(out)


def _mean(func: Any, args: tuple[Any, ...], kwargs: dict, torch: Any) -> Any:
    """`x.mean(dims, keepdim=...)`."""
    x: Any = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not _plain(x, torch):
        return None
    if set(kwargs) - {"dim", "keepdim"} or len(args) > 3:
        return None
    dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    if dims is None or not isinstance(keep, bool):
        return None
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if not all(isinstance(d, int) for d in dims) or not x.dim():
        return None
    axes = {d % x.dim() for d in dims}
    shape = [1 if i in axes else n for i, n in enumerate(x.shape)]
    if not keep:
        shape = [n for i, n in enumerate(x.shape) if i not in axes]
    return torch.empty(shape, dtype=x.dtype, device="meta")


def _cat(func: Any, args: tuple[Any, ...], kwargs: dict, torch: Any) -> Any:
    """`torch.cat(tensors, dim)`: one dtype and rank, equal but along `dim`."""
    if len(args) not in (1, 2) or set(kwargs) - {"dim"}:
        return None
    tensors: Any = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if not isinstance(tensors, list | tuple) or not tensors:
        return None
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or not first.dim():
        return None
    rank, dtype = first.dim(), first.dtype
    d = dim % rank if -rank <= dim < rank else None
    if d is None:
        return None
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not _plain(t, torch):
            return None
        if t.dtype != dtype or t.dim() != rank or t.stride(-1) != 1:
            return None  # promoted, a legacy empty tensor, or channels-last
        if rank >= 4 and t.shape[1] == 1:
            return None  # one channel: its memory format is ambiguous
        if any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != d):
            return None
        total += t.shape[d]
    shape = (*first.shape[:d], total, *first.shape[d + 1 :])
    return torch.empty(shape, dtype=dtype, device="meta")


def _linear(func: Any, args: tuple[Any, ...], kwargs: dict, torch: Any) -> Any:
    """`F.linear(x, w, b)`: `(*x.shape[:-1], w.shape[0])`."""
    if set(kwargs) - {"bias"} or not 2 <= len(args) + len(kwargs) <= 3:
        return None
    x: Any = args[0]
    w: Any = args[1] if len(args) > 1 else None
    b: Any = args[2] if len(args) > 2 else kwargs.get("bias")
    for t in (x, w) if b is None else (x, w, b):
        if not isinstance(t, torch.Tensor) or not _plain(t, torch):
            return None
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        return None
    if x.dtype != w.dtype or (b is not None and b.dtype != w.dtype):
        return None
    if b is not None and tuple(b.shape) != (w.shape[0],):
        return None
    return torch.empty((*x.shape[:-1], w.shape[0]), dtype=w.dtype, device="meta")


def _matmul(func: Any, args: tuple[Any, ...], kwargs: dict, torch: Any) -> Any:
    """`torch.matmul(a, b)`, `a @ b`, both of rank 2 or more."""
    if kwargs or len(args) != 2 or getattr(func, "__name__", "") == "__rmatmul__":
        return None
    a, b = args
    for t in (a, b):
        if not isinstance(t, torch.Tensor) or not _plain(t, torch) or t.dim() < 2:
            return None
    if a.dtype != b.dtype or a.shape[-1] != b.shape[-2]:
        return None
    batch = _broadcast([tuple(a.shape[:-2]), tuple(b.shape[:-2])])
    if batch is None:
        return None
    shape = (*batch, a.shape[-2], b.shape[-1])
    return torch.empty(shape, dtype=a.dtype, device="meta")


_MAKERS = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    "mean": _mean,
    "cat": _cat,
    "linear": _linear,
    "matmul": _matmul,
}
"""`{short name: the function making its result}`."""
