"""Abstract sharded targets: `bridge.port` and `bridge.load(like=...)` place every
array by the target leaf's sharding, on a (4, 2) mesh of 8 CPU devices."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import bridge
from bridge._io import _safetensors
from bridge._port import _run

from . import test_port_stacked as stacked
from .helpers import requires, skip_unless


IN, HIDDEN, OUT = 8, 16, 4


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets 8 CPU devices)")
    # Auto axes: jax.make_mesh's default, Explicit, breaks NNX's embedding gather
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def spec_of(shape):
    """Matrices over both axes (the longer dim over `data`), vectors over `model`."""
    if len(shape) == 2:
        return P("data", "model") if shape[0] >= shape[1] else P("model", "data")
    return P("model") if shape and shape[0] % 2 == 0 else P()


def sharded_abstract(tree, mesh):
    """`ShapeDtypeStruct`s of `tree`'s arrays, each with a NamedSharding."""

    def abstract(x):
        if not eqx.is_array(x) and not isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharding = NamedSharding(mesh, spec_of(x.shape))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map(abstract, tree)


class NnxMLP(nnx.Module):
    def __init__(self, rngs, partitioned=False):
        init = nnx.initializers.lecun_normal()
        first = nnx.with_partitioning(init, ("data", "model")) if partitioned else init
        self.hidden = nnx.Linear(IN, HIDDEN, kernel_init=first, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(OUT)(nn.relu(nn.Dense(HIDDEN)(x)))


def equinox_mlp(key):
    return eqx.nn.MLP(IN, OUT, HIDDEN, depth=1, activation=jax.nn.relu, key=key)


def nnx_abstract(mesh):
    skip_unless("NNX")
    model = nnx.eval_shape(lambda: NnxMLP(nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, sharded_abstract(state, mesh))


def linen_abstract(mesh):
    x = jnp.ones((1, IN))
    return sharded_abstract(jax.eval_shape(LinenMLP().init, jax.random.key(0), x), mesh)


def equinox_abstract(mesh):
    return sharded_abstract(eqx.filter_eval_shape(equinox_mlp, jax.random.key(0)), mesh)


ABSTRACT = {"nnx": nnx_abstract, "linen": linen_abstract, "equinox": equinox_abstract}


def concrete(kind):
    if kind == "nnx":
        skip_unless("NNX")
        return NnxMLP(nnx.Rngs(1))
    if kind == "linen":
        return LinenMLP().init(jax.random.key(1), jnp.ones((1, IN)))
    return equinox_mlp(jax.random.key(1))


def assert_placed(out, target):
    """Each output array has its target leaf's sharding; returns how many."""
    outs, wants = by_path(out), by_path(bridge._adapters._native.placeholders(target))
    assert outs.keys() == wants.keys() and len(outs) == 4
    for path, x in outs.items():
        assert isinstance(x, jax.Array), path
        assert x.sharding == wants[path].sharding, (path, x.sharding)


def by_path(model):
    leaves = jax.tree_util.tree_leaves_with_path(bridge.to_neutral(model))
    return {jax.tree_util.keystr(p): x for p, x in leaves}


def forward(model, x):
    if isinstance(model, dict):
        return LinenMLP().apply(model, x)
    return jax.vmap(model)(x) if isinstance(model, eqx.Module) else model(x)


@pytest.mark.parametrize("source", ["nnx", "linen", "equinox"])
@pytest.mark.parametrize("target", ["nnx", "linen", "equinox"])
def test_port_into_an_abstract_sharded_target(mesh, source, target):
    src = concrete(source)
    abstract = ABSTRACT[target](mesh)
    out = bridge.port(src, abstract)
    assert_placed(out, abstract)
    x = jax.random.normal(jax.random.key(2), (3, IN))
    assert np.allclose(forward(out, x), forward(src, x), atol=1e-5)


@pytest.mark.parametrize("kind", ["nnx", "linen", "equinox"])
@pytest.mark.parametrize("suffix", [".safetensors", ""])
def test_load_into_an_abstract_sharded_target(mesh, tmp_path, kind, suffix):
    model = concrete(kind)
    path = tmp_path / f"model{suffix}"
    bridge.save(path, model)
    abstract = ABSTRACT[kind](mesh)
    out = bridge.load(path, like=abstract)
    assert_placed(out, abstract)
    got, want = by_path(out), by_path(model)
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) for k in got)


@requires("NNX", "jax.set_mesh", "nnx.eval_shape shardings")
def test_nnx_partitioning_metadata_under_the_mesh(mesh, tmp_path):
    """`nnx.eval_shape` under `jax.set_mesh` gives shardings on the abstract mesh."""
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: NnxMLP(nnx.Rngs(0), partitioned=True))
        out = bridge.port(concrete("linen"), abstract)
        bridge.save(tmp_path / "m.safetensors", concrete("nnx"))
        loaded = bridge.load(tmp_path / "m.safetensors", like=abstract)
    for model in (out, loaded):
        kernel = model.hidden.kernel[...]
        assert kernel.sharding == NamedSharding(mesh, P("data", "model"))
    match = r"(?s)abstract mesh.*with jax.set_mesh\(mesh\)"
    with pytest.raises(ValueError, match=match):
        bridge.port(concrete("linen"), abstract)


def stacked_sharded(name, mesh):
    """An abstract stacked target (`nn.scan`, `nnx.vmap`, `eqx.filter_vmap`): each
    array sharded, a stack's layer axis unsharded and each layer as `spec_of` says."""
    if name.startswith("nnx"):
        skip_unless("NNX")
    abstract = stacked._abstract(name, 1)

    def sharded(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        spec = P(None, *spec_of(x.shape[1:])) if x.shape[0] == 3 else spec_of(x.shape)
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, spec)
        )

    if name.startswith("nnx"):
        graphdef, state = nnx.split(abstract)
        return nnx.merge(graphdef, jax.tree_util.tree_map(sharded, state))
    return jax.tree_util.tree_map(sharded, abstract)


@pytest.mark.parametrize("target", stacked.STACKS)
@pytest.mark.parametrize("source", stacked.LOOPS)
def test_per_layer_layers_into_an_abstract_sharded_stack(mesh, source, target):
    """A stack (leading layer axis) built from per-layer layers has the target's
    sharding, as every other ported array."""
    if "nnx" in source:
        skip_unless("NNX")
    src = stacked._model(source, 0)
    abstract = stacked_sharded(target, mesh)
    out = bridge.port(src, abstract)
    wants = by_path(bridge._adapters._native.placeholders(abstract))
    outs = by_path(out)
    assert outs.keys() == wants.keys()
    stacks = [p for p in outs if p.startswith(".blocks.")]
    assert {outs[p].shape[0] for p in stacks} == {3} and len(stacks) == 4
    for path, x in outs.items():
        assert x.sharding == wants[path].sharding, (path, x.sharding)
    assert any(outs[p].sharding.spec == P(None, "data", "model") for p in stacks)
    assert bridge.compare(src, out, stacked.X) < 1e-5


FILE_PAIRS = [(s, t) for s in ABSTRACT for t in ABSTRACT if s != t]


@pytest.mark.parametrize(("source", "target"), FILE_PAIRS)
def test_load_from_another_framework_reads_array_by_array(
    mesh, tmp_path, monkeypatch, source, target
):
    """Loading another framework's safetensors file into an abstract sharded target
    ports it while reading it: each layer's arrays are read from the file just before
    they are converted and placed, never the whole file first. Before the first
    placement: the first row's two arrays and at most one more, the array
    `bridge.load` reads in a thread while it plans (a quarter of the file, at least
    one array: `bridge._lazy.read_early`); this file is too small to read a row
    ahead (1/32 of it)."""
    model = concrete(source)
    bridge.save(tmp_path / "m.safetensors", model)
    read, placed = [], []
    real_read, real_place = _safetensors.read_one, _run.place

    def reading(contents, name, **kwargs):
        read.append(name)
        return real_read(contents, name, **kwargs)

    def placing(array, sharding):
        placed.append(len(read))
        return real_place(array, sharding)

    monkeypatch.setattr(_safetensors, "read_one", reading)
    monkeypatch.setattr(_run, "place", placing)
    abstract = ABSTRACT[target](mesh)
    out = bridge.load(tmp_path / "m.safetensors", like=abstract)
    assert_placed(out, abstract)
    assert len(read) == 4 and placed[0] <= 3, (read, placed)
    x = jax.random.normal(jax.random.key(2), (3, IN))
    assert np.allclose(forward(out, x), forward(model, x), atol=1e-5)


def test_an_abstract_mesh_is_resolved_against_the_mesh_in_context(mesh):
    """Shardings on an abstract mesh (as `nnx.eval_shape` gives under the mesh) are
    placed on the mesh in context: `jax.set_mesh`, or `jax.sharding.use_mesh` on the
    JAX releases before it (no `jax.sharding.get_mesh` there)."""
    in_context = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh

    def on_abstract_mesh(x):
        sharding = NamedSharding(mesh.abstract_mesh, spec_of(x.shape))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    shapes = jax.eval_shape(LinenMLP().init, jax.random.key(0), jnp.ones((1, IN)))
    target = jax.tree_util.tree_map(on_abstract_mesh, shapes)
    source = concrete("equinox")
    with in_context(mesh):
        out = bridge.port(source, target)
    for path, x in by_path(out).items():
        want = NamedSharding(mesh, spec_of(x.shape))
        assert x.sharding.is_equivalent_to(want, x.ndim), path
    x = jax.random.normal(jax.random.key(2), (3, IN))
    assert np.allclose(forward(out, x), forward(source, x), atol=1e-5)
    with pytest.raises(ValueError, match=r"(?s)abstract mesh.*jax.set_mesh\(mesh\)"):
        bridge.port(source, target)
