"""A weight kept quantized: `QuantizedArray`, the leaf `bridge.load(...,
keep_quantized=True)` puts where a dense model has a quantized checkpoint's weight.

It holds the checkpoint's own tensors (`parts`: the FP8 or packed integers, the
scales, zero points, group indices), exactly as stored, and the static description
of its scheme (`Scheme`: which one, bits, block or group settings, the dense shape and
dtype, the layout changes a port made). `dequantize()` gives the dense weight with
`jax.numpy`, inside `jax.jit` or eagerly, bit for bit what the dequantizing load
gives (the same float32 products and roundings as `bridge._quant`'s NumPy
dequantizations). Where JAX or NumPy needs an array (`x @ w`, `jnp.asarray`,
`np.asarray`) it is that dense weight too (`__jax_array__`, `__array__`): never the
packed integers.

It is a JAX pytree node whose children are the parts: `jax.jit`, `jax.eval_shape`,
`eqx.tree_at`, `eqx.partition`/`combine` see through it, and its parts never
become trainable (`bridge.make_step` refuses a spec that says so). Its `shape` and
`dtype` are the dense weight's; `bridge.save` refuses it (nothing is written).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


class Scheme(NamedTuple):
    """What a `QuantizedArray`'s parts mean (static, hashable).

    - `name`: `"fp8-block"`, `"fp8"`, `"int"`, `"int-packed"`, `"gptq"` or `"awq"`
      (see `bridge._quant._schemes`).
    - `bits`: bits per value.
    - `stored`: the dense weight's shape as the checkpoint has it (PyTorch's
      `(out, in)`).
    - `dtype`: the dense dtype's name (`"bfloat16"`).
    - `settings`: `(("block", (128, 128)), ...)`: block size, group size,
      `zero_plus_one` (GPTQ's stored zeros).
    - `layout`: the layout changes from `stored` to the model's leaf, applied after
      dequantizing: `("transpose", axes)`, `("reshape", shape)`, `("astype", dtype
      name)`.
    """

    name: str
    bits: int
    stored: tuple[int, ...]
    dtype: str
    settings: tuple[tuple[str, Any], ...] = ()
    layout: tuple[tuple[str, Any], ...] = ()

    def setting(self, key: str, default: Any = None) -> Any:
        return dict(self.settings).get(key, default)


def layout_shape(shape: tuple[int, ...], layout: tuple[tuple[str, Any], ...]):
    """The shape after `layout`'s changes, and the dtype name if one casts."""
    dtype = None
    for op, arg in layout:
        if op == "transpose":
            shape = tuple(shape[a] for a in arg)
        elif op == "reshape":
            shape = tuple(arg)
        else:
            dtype = arg
    return shape, dtype


@jtu.register_pytree_with_keys_class
class QuantizedArray:
    """A weight kept quantized (see the module's note).

    **Attributes:**

    - `parts`: `{"weight": ..., "scale": ..., "zero": ..., "g_idx": ...}`, the
      checkpoint's tensors as stored (JAX arrays; under a transformation, whatever
      it puts there).
    - `scheme`: its `Scheme`.
    - `shape`, `dtype`: the dense weight's, as the model holds it (after the port's
      layout changes).
    """

    __slots__ = ("parts", "scheme")

    def __init__(self, parts: dict[str, Any], scheme: Scheme):
        self.parts = dict(parts)
        self.scheme = scheme

    # --- pytree: the parts are the children, the scheme static ------------------
    def tree_flatten_with_keys(self):
        names = tuple(sorted(self.parts))
        children = [(jtu.GetAttrKey(n), self.parts[n]) for n in names]
        return children, (names, self.scheme)

    def tree_flatten(self):
        names = tuple(sorted(self.parts))
        return [self.parts[n] for n in names], (names, self.scheme)

    @classmethod
    def tree_unflatten(cls, aux, children):
        names, scheme = aux
        new = object.__new__(cls)  # no validation: any leaves (specs, shapes)
        new.parts = dict(zip(names, children))
        new.scheme = scheme
        return new

    # --- what it stands for -----------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return layout_shape(self.scheme.stored, self.scheme.layout)[0]

    @property
    def dtype(self) -> np.dtype:
        cast = layout_shape(self.scheme.stored, self.scheme.layout)[1]
        return np.dtype(jnp.dtype(cast or self.scheme.dtype))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the parts as stored."""
        return sum(
            math.prod(np.shape(p)) * np.dtype(p.dtype).itemsize
            for p in self.parts.values()
        )

    def dequantize(self) -> jax.Array:
        """The dense weight, `shape` and `dtype`, computed with `jax.numpy` (inside
        `jax.jit` it is part of the compiled computation)."""
        s = self.scheme
        dense = _DEQUANTIZE[s.name](self.parts, s)
        for op, arg in s.layout:
            if op == "transpose":
                dense = jnp.transpose(dense, arg)
            elif op == "reshape":
                dense = jnp.reshape(dense, arg)
            else:
                dense = dense.astype(jnp.dtype(arg))
        return dense

    def to_qwix(self) -> Any:
        """qwix's `QArray` of this weight, where qwix's form holds it exactly: FP8
        block-scaled whose blocks divide the weight, FP8 and int8 scaled (per
        tensor, row or group), the layout changes transposes only. Its values and
        scales are this weight's own (transposed as the model holds it), so
        `qwix.dequantize(q.to_qwix()).astype(q.dtype)` equals `q.dequantize()` bit
        for bit (qwix computes in the scale's dtype, which holds each product
        exactly before its one rounding), and qwix's own `dot_general` takes it.

        **Raises:** `ValueError` naming what qwix's form cannot hold: packed values
        (qwix keeps one value a byte), GPTQ's and AWQ's zero points and group
        indices, blocks that do not divide the weight, a reshape."""
        qwix = importlib.import_module("qwix")  # optional, not a dependency

        s = self.scheme
        problem = None
        moves = [arg for op, arg in s.layout if op == "transpose"]
        if s.name not in ("fp8-block", "fp8", "int"):
            problem = f"qwix's QArray holds one value a byte, unpacked; {s.name} packs"
        elif any(op == "reshape" for op, _ in s.layout):
            problem = "the model holds it reshaped (a per-head kernel)"
        elif s.name == "fp8-block":
            b0, b1 = s.setting("block")
            if s.stored[-2] % b0 or s.stored[-1] % b1:
                problem = (
                    f"its blocks of {b0}x{b1} do not divide the weight {s.stored}: "
                    "qwix scales tiles of equal size"
                )
        zero = self.parts.get("zero")
        if zero is not None and problem is None:
            if not jnp.issubdtype(zero.dtype, jnp.integer):
                problem = f"its zero point is {zero.dtype}, qwix's is the values' dtype"
        if problem is not None:
            raise ValueError(
                f"This {s.name} weight cannot be a qwix QArray exactly: {problem}. "
                "Use it as it is (`bridge.dequantize`, `q.dequantize()`)."
            )
        qvalue, scale = self.parts["weight"], self.parts["scale"]
        if scale.ndim < qvalue.ndim:
            scale = scale.reshape((1,) * (qvalue.ndim - scale.ndim) + scale.shape)
        if zero is not None:
            zero = zero.reshape(scale.shape).astype(qvalue.dtype)
        for axes in moves:
            qvalue, scale = jnp.transpose(qvalue, axes), jnp.transpose(scale, axes)
            if zero is not None:
                zero = jnp.transpose(zero, axes)
        return qwix.QArray(qvalue, scale, zero)

    def __jax_array__(self) -> jax.Array:
        # where JAX needs an array (`x @ w`, `jnp.asarray(w)`): the dense weight
        return self.dequantize()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        dense = np.asarray(self.dequantize())
        return dense if dtype is None else dense.astype(dtype)

    def __getitem__(self, index: Any) -> QuantizedArray:
        if index is Ellipsis:  # NNX reads a Variable's value as `v[...]`
            return self
        raise TypeError(
            "A QuantizedArray is indexed whole only (`q[...]`): dequantize it first, "
            "`q.dequantize()[index]` (inside jax.jit)."
        )

    def __repr__(self) -> str:
        s = self.scheme
        shape = ",".join(map(str, self.shape))
        return f"QuantizedArray({s.name} {s.bits}-bit: {self.dtype.name}[{shape}])"


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def dequantized(tree: Any) -> Any:
    """`tree` with each `QuantizedArray` replaced by its dense weight."""
    return jtu.tree_map(
        lambda x: x.dequantize() if isinstance(x, QuantizedArray) else x,
        tree,
        is_leaf=is_quantized,
    )


# --- the schemes, as bridge._quant's NumPy code computes them -------------------------


def _fp8_block(parts: dict[str, Any], s: Scheme) -> jax.Array:
    weight, scale = parts["weight"], parts["scale"]
    b0, b1 = s.setting("block")
    rows, cols = weight.shape[-2:]
    full = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), b0, -2), b1, -1)
    full = full[..., :rows, :cols]
    return (weight.astype(jnp.float32) * full).astype(jnp.dtype(s.dtype))


def _unpack_ct(packed: jax.Array, bits: int, count: int) -> jax.Array:
    """compressed-tensors' `unpack` (`bridge._quant._packed.unpack`): `count` signed
    values of `bits` bits a row, value `i` at bit `i * bits` of the row's words."""
    words = jax.lax.bitcast_convert_type(packed, jnp.uint32)
    start = np.arange(count) * bits
    word, offset = start // 32, (start % 32).astype(np.uint32)
    lead = (1,) * (words.ndim - 1)  # the same rank (no implicit rank promotion)
    spill = offset + bits > 32  # a value split over two words
    shift = np.where(spill, 32 - offset, 0).astype(np.uint32).reshape(*lead, -1)
    low = words[..., word] >> offset.reshape(*lead, -1)
    nxt = np.minimum(word + 1, words.shape[-1] - 1)
    high = jnp.where(spill.reshape(*lead, -1), words[..., nxt] << shift, 0)
    values = ((low | high) & np.uint32((1 << bits) - 1)).astype(jnp.int16)
    return (values - (1 << (bits - 1))).astype(jnp.int8)


def _scaled(parts: dict[str, Any], s: Scheme) -> jax.Array:
    """`(q - zero) * scale` in float32, rounded to the scale's dtype, as `dtype`
    (`bridge._quant._packed.dequantize`)."""
    scale = parts["scale"]
    if s.name == "int-packed":
        values = _unpack_ct(parts["weight"], s.bits, s.stored[1])
    else:
        values = parts["weight"]
    rows, cols = values.shape[-2:]
    if scale.ndim < 2:
        scale = scale.reshape((1,) * (values.ndim - scale.ndim) + scale.shape)
    groups = scale.shape[-1]
    g_idx = parts.get("g_idx")  # activation ordering: column j in group g_idx[j]

    def spread(x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        if g_idx is not None:
            return x[..., g_idx]
        return jnp.repeat(x, cols // groups, -1)

    q = values.astype(jnp.float32)
    zero = parts.get("zero")
    if zero is not None:
        if s.name == "int-packed" and zero.shape != scale.shape:  # packed by rows
            zero = _unpack_ct(zero.T, s.bits, scale.shape[0]).T
        q = q - spread(zero.reshape(scale.shape))
    q = q * spread(scale)
    return q.astype(scale.dtype).astype(jnp.dtype(s.dtype))


def _unpack_gptq(words: jax.Array, bits: int, axis: int) -> jax.Array:
    """`bridge._quant._gptq._unpack`: `32 / bits` values a word, the first in the
    low bits, along `axis`."""
    per = 32 // bits
    w = jax.lax.bitcast_convert_type(words, jnp.uint32)
    shifts = (np.arange(per) * bits).astype(np.uint32)
    mask = np.uint32((1 << bits) - 1)
    if axis == 0:
        values = (w[:, None, :] >> shifts[None, :, None]) & mask
        return values.reshape(-1, w.shape[1]).astype(jnp.int16)
    values = (w[:, :, None] >> shifts[None, None, :]) & mask
    return values.reshape(w.shape[0], -1).astype(jnp.int16)


def _gptq(parts: dict[str, Any], s: Scheme) -> jax.Array:
    scales = parts["scale"]
    q = _unpack_gptq(parts["weight"], s.bits, 0)
    rows = q.shape[0]
    z = _unpack_gptq(parts["zero"], s.bits, 1)[:, : scales.shape[1]]
    if s.setting("zero_plus_one"):
        z = z + 1
    g_idx = parts.get("g_idx")
    if g_idx is None:
        size = s.setting("group_size")
        g_idx = np.arange(rows) // (rows if size == -1 else size)
    values = (q - z[g_idx]).astype(jnp.float32) * scales[g_idx].astype(jnp.float32)
    return values.astype(scales.dtype).T.astype(jnp.dtype(s.dtype))


_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of each nibble of a word


def _unpack_awq(words: jax.Array) -> jax.Array:
    """`bridge._quant._awq.unpack`: 4-bit values in AWQ's interleaved column order,
    `(rows, cols / 8)` words -> `(rows, cols)` int16."""
    w = jax.lax.bitcast_convert_type(words, jnp.uint32)
    shifts = np.arange(8, dtype=np.uint32) * np.uint32(4)
    nibbles = (w[:, :, None] >> shifts[None, None, :]) & np.uint32(0xF)
    columns = nibbles[:, :, np.argsort(_AWQ_ORDER)]
    return columns.reshape(w.shape[0], -1).astype(jnp.int16)


def _awq(parts: dict[str, Any], s: Scheme) -> jax.Array:
    scales = parts["scale"]
    q, z = _unpack_awq(parts["weight"]), _unpack_awq(parts["zero"])
    rows = q.shape[0]
    size = s.setting("group_size")
    g = np.arange(rows) // (rows if size == -1 else size)
    values = (q - z[g]).astype(jnp.float32) * scales[g].astype(jnp.float32)
    return values.astype(scales.dtype).T.astype(jnp.dtype(s.dtype))


_DEQUANTIZE: dict[str, Callable[[dict[str, Any], Scheme], jax.Array]] = {
    "fp8-block": _fp8_block,
    "fp8": _scaled,
    "int": _scaled,
    "int-packed": _scaled,
    "gptq": _gptq,
    "awq": _awq,
}
SCHEMES = tuple(_DEQUANTIZE)


def quantized_positions(tree: Any) -> dict[int, str]:
    """`{position among tree_leaves(tree): keystr path of its QuantizedArray}` for
    every leaf that is a part of a `QuantizedArray`."""
    out: dict[int, str] = {}
    i = 0
    for keypath, x in jtu.tree_flatten_with_path(tree, is_leaf=is_quantized)[0]:
        if isinstance(x, QuantizedArray):
            for _ in jtu.tree_leaves(x):
                out[i] = jtu.keystr(keypath)
                i += 1
        else:
            i += 1
    return out
