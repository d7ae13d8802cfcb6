"""`bridge.merge_lora`: fold each adapter into its layer's weight, `W + s A B`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._adapters._native import check_model, to_neutral
from .._paths import Path, at
from .._tree import Tree, framework
from ._settings import A, B, Target, frame_of


def delta_weight(target: Target, a: jax.Array, b: jax.Array, shape: tuple) -> jax.Array:
    """`A B` in float32, in the layout and `shape` of the adapted weight.

    `"flax"`: `a (*stack, *fan_in, r)`, `b (*stack, r, out)` give `(*stack, *fan_in,
    out)` reshaped to the kernel's (per-head) shape. `"peft"`: `b @ a` gives `(out,
    *fan_in)` (a convolution's `(out, in, *window)`), transposed for an embedding,
    whose weight is `(num, dim)`, and for a `"conv1d"` weight `(in, out)`."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    stack = target.stack
    if target.layout == "flax":
        rank = a.shape[-1]
        return (a.reshape(stack + (-1, rank)) @ b).reshape(shape)
    rank = a.shape[len(stack)]
    d = b @ a.reshape(stack + (rank, -1))
    if target.kind == "embed" or target.layout == "conv1d":  # weight (num|in, ...)
        d = jnp.swapaxes(d, -1, -2)
    return d.reshape(shape)


def merge_lora(model: Any) -> Any:
    """The plain model, each adapter folded into its layer's weight.

    For every layer with an adapter, `W + scaling * A B` is computed in float32 and
    cast back to `W`'s dtype (as PEFT's `merge_and_unload`); the adapters are
    removed, and the layers are of their original classes again. A weight kept
    quantized (`bridge.load(..., keep_quantized=True)`) is dequantized first: its
    merged layer holds a dense weight, as merging on the dequantized model gives it.

    **Arguments:**

    - `model`: a model with adapters (from `bridge.lora` or `bridge.load_peft`), in
      any form `bridge.lora` takes.

    **Returns:**

    The merged model, in the form it was given.

    **Raises:**

    `ValueError` when the model holds no adapter.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, bridge
    >>> import equinox as eqx
    >>> linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    >>> adapted = bridge.lora(linear, lambda t: t, rank=1, key=jax.random.key(1))
    >>> adapted = eqx.tree_at(lambda m: m.lora_b, adapted, jnp.ones((2, 1)))
    >>> merged = bridge.merge_lora(adapted)
    >>> type(merged).__name__
    'Linear'
    >>> x = jnp.ones(3)
    >>> bool(jnp.allclose(merged(x), adapted(x), atol=1e-6))
    True

    ```
    """
    check_model(model, "model")
    tree = to_neutral(model)
    frame = frame_of(framework(tree))
    found = [t for t in frame.targets(tree) if t.settings is not None]
    if not found:
        raise ValueError(
            "bridge.merge_lora: the model holds no LoRA adapter (bridge.lora or "
            "bridge.load_peft put them on)."
        )
    weights: dict[Path, Any] = {}
    for target in found:
        node = at(tree, target.path)
        # a weight kept quantized (`load(..., keep_quantized=True)`): its dense
        # weight (`QuantizedArray.__jax_array__`), so the merged layer is dense
        w = jnp.asarray(getattr(node, target.weight))
        d = delta_weight(target, getattr(node, A), getattr(node, B), w.shape)
        settings = target.settings
        assert settings is not None  # `found` holds the targets with an adapter
        scaling = settings.scaling
        weights[target.path] = (w.astype(jnp.float32) + scaling * d).astype(w.dtype)
    out = frame.strip(tree, weights)
    return out if isinstance(model, Tree) else frame.native(model, out)
