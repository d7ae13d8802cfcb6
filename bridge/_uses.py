"""What a traced forward pass tells about each parameter: the record both sides share.

A JAX model's forward pass (`bridge._port._trace.first_uses`) and a PyTorch module's
(`bridge._adapters._torch_trace.trace_module`) are read the same way: for each
parameter, when it is first computed with, and how (which of its stored axes meet
the input, a convolution's kernel axes, the kind of normalisation it scales).
Pairing and layouts are decided from these records, never from a name or a square
shape. This module only defines the records (no framework is imported here).
"""

from __future__ import annotations

from typing import NamedTuple


Where = str | tuple[str | int, ...]
"""What a `Uses` is keyed by: a state-dict name (`trace_module`), or a Tree's leaf
path (an adapter's `trace`)."""


class Contraction(NamedTuple):
    """How a kernel meets the input in the product (`dot_general`, `F.linear`,
    `addmm`, `matmul`, `einsum`) that first contracts it, in the axes of the array as
    stored (a stack's layer axis is in none of them).

    **Example:** `nn.Linear.weight` `(out, in)` read by `F.linear` is
    `Contraction(inputs=(1,), outputs=(0,), batch=())`; a Flax `Dense.kernel`
    `(in, out)` and GPT-2's `Conv1D.weight` `(in, out)` are
    `Contraction(inputs=(0,), outputs=(1,), batch=())`.
    """

    inputs: tuple[int, ...]
    """The axes contracted with the input, in the order of the input's axes."""
    outputs: tuple[int, ...]
    """The other axes, in the order the result (after a transpose that directly
    follows, as `jnp.einsum` emits) has them."""
    batch: tuple[int, ...]
    """Axes the product runs over in parallel (a kernel applied per head): no
    `Dense` layer reads such a kernel."""


class Uses(NamedTuple):
    """Per parameter name, what one forward pass did with it (a traced PyTorch
    module's record: `bridge._adapters._torch_trace.trace_module`).

    Keys are the module's state-dict names (`trace_module`; tied names, one tensor
    under several names, each with the uses of the module holding it under that
    name), or a Tree's leaf paths (an adapter's `trace`: the paths the Tree has,
    and the paths of the names it holds once, `tied`).

    **Fields:**

    - `positions`: `{name: (index,)}`: the first operation that computes with the
      parameter, counted among the operations that compute with a parameter (so
      that a path the inputs take elsewhere, a mask or none, changes no index).
      Operations that only relay it (`w.t()`, `w.view(...)`, `w.to(dtype)`,
      `1.0 + w`, `torch._weight_norm(v, g)`) are seen through. Parameters of one
      operation share its index. Comparable within one record only.
    - `contracted`: `{name: Contraction}` for a parameter contracted with the input
      by a product (`F.linear`, `addmm`, `matmul`, `bmm`, `einsum`): its first such
      product, so a tied head read by `F.linear` after its embedding lookup is there.
    - `convolved`: `{name: stored axes as (out, in, *spatial)}` for a parameter used
      as a convolution's kernel: `F.conv2d`'s `(O, I/g, kh, kw)` is `(0, 1, 2, 3)`,
      `F.conv_transpose2d`'s `(I, O/g, kh, kw)` is `(1, 0, 2, 3)`.
    - `norms`: `{name: kind}` for the weight and bias of a normalisation: `"mean"`
      (the mean is subtracted: `F.layer_norm`, `group_norm`, `batch_norm`,
      `instance_norm`, or written by hand) or `"rms"` (no mean subtracted:
      `F.rms_norm`, `x * rsqrt(mean(x**2) + eps)` then `w * x`), with `"+1"`
      appended where the scale applied is `1 + w` (Gemma: `"rms+1"`), and `":bias"`
      for a bias (added after the scale: `"mean:bias"`).
    - `eps`: `{name: eps}` for the weight and bias of a normalisation whose
      variance is given a constant before its inverse root (`F.layer_norm`'s
      `eps`, `x * rsqrt(var + 1e-6)`).
    - `weight_norm`: `{weight name: (g name, v name)}` for a weight computed by
      weight normalisation (`torch._weight_norm`, the old hooks' `weight_g` /
      `weight_v` or `parametrizations.weight.original0` / `original1`).
    - `needs`: `{name: (its bit, bits of the other operands)}`: each parameter has
      a bit (tied names share one); the second is the union of the bits of the
      parameters the other operands of its first use are computed from (through
      every operation), leaving out the arguments that operation applies after
      this one (a bias after the product): the layers upstream, an order of
      dependence.
    - `added`: `{name: True}` for a parameter an operation adds to a product's
      result (`F.linear`'s `bias`, `addmm`'s `input`, `torch.matmul(x, w.t()) + b`;
      JAX's `add` onto a `dot_general`'s result): a bias, whatever module holds it.
    - `alone`: `{kernel name: bool}` for a parameter a product contracts: whether
      that layer's output is changed by itself (an activation function, a norm,
      not a relayout or a scaling) before it meets another layer's output (a
      gated MLP's `gate` is, its `up` is not): what tells layers side by side
      apart where a JAX side shows the same (`bridge._port._branches`).
    - `reads`: `{name: numbers}`: the activations the parameter's first use reads,
      each numbered once however it is moved or cast (`x.view(...)`, `x.to(...)`):
      equal for layers used side by side (one input).
    - `merges`: the operations that take activations computed from different
      parameters, in order, as `(JAX primitive name, ((place, bits), ...))`, and a
      model's outputs as `("output", ((None, bits),))`; bits as in `needs`
      (`bridge._adapters._torch_merges`): what tells layers side by side apart.
    - `unused`: names the forward pass never computes with (training-only arrays
      such as DINOv2's `mask_token`, BatchNorm's `num_batches_tracked` in
      evaluation).
    - `tied`: `{name: the name it is the same tensor as}` for the second and later
      names of a tensor held under several (T5's `encoder.embed_tokens.weight` is
      `shared.weight`). A tied tensor's names are traced apart: each has the uses
      made through the module that holds it under that name (`lm_head.weight` its
      `F.linear`, `shared.weight` its embedding lookup).
    """

    positions: dict[Where, tuple[int, ...]]
    contracted: dict[Where, Contraction]
    convolved: dict[Where, tuple[int, ...]]
    norms: dict[Where, str]
    weight_norm: dict[Where, tuple[Where, Where]]
    needs: dict[Where, tuple[int, int]]
    unused: tuple[Where, ...]
    tied: dict[Where, Where] = {}  # noqa: RUF012 - never mutated
    added: dict[Where, bool] = {}  # noqa: RUF012 - never mutated
    alone: dict[Where, bool] = {}  # noqa: RUF012 - never mutated
    reads: dict[Where, frozenset[int]] = {}  # noqa: RUF012 - never mutated
    merges: tuple[tuple[str, tuple[tuple[int | None, int], ...]], ...] = ()
    eps: dict[Where, float] = {}  # noqa: RUF012 - never mutated


class Untraced(Exception):
    """Raised by an adapter's `trace` when it has no model to run for a Tree that
    says where one could come from (a Hugging Face folder's `config.json` with torch
    or transformers missing, or a class transformers does not have): the message
    says why. The port goes on without that side's trace and says so where it
    would have decided."""
