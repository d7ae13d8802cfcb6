"""Placement: the sharding a target's leaf asks for, and arrays put there shard by
shard, so that a large model is never whole on one device or host."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax._src import mesh as mesh_lib
from jax.sharding import AbstractMesh, Mesh, NamedSharding, Sharding


_NO_MESH = """\
The target's array at {where} is sharded over an abstract mesh {mesh} (the
`nnx.eval_shape` / `jax.eval_shape` of a model made under `jax.set_mesh`), and no
concrete mesh with those axes is in context to place it on. Call under the same mesh:
`with jax.set_mesh(mesh): bridge.port(...)` (or `bridge.load(...)`; before JAX 0.7.1,
`with jax.sharding.use_mesh(mesh):`)."""


def sharding_of(leaf: Any, where: str = "") -> Sharding | None:
    """The sharding a target leaf asks for: a concrete array's, or a
    `jax.ShapeDtypeStruct`'s (`jax.eval_shape`, `nnx.eval_shape`,
    `eqx.filter_eval_shape`), its abstract mesh resolved against the mesh in context
    (`jax.set_mesh`); None when the leaf asks for none."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, Sharding):
        return None
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        mesh = _mesh_in_context()
        if mesh is None or (mesh.axis_names, mesh.axis_sizes) != (
            sharding.mesh.axis_names,
            sharding.mesh.axis_sizes,
        ):
            raise ValueError(
                _NO_MESH.format(where=where, mesh=dict(sharding.mesh.shape))
            )
        sharding = NamedSharding(mesh, sharding.spec)
    return sharding


def _mesh_in_context() -> Mesh | None:
    """The concrete mesh in context, or None. `jax.sharding.get_mesh` is what
    `jax.set_mesh` sets; JAX before 0.7.1 (`jax.sharding.use_mesh`) has no public
    accessor, only the one `get_mesh` calls now."""
    get_mesh = getattr(jax.sharding, "get_mesh", None) or mesh_lib.get_concrete_mesh
    mesh = get_mesh()
    return None if mesh is None or mesh.empty else mesh


def place(array: Any, sharding: Sharding | None) -> Any:
    """`array` laid out by `sharding` (unchanged when None or already so). A host
    array goes to each device as that device's shard only, never whole to one
    device; it must be memory the caller gives away (a checkpoint's freshly read
    array): a shard may keep using it rather than copy it."""
    if sharding is None:
        return array
    if isinstance(array, np.ndarray):
        return jax.make_array_from_callback(
            array.shape, sharding, lambda index: array[index]
        )
    if isinstance(array, jax.Array) and array.sharding.is_equivalent_to(
        sharding, array.ndim
    ):
        return array
    return jax.device_put(array, sharding)


class Placeholder(np.ndarray):
    """A zero-memory stand-in (`np.broadcast_to` zeros) for an abstract leaf that
    Equinox does not count as an array (`jax.ShapeDtypeStruct`), keeping its
    sharding."""

    sharding: Sharding | None = None


def placeholder(leaf: Any) -> Any:
    """A `Placeholder` for a `jax.ShapeDtypeStruct` (keeping its sharding); any
    other leaf as it is."""
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    stand_in = np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape).view(Placeholder)
    stand_in.sharding = leaf.sharding
    return stand_in
