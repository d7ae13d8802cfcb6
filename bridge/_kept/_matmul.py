"""Matrix products with weights kept quantized (`QuantizedArray`), read in their
stored form: `stored_form(fn)`.

`fn` is written against dense weights (a model's forward pass, a loss). It is traced
with each `QuantizedArray` standing for its dense weight, and the traced computation
is run again with every matrix product that contracts a kept weight's stored
`(out, in)` array on `in` replaced by `kept_matmul`:

- forward: `x @ dequantize(stored).T` written as one `dot_general` that contracts the
  stored array on `in` (no transposed copy), so that XLA can fuse the dequantize
  (convert, scales) into the product's operand; weights with one scale per output row
  and no zero point (`"int"`, `"fp8"` per channel) multiply the narrow values and
  apply the scale to the outputs instead;
- backward (`jax.custom_vjp`): the gradient of `x` is `g @ dequantize(stored)`,
  recomputed from the stored parts. The dense weight is a temporary of that one
  product, never a residual kept from the forward pass for the backward: a LoRA step
  on a kept base holds the base in its stored bytes only. The kept weight gets no
  gradient (it is frozen; `bridge.make_step` refuses a spec that trains it).

Every other use of a kept weight (a product on another axis, a reshaped per-head
kernel, an elementwise use) gets the dense weight, bit for bit `dequantize()`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.extend.core import Literal

from . import _fp8_kernel, _int4_kernel
from ._array import _DEQUANTIZE, QuantizedArray, Scheme, is_quantized


def quantized_matmuls(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with each matrix product against a weight kept quantized
    (`bridge.load(..., keep_quantized=True)`) computed from the weight as stored: the
    stored `(out, in)` values contracted on `in` in one product with the dequantize
    (convert, scales) fused into it, no dense copy or transpose of the weight held.
    Other uses of a kept weight see the dense weight, as `bridge.dequantize` gives
    it. Use it inside your `jax.jit` in place of `bridge.dequantize(model)(x)`;
    `bridge.make_step` does it by itself (its backward pass recomputes each dense
    weight instead of keeping it).

    **Arguments:**

    - `fn`: a function of the model (any framework) and inputs, written for the dense
      model: `fn(model, *inputs)`. Pass every traced value as an argument.

    **Returns:**

    A function of the same arguments. Its outputs equal `fn(bridge.dequantize(model),
    *inputs)` within the rounding of the inputs' dtype (each product accumulates in
    float32 and is rounded once).

    **Example:**

    ```python
    >>> import jax, bridge
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> forward = jax.jit(bridge.quantized_matmuls(lambda m, x: m(x)))
    >>> forward(model, jax.numpy.ones((1, 2))).shape
    (1, 3)

    ```
    """
    return stored_form(fn)


def stored_form(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with each matrix product against a `QuantizedArray` among its arguments
    computed from the stored parts by `kept_matmul` (see the module's note).

    **Arguments:**

    - `fn`: a function of pytrees of arrays, written for dense weights; it must not
      close over traced values (pass them as arguments).

    **Returns:**

    A function of the same arguments, where any leaf may be a `QuantizedArray`;
    without one it is `fn` itself.
    """

    def wrapped(*args: Any) -> Any:
        leaves, treedef = jtu.tree_flatten(args, is_leaf=is_quantized)
        if not any(isinstance(x, QuantizedArray) for x in leaves):
            return fn(*args)
        stand_ins = [
            jax.ShapeDtypeStruct(x.shape, x.dtype) if is_quantized(x) else x
            for x in leaves
        ]
        closed, shape = jax.make_jaxpr(
            lambda *flat: fn(*jtu.tree_unflatten(treedef, flat)), return_shape=True
        )(*stand_ins)
        inputs = [_Kept.of(x) if is_quantized(x) else x for x in leaves]
        outs = _run(closed.jaxpr, closed.consts, inputs)
        return jtu.tree_unflatten(jtu.tree_structure(shape), outs)

    return wrapped


class _Kept(NamedTuple):
    """A traced value that is a kept weight moved by transposes and casts only:
    `axes[i]` is the stored axis that its axis `i` is, `dtype` its dtype."""

    q: QuantizedArray
    axes: tuple[int, ...] | None  # None: a reshape moved it (no stored axis map)
    dtype: Any
    moves: tuple[tuple[str, Any], ...]  # the eqns' own changes after q's layout

    @classmethod
    def of(cls, q: QuantizedArray) -> _Kept:
        axes: tuple[int, ...] | None = tuple(range(len(q.scheme.stored)))
        for op, arg in q.scheme.layout:
            if op == "transpose" and axes is not None:
                axes = tuple(axes[a] for a in arg)
            elif op == "reshape":
                axes = None
        return cls(q, axes, q.dtype, ())

    def then(self, eqn: Any) -> _Kept:
        if eqn.primitive.name == "transpose":
            perm = tuple(int(a) for a in eqn.params["permutation"])
            axes = None if self.axes is None else tuple(self.axes[a] for a in perm)
            return self._replace(axes=axes, moves=self.moves + (("transpose", perm),))
        dtype = eqn.params["new_dtype"]
        return self._replace(dtype=dtype, moves=self.moves + (("astype", dtype),))

    def dense(self) -> jax.Array:
        out = self.q.dequantize()
        for op, arg in self.moves:
            out = jnp.transpose(out, arg) if op == "transpose" else out.astype(arg)
        return out


_MOVES = ("transpose", "convert_element_type")


def _run(jaxpr: Any, consts: list[Any], args: list[Any]) -> list[Any]:
    """Evaluate `jaxpr` (as `jax.core.eval_jaxpr` does), `_Kept` values going into
    a product on their stored `in` axis through `kept_matmul`, into anything else
    as their dense weight."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        if isinstance(v, Literal):
            return v.val
        x = env[v]
        if isinstance(x, _Kept):
            x = env[v] = x.dense()
        return x

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [None if isinstance(v, Literal) else env.get(v) for v in eqn.invars]
        kept = [i for i, x in enumerate(ins) if isinstance(x, _Kept)]
        first = ins[kept[0]] if kept else None
        if isinstance(first, _Kept) and eqn.primitive.name in _MOVES and len(ins) == 1:
            env[eqn.outvars[0]] = first.then(eqn)
            continue
        if (
            isinstance(first, _Kept)
            and len(kept) == 1
            and eqn.primitive.name == "dot_general"
        ):
            out = _product(eqn, first, kept[0], read)
            if out is not None:
                env[eqn.outvars[0]] = out
                continue
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _product(eqn: Any, kept: _Kept, side: int, read: Callable) -> Any:
    """The `dot_general` `eqn` with the kept weight on `side` (0: lhs), through
    `kept_matmul`; None where it does not contract the stored `in` axis alone."""
    (contract, batch) = eqn.params["dimension_numbers"]
    if batch[0] or batch[1] or kept.axes is None or len(kept.axes) != 2:
        return None
    if len(contract[side]) != 1 or kept.axes[contract[side][0]] != 1:
        return None
    x = jnp.moveaxis(jnp.asarray(read(eqn.invars[1 - side])), contract[1 - side][0], -1)
    dtype = eqn.outvars[0].aval.dtype
    y = jnp.asarray(kept_matmul(x.astype(kept.dtype), kept.q.parts, kept.q.scheme))
    y = y.astype(dtype)
    return y if side == 1 else jnp.moveaxis(y, -1, 0)  # dot_general's order


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def kept_matmul(x: jax.Array, parts: dict[str, Any], scheme: Scheme) -> jax.Array:
    """`x @ w.T` for the kept weight `w` (stored `(out, in)`, from `parts` and
    `scheme`): `x` shape `(..., in)` -> shape `(..., out)`, in `x`'s dtype.

    Equal to `x @ dequantized(w).T` within the rounding of `x`'s dtype; its
    gradient for `x` recomputes the dense weight instead of keeping it."""
    return _forward(x, parts, scheme)


def _forward(x: jax.Array, parts: dict[str, Any], s: Scheme) -> jax.Array:
    # dequantized when `x` is there: XLA may not hoist every layer's to the start
    parts, x = jax.lax.optimization_barrier((parts, x))
    if _fp8_kernel.applies(x, parts, s):  # on a TPU: decoded in VMEM, see _fp8_kernel
        return _fp8_kernel.fp8_block_matmul(x, parts["weight"], parts["scale"], "in")
    if _int4_kernel.applies(x, parts, s):  # on a TPU: 4-bit values to the MXU
        return _int4_kernel.int4_matmul(x, parts, s, "in")
    scale = parts.get("scale")
    per_row = (
        s.name in ("int", "fp8")
        and parts.get("zero") is None
        and parts.get("g_idx") is None
        and scale is not None
        and scale.size == s.stored[0]
    )
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if per_row and scale is not None:  # narrow values in, the scale onto the outputs
        q = parts["weight"].astype(x.dtype)
        y = jax.lax.dot_general(x, q, dims, preferred_element_type=jnp.float32)
        row = scale.reshape((1,) * (y.ndim - 1) + (-1,)).astype(jnp.float32)
        return (y * row).astype(x.dtype)
    w = _DEQUANTIZE[s.name](parts, s).astype(x.dtype)  # fused into the product
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(
        x.dtype
    )


def _forward_rule(x, parts, scheme):
    return _forward(x, parts, scheme), parts


def _backward_rule(scheme, parts, g):
    # recomputed when `g` is there, not early (all layers' dense weights at once)
    parts, g = jax.lax.optimization_barrier((parts, g))
    if _fp8_kernel.applies(g, parts, scheme):
        dx = _fp8_kernel.fp8_block_matmul(g, parts["weight"], parts["scale"], "out")
        return dx, jtu.tree_map(_no_gradient, parts)
    if _int4_kernel.applies(g, parts, scheme):
        dx = _int4_kernel.int4_matmul(g, parts, scheme, "out")
        return dx, jtu.tree_map(_no_gradient, parts)
    w = _DEQUANTIZE[scheme.name](parts, scheme).astype(g.dtype)
    dx = jax.lax.dot_general(
        g, w, (((g.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    ).astype(g.dtype)
    return dx, jtu.tree_map(_no_gradient, parts)


def _no_gradient(part: Any) -> Any:
    if jnp.issubdtype(part.dtype, jnp.inexact):
        return jnp.zeros(part.shape, part.dtype)
    return np.zeros(part.shape, jax.dtypes.float0)


kept_matmul.defvjp(_forward_rule, _backward_rule)
