"""Pallas kernels that multiply by a kept FP8 weight on a TPU without a dense copy.

v5e has no FP8 hardware. There, XLA's `float8_e4m3fn -> bfloat16` convert runs on the
vector unit, and a dequantize left to XLA makes a batch-8 forward 4x slower than the
dense one. These kernels read the weight's bytes from HBM as stored: one byte a
value, half the bytes of bfloat16.

The decode works on 32-bit words, never widening a byte on its own. A `(tr, tc)`
tile's bytes, seen as int32 (`pltpu.bitcast`: word `j` of a 128-row block holds
rows `4j .. 4j + 3`, byte `k` row `4j + k`), give four `(32, tc)` slabs, one per
byte: shifted so that the byte's sign lands on bit 31 and its 7 magnitude bits on
bits 20-26 of a float32, the slab is the values times 2**-120, exact. Times the
block's scale (2**60 folded in) and rounded to bfloat16 once, as
`QuantizedArray.dequantize()` rounds it, the slab is stored in VMEM. Slab `k` holds
rows `4j + k`: the decoded tile's rows are permuted within each 128-row block (row
`32k + j` is the weight's `4j + k`). The forward's output columns come out in that
order and are put back by a product with a 0/1 matrix on the MXU (exact); the input
gradient's `g` is permuted the same way by XLA before the kernel. Each product is
contracted on the MXU with float32 accumulation and scaled by 2**60 at the end
(exact). Outputs equal the dequantizing path's products up to the order of the
float32 sums. One difference: FP8 subnormals (a zero exponent field, codes below
2**-6, at most 1/64 of a code unit) decode to float32 subnormals, which TPUs and XLA's
CPU flush to zero. That is less than a sixteenth of one bfloat16 rounding of a typical
weight (real checkpoints scale each block's largest value to 448).

The weight goes into the kernel as the stored `float8_e4m3fn` array and is
bitcast there. A `bitcast_convert_type` to int8 in XLA, before the kernel, copies the
whole weight on a TPU: that copy made the first version of this kernel 1.5-1.7x the
dense time.

Measured on one v5e (JAX 0.10.2, 2026-12-06; `benchmarks/fp8_kernel.py`: 16 x
`Linear(5760, 5760)` with tanh, medians of interleaved runs, against XLA's bfloat16
product): the forward 0.74x at batch 8, 0.76x at 64, 1.14x at 1024; the input
gradient 0.78x, 0.80x, 1.24x; XLA's dequantize 4.6x at batch 8. Bytes alone would
give 0.5x. Checked on the chip against the dequantizing path: within 2.6e-3 of the
largest output (bfloat16 rounding).

`fp8_block_matmul(x, weight, scale, contract)`:

- `contract="in"`: `x` `(batch, in)` -> `x @ w.T` `(batch, out)` (the forward);
- `contract="out"`: `g` `(batch, out)` -> `g @ w` `(batch, in)` (the gradient of the
  input, in `kept_matmul`'s backward).

`applies(...)` says when they run: on a TPU, for `"fp8-block"` weights with
128 x 128 blocks, dims that are multiples of 128, a bfloat16 input, and a JAX with
Pallas's TPU API. Everything else, and every CPU run, takes XLA's path in
`bridge._kept._matmul`. `interpreted()` runs them in Pallas's interpreter on any
backend, for tests.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp


BLOCK = 128
_MAX_TILE = 1152  # 9 blocks: smaller tiles measured slower on v5e (FACTS)
_MAX_BATCH_TILE = 512
_HALF = 2.0**60  # 2**120, the decode's factor, split between the scale and the output
_interpret = False


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Within it, the kernels run (when traced) in Pallas's interpreter, on any
    backend. Tests use it to run them on a CPU."""
    global _interpret
    before, _interpret = _interpret, True
    try:
        yield
    finally:
        _interpret = before


def _pallas() -> tuple[Any, Any] | None:
    try:
        pl = importlib.import_module("jax.experimental.pallas")
        pltpu = importlib.import_module("jax.experimental.pallas.tpu")
    except ImportError:
        return None
    if not hasattr(pltpu, "CompilerParams") or not hasattr(pltpu, "VMEM"):
        return None  # an older JAX names them otherwise: XLA's path
    return pl, pltpu


def applies(x: jax.Array, parts: dict[str, Any], scheme: Any) -> bool:
    """Whether `fp8_block_matmul` computes this product (see the module's note)."""
    if scheme.name != "fp8-block" or tuple(scheme.setting("block")) != (BLOCK,) * 2:
        return False
    weight, scale = parts["weight"], parts.get("scale")
    if weight.ndim != 2 or scale is None or scale.ndim != 2:
        return False
    if any(d % BLOCK for d in weight.shape) or x.dtype != jnp.bfloat16:
        return False
    if weight.dtype != jnp.float8_e4m3fn:
        return False
    return (_interpret or jax.default_backend() == "tpu") and _pallas() is not None


def _tile(n: int, most: int | None = None) -> int:
    """The largest multiple of 128 that divides `n` and is at most `most` (by
    default `_MAX_TILE`)."""
    most = most or _MAX_TILE
    return max(t for t in range(BLOCK, min(n, most) + 1, BLOCK) if n % t == 0)


def batch_rows(x: jax.Array, most: int) -> tuple[jax.Array, int]:
    """`x` `(..., n)` as rows `(padded, n)`, zeros added to fill the last batch tile,
    and the batch tile: a multiple of 16 rows (bfloat16's sublane tile), at most
    `most`."""
    x2 = x.reshape(-1, x.shape[-1])
    batch = x2.shape[0]
    tb = min(_round_up(batch, 16), most)
    padded = _round_up(batch, tb)
    if padded != batch:
        x2 = jnp.pad(x2, ((0, padded - batch), (0, 0)))
    return x2, tb


def fp8_block_matmul(
    x: jax.Array, weight: jax.Array, scale: jax.Array, contract: str
) -> jax.Array:
    """`x @ w.T` (`contract="in"`) or `x @ w` (`contract="out"`) for the FP8 weight
    `w = weight * scale` (block-scaled, 128 x 128 blocks; `weight` `(out, in)`
    `float8_e4m3fn`, `scale` `(out / 128, in / 128)`), in `x`'s dtype (bfloat16).

    `x` has shape `(..., in)` or `(..., out)`; the result has shape `(..., out)` or
    `(..., in)`."""
    pl, _ = _pallas()  # type: ignore[misc]
    rows, cols = weight.shape
    tr, tc = _tile(rows), _tile(cols)
    lead, batch = x.shape[:-1], x.size // x.shape[-1]
    if contract == "out":  # g's columns in the decoded tile's row order
        x = x.reshape(*lead, rows // BLOCK, 32, 4).swapaxes(-1, -2)
        x = x.reshape(*lead, rows)
    x2, tb = batch_rows(x, _MAX_BATCH_TILE)
    padded = x2.shape[0]
    # each 128-row block's scales along the inputs, (out / 128, 1, in), times 2**60
    s = jnp.repeat(scale.astype(jnp.float32) * _HALF, BLOCK, axis=1)[:, None, :]
    if contract == "in":  # grid (batch, out tiles, in tiles): sum over in
        grid = (padded // tb, rows // tr, cols // tc)
        at = lambda b, i, k: (i, k)  # noqa: E731
        x_spec = pl.BlockSpec((tb, tc), lambda b, i, k: (b, k))
        out_spec = pl.BlockSpec((tb, tr), lambda b, i, k: (b, i))
        out_cols, acc_cols = rows, tr
    else:  # grid (batch, in tiles, out tiles): sum over out
        grid = (padded // tb, cols // tc, rows // tr)
        at = lambda b, j, k: (k, j)  # noqa: E731
        x_spec = pl.BlockSpec((tb, tr), lambda b, j, k: (b, k))
        out_spec = pl.BlockSpec((tb, tc), lambda b, j, k: (b, j))
        out_cols, acc_cols = cols, tc
    w_spec = pl.BlockSpec((tr, tc), lambda b, i, k: at(b, i, k))
    s_spec = pl.BlockSpec(
        (tr // BLOCK, 1, tc), lambda b, i, k: (at(b, i, k)[0], 0, at(b, i, k)[1])
    )
    kernel = _fp8_kernel(pl, tr // BLOCK, contract, x.dtype)
    call = tiled_call(
        kernel, grid, [x_spec, w_spec, s_spec], out_spec, (padded, out_cols), x.dtype
    )
    y = call((tr, tc), (tb, acc_cols))(x2, weight, s)
    return y[:batch].reshape(*lead, out_cols)


def tiled_call(
    kernel: Any,
    grid: tuple[int, int, int],
    in_specs: list[Any],
    out_spec: Any,
    out_shape: tuple[int, int],
    dtype: Any,
) -> Any:
    """`with_scratch(tile, acc)`: the `pallas_call` of `kernel` over `grid` (batch
    tiles, output tiles, the contraction's tiles, the last one "arbitrary"), with a
    VMEM scratch `tile` of `dtype` (the decoded weight tile) and a float32 one `acc`
    (the sums); interpreted within `interpreted()`."""
    pl, pltpu = _pallas()  # type: ignore[misc]

    def with_scratch(tile: tuple[int, int], acc: tuple[int, int]) -> Any:
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(out_shape, dtype),
            grid=grid,
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM(tile, dtype), pltpu.VMEM(acc, jnp.float32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary"),
                vmem_limit_bytes=64 * 2**20,
            ),
            interpret=_interpret,
        )

    return with_scratch


def _fp8_kernel(pl: Any, blocks: int, contract: str, dtype: Any):
    """The kernel for `blocks` 128-row blocks a tile (see the module's note)."""
    dims = (((1,), (1,)), ((), ())) if contract == "in" else (((1,), (0,)), ((), ()))
    _, pltpu = _pallas()  # type: ignore[misc]

    def kernel(x_ref, w_ref, s_ref, o_ref, dense_ref, acc_ref):
        k = pl.program_id(2)

        @pl.when(k == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        for r in range(blocks):  # 32 words a row: 4 rows of bytes
            words = pltpu.bitcast(w_ref[r * BLOCK : (r + 1) * BLOCK, :], jnp.int32)
            for byte in range(4):
                rows = slice(r * BLOCK + 32 * byte, r * BLOCK + 32 * (byte + 1))
                value = _decode(words, byte) * s_ref[r]
                dense_ref[rows, :] = value.astype(dtype)
        acc_ref[...] += jax.lax.dot_general(
            x_ref[...],
            dense_ref[...],
            dims,
            precision=jax.lax.Precision.DEFAULT,  # bfloat16 products are exact
            preferred_element_type=jnp.float32,
        )

        @pl.when(k == pl.num_programs(2) - 1)
        def _():
            if contract == "out":
                o_ref[...] = (acc_ref[...] * _HALF).astype(o_ref.dtype)
                return
            for r in range(blocks):  # the output columns back in the weight's order
                cols = slice(r * BLOCK, (r + 1) * BLOCK)
                o_ref[:, cols] = _unpermute((acc_ref[:, cols] * _HALF).astype(dtype))

    return kernel


_SIGN_AND_MAGNITUDE = -0x78100000  # 0x87F00000: bit 31 and bits 20-26


def _decode(words: jax.Array, byte: int) -> jax.Array:
    """Byte `byte` (0 the lowest) of each int32 word, an FP8 e4m3 code -> its value
    times 2**-120, float32: shifted up to bits 24-31, then arithmetically down by 4,
    the code's sign is on bits 28-31 and its 7 magnitude bits on the float's
    exponent and mantissa (bits 20-26); the mask keeps bit 31 and bits 20-26."""
    top = jnp.left_shift(words, 24 - 8 * byte) if byte < 3 else words
    bits = jnp.right_shift(top, 4) & jnp.int32(_SIGN_AND_MAGNITUDE)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _unpermute(y: jax.Array) -> jax.Array:
    """`(tb, 128)` columns in the decoded tile's order (`32k + j`) -> the weight's
    (`4j + k`): a product with a 0/1 matrix on the MXU, exact for bfloat16 `y`."""
    a = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
    b = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
    moves = (b == ((a & 31) << 2) + (a >> 5)).astype(y.dtype)
    dims = (((1,), (0,)), ((), ()))
    out = jax.lax.dot_general(
        y, moves, dims, jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32
    )  # (Mosaic refuses a bfloat16 operand at "highest", a float32 program's setting)
    return out.astype(y.dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
