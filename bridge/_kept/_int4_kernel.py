"""A Pallas kernel that multiplies by a kept 4-bit group-scaled weight (GPTQ,
compressed-tensors' `pack-quantized`) on a TPU without a dense copy.

XLA fuses a 4-bit dequantize with a zero point badly on v5e (3.4x the dense
bfloat16 product's time at batch 8, FACTS). This kernel reads the weight from HBM as
packed 4-bit values (a quarter of bfloat16's bytes) and never forms `(q - z) * s`:
the values `q` (0..15, exact in bfloat16) go to the MXU as they are, one group of
128 inputs at a time, and the group's scale `s` and zero point `z` are applied to
the float32 partial sums:

- forward, `y = x @ w.T`: `y += s_g * (x_g @ q_g - z_g * sum(x_g))` for each group
  `g` (`s_g`, `z_g` one value per output column);
- input gradient, `dx = g @ w`: the scale varies along the contraction (`out`), so
  it goes onto `g` instead: `u = bfloat16(g * s_g)`,
  `dx_g = u @ q_g.T - sum(u * z_g)` (one rounding of `g * s_g` to bfloat16, as the
  dequantizing path rounds `w`).

**The form it reads** (`Int4Form`, made by `kernel_form` inside the traced
computation): `words` int32 `(in / 8, out)`, eight consecutive inputs in a word, the
first in the low bits: GPTQ's own `qweight`, read as stored. A group of 128 inputs
is 16 rows of words, so every slice in the kernel is tile-aligned (sublane offsets
multiples of 16, lane offsets multiples of 128). Nibble `j` of word row `r` of a
group is its input `8 r + j`; the kernel lays nibble `j`'s rows at `16 j + r`, so
the input `x` is permuted to that order outside the kernel (and the gradient back):
an XLA transpose of the activations, not of the weight. `scale` and `zero` are
float32 `(in / 128, 1, out)`.

- GPTQ: `words` is `qweight` unchanged; the zeros are unpacked (1/128 of the
  weight's values).
- compressed-tensors (`(out, in / 8)` words, values offset by 8): `words` is the
  transpose of the stored words, an XLA transpose of the packed weight in every
  call (it reads and writes the packed bytes once more: twice the kernel's weight
  traffic).
- AWQ (`(in, out / 8)` words, nibbles interleaved along `out`) is not read: it
  would have to be unpacked and packed again along `in` in every call, which
  measured 86x the dense time on one v5e at batch 8 (XLA's dequantizing path:
  4.0x). AWQ takes XLA's path.

  Repacking compressed-tensors and AWQ once at load time would make them as cheap
  as GPTQ; kept parts are the checkpoint's tensors as stored, so that is not done.

Unpacking is the kernel's vector work. `UNPACK = "nibbles"` takes one value an
operation (shift, mask, convert); `"pairs"` (the default) takes two: nibbles `j` and
`j + 4` of a word land in the two 16-bit halves of a lane as the bfloat16 bits of
`128 + q`, which `pltpu.bitcast` turns into two rows (the 128 is taken off with the
zero point). `benchmarks/int4_kernel.py` checks both on the chip and times them: on
one v5e (JAX 0.10.2; 16 x `Linear(5632, 5632)`, batch 8) the forward took 0.72x the
dense bfloat16 time with pairs, 0.76x with nibbles, 4.0x by XLA's dequantize; the
input gradient 0.78x either way; outputs within bfloat16 rounding of the
dequantizing path.

`int4_matmul(x, parts, scheme, contract)`: `contract="in"`, `x` `(..., in)` ->
`(..., out)`; `contract="out"`, `g` `(..., out)` -> `(..., in)`.

`applies(...)`: on a TPU (or inside `bridge._kept._fp8_kernel.interpreted()`), 4-bit
`"gptq"` or `"int-packed"` weights in groups of 128 inputs, both dims
multiples of 128, a bfloat16 input. A GPTQ or compressed-tensors group index
(`g_idx`, activation order) is checked on the device: when it is the plain order
(`i // 128`, which many GPTQ checkpoints store) the kernel runs, otherwise XLA's
dequantizing path (`jax.lax.cond`). Everything else takes XLA's path in
`bridge._kept._matmul`.

Outputs equal the dequantizing path's within bfloat16 rounding: the forward's
products are exact (bfloat16 `x` times small integers) and scaled in float32, where
the dequantizing path rounds each weight to the scales' dtype and to bfloat16.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import _fp8_kernel
from ._array import _DEQUANTIZE, Scheme, _unpack_ct, _unpack_gptq


GROUP = 128
_WORD_ROWS = GROUP // 8  # rows of int32 words that hold one group
_MAX_TILE = 1536  # 5632 -> 1408 (11 groups)
_MAX_BATCH_TILE = 512  # the weight is read and unpacked once per batch tile
_SCHEMES = ("gptq", "int-packed")  # AWQ: XLA's path (see the module's note)


class Int4Form(NamedTuple):
    """What the kernel reads (see the module's note): `words` int32 `(in / 8,
    out)`, `scale` and `zero` float32 `(in / 128, 1, out)`."""

    words: jax.Array
    scale: jax.Array
    zero: jax.Array


def applies(x: jax.Array, parts: dict[str, Any], scheme: Scheme) -> bool:
    """Whether `int4_matmul` computes this product (see the module's note)."""
    if scheme.name not in _SCHEMES or scheme.bits != 4 or len(scheme.stored) != 2:
        return False
    if scheme.setting("group_size") != GROUP or x.dtype != jnp.bfloat16:
        return False
    out, inputs = scheme.stored
    if out % GROUP or inputs % GROUP:
        return False
    weight, scale = parts.get("weight"), parts.get("scale")
    if weight is None or scale is None or weight.dtype != jnp.int32:
        return False
    groups = inputs // GROUP
    want = {
        "gptq": ((inputs // 8, out), (groups, out)),
        "int-packed": ((out, inputs // 8), (out, groups)),
    }[scheme.name]
    if (tuple(weight.shape), tuple(scale.shape)) != want:
        return False
    if scheme.name != "int-packed" and parts.get("zero") is None:
        return False
    if _fp8_kernel._pallas() is None:
        return False
    return _fp8_kernel._interpret or jax.default_backend() == "tpu"


def kernel_form(parts: dict[str, Any], scheme: Scheme) -> Int4Form:
    """The weight in the form the kernel reads (see the module's note), computed
    with `jax.numpy` from the stored parts of a weight for which `applies`."""
    out, inputs = scheme.stored
    groups = inputs // GROUP
    scale = parts["scale"].astype(jnp.float32)
    zero = parts.get("zero")
    if scheme.name == "gptq":
        words = parts["weight"]
        z = _unpack_gptq(parts["zero"], 4, 1)[:, :out].astype(jnp.float32)
        if scheme.setting("zero_plus_one"):
            z = z + 1
    else:  # compressed-tensors: signed values stored offset by 8, (out, groups)
        words = parts["weight"].T
        scale = scale.T
        if zero is None:
            z = jnp.full((groups, out), 8.0, jnp.float32)
        else:
            if zero.shape != parts["scale"].shape:  # packed by rows
                zero = _unpack_ct(zero.T, 4, out).T
            z = zero.astype(jnp.float32).T + 8
    return Int4Form(words, scale.reshape(groups, 1, out), z.reshape(groups, 1, out))


def int4_matmul(
    x: jax.Array,
    parts: dict[str, Any],
    scheme: Scheme,
    contract: str,
    unpack: str | None = None,
) -> jax.Array:
    """`x @ w.T` (`contract="in"`) or `x @ w` (`contract="out"`) for the kept 4-bit
    weight `w` (stored `(out, in)`, from `parts` and `scheme`; `applies` holds), in
    `x`'s dtype (bfloat16).

    `x` has shape `(..., in)` or `(..., out)`; the result `(..., out)` or
    `(..., in)`. `unpack`: `"nibbles"` or `"pairs"` (default `UNPACK`).

    ```python
    >>> import jax.numpy as jnp
    >>> from bridge._kept._array import Scheme
    >>> from bridge._kept._fp8_kernel import interpreted
    >>> scheme = Scheme("int-packed", 4, (128, 128), "bfloat16", (("group_size", 128),))
    >>> parts = {"weight": jnp.full((128, 16), 0x99999999 - 2**32, jnp.int32),
    ...          "scale": jnp.full((128, 1), 0.5, jnp.bfloat16)}  # every value 1 * 0.5
    >>> with interpreted():
    ...     y = int4_matmul(jnp.ones((2, 128), jnp.bfloat16), parts, scheme, "in")
    >>> y.shape, float(y[0, 0])
    ((2, 128), 64.0)

    ```
    """
    g_idx = parts.get("g_idx")
    if g_idx is None:
        return _kernel_product(x, kernel_form(parts, scheme), contract, unpack)
    # activation order: the kernel where the index is the plain order, else XLA's
    plain = jnp.all(g_idx == jnp.arange(g_idx.shape[0]) // GROUP)
    return jax.lax.cond(
        plain,
        lambda: _kernel_product(x, kernel_form(parts, scheme), contract, unpack),
        lambda: _dequantizing_product(x, parts, scheme, contract),
    )


def _dequantizing_product(
    x: jax.Array, parts: dict[str, Any], scheme: Scheme, contract: str
) -> jax.Array:
    w = _DEQUANTIZE[scheme.name](parts, scheme).astype(x.dtype)
    dims = (((x.ndim - 1,), (1 if contract == "in" else 0,)), ((), ()))
    y = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def _kernel_product(
    x: jax.Array, form: Int4Form, contract: str, unpack: str | None = None
) -> jax.Array:
    pl, pltpu = _fp8_kernel._pallas()  # type: ignore[misc]
    unpack = unpack or UNPACK
    words, scale, zero = form
    inputs, out = words.shape[0] * 8, words.shape[1]
    ti, to = _fp8_kernel._tile(inputs, _MAX_TILE), _fp8_kernel._tile(out, _MAX_TILE)
    lead, batch = x.shape[:-1], x.size // x.shape[-1]
    x2, tb = _fp8_kernel.batch_rows(x, _MAX_BATCH_TILE)
    padded = x2.shape[0]
    order = _ORDERS[unpack]
    if contract == "in":  # the inputs in the order of the kernel's rows
        x2 = _reorder(x2, *order)
        grid = (padded // tb, out // to, inputs // ti)  # sum over in
        at = lambda b, o, k: (k, o)  # noqa: E731
        x_spec = pl.BlockSpec((tb, ti), lambda b, o, k: (b, k))
        out_spec = pl.BlockSpec((tb, to), lambda b, o, k: (b, o))
        out_cols, acc_cols = out, to
    else:
        grid = (padded // tb, inputs // ti, out // to)  # sum over out
        at = lambda b, i, k: (i, k)  # noqa: E731
        x_spec = pl.BlockSpec((tb, to), lambda b, i, k: (b, k))
        out_spec = pl.BlockSpec((tb, ti), lambda b, i, k: (b, i))
        out_cols, acc_cols = inputs, ti
    w_spec = pl.BlockSpec((ti // 8, to), lambda b, i, k: at(b, i, k))
    group_spec = pl.BlockSpec(
        (ti // GROUP, 1, to), lambda b, i, k: (at(b, i, k)[0], 0, at(b, i, k)[1])
    )
    unpack_tile = _UNPACKERS[unpack]
    make = _forward_kernel if contract == "in" else _gradient_kernel
    kernel = make(pl, pltpu, unpack_tile, ti // GROUP, x.dtype)
    specs = [x_spec, w_spec, group_spec, group_spec]
    call = _fp8_kernel.tiled_call(
        kernel, grid, specs, out_spec, (padded, out_cols), x.dtype
    )
    y = call((ti, to), (tb, acc_cols))(x2, words, scale, zero)
    if contract == "out":  # the kernel's rows back in the inputs' order
        y = _reorder(y, *order[::-1])
    return y[:batch].reshape(*lead, out_cols)


def _reorder(x: jax.Array, source: str, target: str) -> jax.Array:
    """`x` `(b, n)`, each group of 128 columns laid out as the axes `source`
    (letters of `_SIZES`), into the axes order `target`."""
    b, n = x.shape
    x = x.reshape(b, n // GROUP, *(_SIZES[c] for c in source))
    x = jnp.transpose(x, (0, 1, *(2 + source.index(c) for c in target)))
    return x.reshape(b, n)


def _unpack_nibbles(pltpu: Any, w_ref: Any, q_ref: Any, groups: int, dtype: Any):
    """The tile's words `(groups * 16, to)` -> its values `(groups * 128, to)` in
    `q_ref`, nibble `j` of a group's word row `r` (its input `8 r + j`) at the
    group's row `16 j + r`."""
    for g in range(groups):
        words = w_ref[g * _WORD_ROWS : (g + 1) * _WORD_ROWS, :]
        for j in range(8):
            nibble = jnp.right_shift(words, 4 * j) & 0xF
            start = g * GROUP + j * _WORD_ROWS
            q_ref[start : start + _WORD_ROWS, :] = nibble.astype(jnp.float32).astype(
                dtype
            )


_PAIR_MASK = 0x000F000F
_PAIR_BITS = 0x43004300  # bfloat16 128.0 in both halves: 128 + nibble, exact


def _unpack_pairs(pltpu: Any, w_ref: Any, q_ref: Any, groups: int, dtype: Any):
    """As `_unpack_nibbles`, two values an integer operation: nibbles `j` and `j +
    4` of each word (bits `4 j` and `4 j + 16` after a shift) become the bfloat16
    values `128 + q` in the low and high halves of a 32-bit lane, and
    `pltpu.bitcast` makes them rows `2 r` and `2 r + 1` of a `(32, to)` bfloat16
    slab: input `8 r + j + 4 t` of a group at its row `32 j + 2 r + t`. The 128 is
    taken off with the zero point (`z + 128`)."""
    for g in range(groups):
        words = w_ref[g * _WORD_ROWS : (g + 1) * _WORD_ROWS, :]
        for j in range(4):
            bits = (jnp.right_shift(words, 4 * j) & _PAIR_MASK) | _PAIR_BITS
            start = g * GROUP + j * 2 * _WORD_ROWS
            q_ref[start : start + 2 * _WORD_ROWS, :] = pltpu.bitcast(bits, dtype)


# a group's inputs as axes: `r` its word row, `j` a nibble (of 8, or of 4 with `t`
# the half of a 32-bit lane); each unpacking's (input order, kernel's row order)
_SIZES = {"r": 16, "j": 8, "t": 2, "J": 4}
_ORDERS = {"nibbles": ("rj", "jr"), "pairs": ("rtJ", "Jrt")}
_UNPACKERS = {"nibbles": _unpack_nibbles, "pairs": _unpack_pairs}
_OFFSETS = {_unpack_nibbles: 0.0, _unpack_pairs: 128.0}
UNPACK = "pairs"
"""Which unpacking the kernel uses: `"nibbles"` (one value an operation) or
`"pairs"` (two, through `pltpu.bitcast`; see `benchmarks/int4_kernel.py`)."""


def _forward_kernel(pl: Any, pltpu: Any, unpack_tile: Any, groups: int, dtype: Any):
    offset = _OFFSETS[unpack_tile]

    def body(x_ref, s_ref, z_ref, q_ref, acc_ref):
        for g in range(groups):
            cols = slice(g * GROUP, (g + 1) * GROUP)
            xg = x_ref[:, cols]
            partial = jax.lax.dot_general(
                xg,
                q_ref[cols, :],
                (((1,), (0,)), ((), ())),
                precision=jax.lax.Precision.DEFAULT,  # bfloat16 x small integers: exact
                preferred_element_type=jnp.float32,
            )
            total = jnp.sum(xg.astype(jnp.float32), axis=1, keepdims=True)
            acc_ref[...] += s_ref[g] * (partial - total * (z_ref[g] + offset))

    return _accumulating(pl, pltpu, unpack_tile, groups, dtype, body)


def _gradient_kernel(pl: Any, pltpu: Any, unpack_tile: Any, groups: int, dtype: Any):
    offset = _OFFSETS[unpack_tile]

    def body(g_ref, s_ref, z_ref, q_ref, acc_ref):
        grad = g_ref[...].astype(jnp.float32)
        for g in range(groups):
            rows = slice(g * GROUP, (g + 1) * GROUP)
            scaled = (grad * s_ref[g]).astype(dtype)  # (tb, to)
            partial = jax.lax.dot_general(
                scaled,
                q_ref[rows, :],
                (((1,), (1,)), ((), ())),
                precision=jax.lax.Precision.DEFAULT,
                preferred_element_type=jnp.float32,
            )  # (tb, 128)
            shift = jnp.sum(
                scaled.astype(jnp.float32) * (z_ref[g] + offset), axis=1, keepdims=True
            )
            acc_ref[:, rows] += partial - shift

    return _accumulating(pl, pltpu, unpack_tile, groups, dtype, body)


def _accumulating(
    pl: Any, pltpu: Any, unpack_tile: Any, groups: int, dtype: Any, body: Any
):
    """The kernel: the float32 sums zeroed at the first step of the contraction,
    the tile's values unpacked, `body` adding its products, the sums written out
    at the last step."""

    def kernel(x_ref, w_ref, s_ref, z_ref, o_ref, q_ref, acc_ref):
        k = pl.program_id(2)

        @pl.when(k == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        unpack_tile(pltpu, w_ref, q_ref, groups, dtype)
        body(x_ref, s_ref, z_ref, q_ref, acc_ref)

        @pl.when(k == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return kernel
