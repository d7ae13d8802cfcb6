"""The shapes a codec decodes or encodes to, cached (issue 28).

Pairing asks `jax.eval_shape` what a codec makes of a layer's shapes many times
(`find_layers`, `read_specs`, the fitting check of a plan): hundreds of traces for a
Llama, one per layer and candidate kind, although the layers repeat. The answer
depends only on the codec's function (`decode` or `encode`, held by the cache, so
its identity is not reused), the arrays' names, shapes and dtypes in order, the
layer's settings and JAX's settings that change a trace's dtypes or refusals
(64-bit, dtype and rank promotion): that is the key. A codec's refusal (an
exception) is cached too, and a copy of it raised again (one that cannot be
copied is not cached). Keys that cannot be hashed (a setting holding an array) are
not cached. The cache is bounded (least recently used entries leave first) and
results are handed out as new containers, so a caller changing one cannot change
another's. The codecs of Flax's own layout (`decode` is `same`, `encode` is
`same_as_like`) are not traced at all: their result is their input's shapes, with the
dtypes a trace would give (`float64` is `float32` without 64-bit).
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax

from ._codec import Codec, same, same_as_like


SIZE = 4096
# JAX settings that change shapes, dtypes or refusals of a trace.
_FLAGS = ("jax_enable_x64", "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion")
_cache: collections.OrderedDict[Any, tuple[bool, Any]] = collections.OrderedDict()
_lock = threading.Lock()


def _structs(leaves: Mapping[Any, Any]) -> dict[Any, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in leaves.items()}


def _traced(leaves: Mapping[Any, Any]) -> Any:
    """What a trace of the identity makes of `leaves`: their shapes, dtypes made
    canonical (`float64` is `float32` without 64-bit), in a container rebuilt as a
    trace rebuilds it (a dict's keys sorted)."""
    flat, treedef = jax.tree.flatten(_structs(leaves))
    canonical = jax.dtypes.canonicalize_dtype
    return treedef.unflatten(
        jax.ShapeDtypeStruct(x.shape, canonical(x.dtype, allow_extended_dtype=True))
        for x in flat
    )


def _signature(leaves: Mapping[Any, Any]) -> tuple:
    return tuple((k, tuple(v.shape), v.dtype) for k, v in leaves.items())


def _key(*parts: Any) -> Any:
    """The key, or None where a part cannot be hashed. Settings carry their types:
    `1`, `1.0` and `True` are equal in Python but may not be to a codec."""
    *rest, hyper = parts
    settings = tuple((k, type(v), v) for k, v in hyper.items())
    flags = tuple(getattr(jax.config, name) for name in _FLAGS)
    key = (*rest, settings, flags)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _cached(key: Any, compute: Callable[[], Any]) -> Any:
    if key is None:
        return compute()
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
    if hit is None:
        try:
            hit = (True, compute())
        except Exception as error:  # the codec's refusal, cached like an answer
            kept = _copy(error)
            if kept is None:
                raise
            hit = (False, kept)
        with _lock:
            _cache[key] = hit
            while len(_cache) > SIZE:
                _cache.popitem(last=False)
    ok, value = hit
    if not ok:
        raise _copy(value) or value
    return jax.tree.map(lambda x: x, value)


def _copy(error: Exception) -> Exception | None:
    """A copy of `error` without its traceback (a cached exception must hold no
    frames: they would keep the caller's arrays alive), or None where it cannot be
    copied faithfully."""
    try:
        made = copy.copy(error)
    except Exception:
        return None
    if type(made) is not type(error) or made.args != error.args:
        return None
    return made.with_traceback(None)


def decoded(codec: Codec, leaves: Mapping[Any, Any], hyper: dict[str, Any]) -> Any:
    """`jax.eval_shape` of `codec.decode` on `leaves`' shapes and dtypes."""
    if codec.decode is same:
        return _traced(leaves)
    key = _key("decode", codec.decode, _signature(leaves), hyper)
    return _cached(
        key,
        lambda: jax.eval_shape(lambda x: codec.decode(x, hyper), _structs(leaves)),
    )


def encoded(
    codec: Codec,
    canonical: Mapping[Any, Any],
    like: Mapping[Any, Any],
    hyper: dict[str, Any],
) -> Any:
    """`jax.eval_shape` of `codec.encode` of `canonical`'s shapes into `like`'s."""
    if codec.encode is same_as_like:
        return _traced({name: canonical[name] for name in like})
    key = _key("encode", codec.encode, _signature(canonical), _signature(like), hyper)
    return _cached(
        key,
        lambda: jax.eval_shape(
            lambda c, k: codec.encode(c, k, hyper), _structs(canonical), _structs(like)
        ),
    )


def clear() -> None:
    with _lock:
        _cache.clear()
