"""Shared test helpers: tiny models in every framework and exact comparisons."""

import re
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def tree_equal_bits(a, b) -> bool:
    """Same structure, same dtypes, same bits (NaNs included)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True


def fresh(tree):
    """A copy of every array of `tree`: a donating step consumes the copy, and the
    test keeps the arrays it shares with the native model (the oracle's start)."""
    return jax.tree_util.tree_map(jnp.copy, tree)


def tree_allclose(a, b, rtol=1e-5, atol=1e-6) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
        for x, y in zip(la, lb)
    )


# --- adapters: zero copy, no mutation, nothing shared --------------------------------

# One array of every dtype the adapters must carry exactly (typed PRNG keys aside).
DTYPES = ("float32", "bfloat16", "float16", "int8", "uint32", "complex64")


def array_of(dtype: str, shape=(2, 3)) -> jax.Array:
    """Distinct, non-trivial bits for `dtype` (NaN-free)."""
    values = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + 1.5
    if dtype == "complex64":
        return (values + 1j * values).astype(jnp.complex64)
    return values.astype(dtype)


def leaf_objects(obj, is_leaf=None) -> list:
    """The leaves of a pytree, for identity checks (`is`)."""
    return jax.tree_util.tree_leaves(obj, is_leaf=is_leaf)


def same_objects(a: list, b: list) -> bool:
    """Element by element the very same objects (zero copy)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def snapshot(obj):
    """What a pytree is made of: its structure and its leaf objects. Compare two
    snapshots with `==` to see that nothing was replaced or mutated in place."""
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    return treedef, tuple(map(id, leaves)), tuple(_bits(x) for x in leaves)


def _bits(x) -> bytes:
    if not hasattr(x, "dtype"):  # a function, a python number: its identity
        return repr((type(x), id(x))).encode()
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


def key_orders(obj, path=()) -> list:
    """`(path, keys)` of every mapping in a nested structure, keys in their order
    (JAX's treedefs do not see insertion order; a user reading the dict does)."""
    if not isinstance(obj, Mapping):
        return []
    out = [(path, tuple(obj))]
    for key, child in obj.items():
        out += key_orders(child, path + (key,))
    return out


def run_markdown(path) -> str:
    """Run every ```python block of a Markdown page, in order, as one script.

    Returns the code, so a test can check that the page shows what it should.
    """
    path = Path(path)
    code = "\n".join(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))
    exec(compile(code, str(path), "exec"), {"__name__": "page"})
    return code
