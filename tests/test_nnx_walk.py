"""`bridge.from_nnx`'s own walk of the module graph (`_adapters/_nnx_walk.py`)
against the path through `nnx.graph.flatten`, field by field: the graph definition,
leaves, roles, paths, native positions and orders, the Tree's structure, and the
modules `to_nnx` rebuilds. Graphs the walk does not read must take the old path."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import __version__ as flax_version, nnx

import bridge
from bridge._adapters import _nnx, _nnx_walk

from . import models
from .helpers import requires


pytestmark = requires("NNX")

# the flax versions whose graph internals the walk was checked against; older
# NNX-capable flax may take the old path (the walk checks itself once)
CHECKED = tuple(int(p) for p in flax_version.split(".")[:3]) >= (0, 12, 8)


def _walked(module):
    """The walk's reading of `module`; fails if it falls back."""
    if not CHECKED:
        pytest.skip(f"the walk is checked on flax >= 0.12.8, not {flax_version}")
    assert _nnx_walk.usable()
    walked = _nnx_walk.walk(module, _nnx._role)
    assert walked is not None, "the fast walk fell back"
    return walked


def _bits(x) -> tuple:
    if isinstance(x, jax.ShapeDtypeStruct):
        return (x.shape, x.dtype, x.sharding)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    x = np.asarray(x)
    return (x.shape, x.dtype, x.tobytes())


def _order(module) -> list:
    """Every graph node's attribute order (`vars`), by path (an nnx.List's is
    flax's own)."""
    return [
        (path, list(vars(node)))
        for path, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Pytree) and not isinstance(node, nnx.List)
    ]


def check_same(module) -> bridge.Tree:
    """`from_nnx(module)` by the walk equals the old path in every field, and both
    Trees rebuild the same module."""
    walked = _walked(module)
    new = bridge.from_nnx(module)
    old = _nnx._from_graph(module)
    src_new, src_old = new._info.source, old._info.source
    graphdef, flat = nnx.graph.flatten(module)
    # the graph definition: flax's own, record for record
    assert walked.graphdef == graphdef
    assert src_new.record.graphdef.value == src_old.record.graphdef.value
    assert len(walked.graphdef.nodes) == len(graphdef.nodes)
    assert all(
        type(a) is type(b) for a, b in zip(walked.graphdef.nodes, graphdef.nodes)
    )
    assert src_new.record.mutable == src_old.record.mutable
    assert src_new.record.layout.value == src_old.record.layout.value
    assert dict(src_new.native) == dict(src_old.native)
    assert src_new.paths == src_old.paths
    assert src_new.order == src_old.order
    assert src_new == src_old and hash(src_new) == hash(src_old)
    # the Tree: structure (keys, roles, kinds, source), leaves (the same objects)
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(old)
    leaves_new, leaves_old = (
        jax.tree_util.tree_leaves(new),
        jax.tree_util.tree_leaves(old),
    )
    assert len(leaves_new) == len(leaves_old) == len(flat.leaves)
    assert all(a is b for a, b in zip(leaves_new, leaves_old))
    assert jax.tree_util.tree_leaves(bridge.roles(new)) == jax.tree_util.tree_leaves(
        bridge.roles(old)
    )
    keystrs = [
        [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
        for t in (new, old)
    ]
    assert keystrs[0] == keystrs[1]
    # to_nnx: the same module back from either Tree, bit for bit, definition order
    back_new, back_old = bridge.to_nnx(new), bridge.to_nnx(old)
    g_new, f_new = nnx.graph.flatten(back_new)
    g_old, f_old = nnx.graph.flatten(back_old)
    assert g_new == g_old == graphdef
    assert f_new.paths == f_old.paths == flat.paths
    for a, b, c in zip(f_new.leaves, f_old.leaves, flat.leaves):
        value = lambda v: v.get_raw_value() if isinstance(v, nnx.Variable) else v  # noqa: E731
        assert type(a) is type(b) is type(c)
        assert _bits(value(a)) == _bits(value(b)) == _bits(value(c))
        if isinstance(a, nnx.Variable):
            assert a.get_metadata() == b.get_metadata() == c.get_metadata()
    assert _order(back_new) == _order(back_old)
    return new


# --- models written the way real code writes them ----------------------------------


class Block(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, dim, decode=False, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(dim, 2 * dim, rngs=rngs),
            jax.nn.gelu,
            nnx.Linear(2 * dim, dim, rngs=rngs),
        )
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.drop(self.mlp(x))


class ViT(nnx.Module):
    """Arrays next to sublayers (a plain array and a Param), a list of blocks."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        self.patch = nnx.Conv(3, 8, (2, 2), strides=2, rngs=rngs)
        self.pos_embedding = jnp.zeros((1, 4, 8))  # a plain array attribute
        self.cls = nnx.Param(jnp.ones((1, 1, 8)))
        self.blocks = nnx.List([Block(8, rngs) for _ in range(depth)])
        self.head = nnx.Linear(8, 3, rngs=rngs)


class Scanned(nnx.Module):
    """Layers created under `nnx.vmap` (a leading layer axis on every Variable)."""

    def __init__(self, layers: int, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return nnx.Linear(4, 4, rngs=rngs)

        self.stack = make(rngs)
        self.embed = nnx.Embed(10, 4, rngs=rngs)


class Mask(nnx.Variable):
    """A custom Variable type."""


class Norms(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.rms = nnx.RMSNorm(4, rngs=rngs)
        self.group = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
        self.mask = Mask(jnp.ones(4, jnp.bool_), note="kept")
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.lora = nnx.LoRA(4, 2, 4, rngs=rngs)
        self.lora_linear = nnx.LoRALinear(4, 4, lora_rank=2, rngs=rngs)
        self.no_bias = nnx.Linear(4, 4, use_bias=False, rngs=rngs)


class Sharded(nnx.Module):
    """Variables with sharding names and other metadata."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", "model"))
        self.dense = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
        self.extra = nnx.Param(jnp.ones((2, 2)), out_sharding=("model", None), tag=3)


class Containers(nnx.Module):
    """nnx.Dict and plain containers filled in a shuffled order, names that sort
    differently by characters and naturally (`layer_10` before `layer_2`)."""

    def __init__(self, seed: int, rngs: nnx.Rngs):
        rng = random.Random(seed)
        names = [f"layer_{i}" for i in range(12)]
        rng.shuffle(names)
        for name in names:  # attributes in a shuffled order
            setattr(self, name, nnx.Linear(2, 2, rngs=rngs))
        keys = [f"head_{i}" for i in range(11)]
        rng.shuffle(keys)
        self.heads = nnx.Dict({k: nnx.Linear(2, 1, rngs=rngs) for k in keys})
        self.items = nnx.data(
            {k: nnx.BatchStat(jnp.full(2, i)) for i, k in enumerate(keys)}
        )
        self.pairs = nnx.data([(nnx.Param(jnp.ones(1)), None), [jnp.zeros(2)]])
        self.sizes = [2, 2]  # a mutable static attribute
        self.act = jax.nn.relu
        self.empty = nnx.Dropout(0.5)  # a module without leaves
        self.rngs = rngs


class Leafless(nnx.Module):
    def __init__(self):
        self.rate = 0.5
        self.inner = nnx.Dropout(0.1)


def _sharded(abstract: bool = False):
    if not hasattr(jax, "set_mesh"):
        pytest.skip("needs jax.set_mesh")
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(auto, auto))
    with jax.set_mesh(mesh):
        if abstract:
            return nnx.eval_shape(lambda: Sharded(nnx.Rngs(0)))
        return Sharded(nnx.Rngs(0))


def _vit():
    return ViT(2, nnx.Rngs(0, dropout=1))


CASES = {
    "linear": lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
    "mlp": models.nnx_mlp,
    "cnn": models.nnx_cnn,
    "block": models.nnx_block,
    "vit": _vit,
    "scanned": lambda: Scanned(3, nnx.Rngs(0)),
    "norms": lambda: Norms(nnx.Rngs(0)),
    "sharded": _sharded,
    "containers_0": lambda: Containers(0, nnx.Rngs(0)),
    "containers_1": lambda: Containers(1, nnx.Rngs(1, dropout=2)),
    "leafless": Leafless,
}


@pytest.mark.parametrize("name", CASES)
def test_walk_equals_the_graph_flatten_path(name):
    check_same(CASES[name]())


@pytest.mark.parametrize("name", ["vit", "containers_0", "norms"])
def test_walk_after_split_merge_and_jit(name):
    module = CASES[name]()
    graphdef, state = nnx.split(module)
    check_same(nnx.merge(graphdef, state))  # attributes now in sorted order

    @nnx.jit
    def touch(m):
        for _, v in nnx.iter_graph(m):
            if isinstance(v, nnx.Param):
                v[...] = v[...] + 1

    touch(module)  # nnx.jit sets the module's attributes again
    check_same(module)


# (a plain array attribute leaks a tracer out of nnx.eval_shape on jax 0.12)
ABSTRACT = {
    "block": lambda: nnx.eval_shape(models.nnx_block),
    "norms": lambda: nnx.eval_shape(CASES["norms"]),
    "scanned": lambda: nnx.eval_shape(CASES["scanned"]),
    "sharded": lambda: _sharded(abstract=True),
}


@pytest.mark.parametrize("name", ABSTRACT)
def test_walk_of_an_abstract_model(name):
    abstract = ABSTRACT[name]()
    tree = check_same(abstract)
    assert any(
        isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(tree)
    )


def test_walk_after_a_forward_pass_and_a_training_step():
    module = _vit()
    module.blocks[0](jnp.ones((1, 3, 8)))  # the Dropout's RNG counter moves
    check_same(module)
    tree = bridge.from_nnx(models.nnx_mlp())
    step = bridge.make_step(
        lambda m, x, y: jnp.mean((m(x) - y) ** 2),
        optax.sgd(0.1),
        bridge.trainable(tree, lambda t: t),
    )
    opt = step.init(tree)
    tree, opt, _ = step(tree, opt, models.mlp_input(), jnp.zeros((1, models.D_OUT)))
    check_same(bridge.to_nnx(tree))


# --- graphs the walk leaves to nnx.graph.flatten -----------------------------------


class TiedModule(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(2, 2, rngs=rngs)
        self.b = self.a  # the same module twice


class TiedVariable(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(5, 2, rngs=rngs)
        self.unembed = self.embed.embedding  # the same Variable twice


class Cycle(nnx.Module):
    def __init__(self, rngs):
        self.child = nnx.Linear(2, 2, rngs=rngs)
        self.child.parent = self  # the module reachable from its child


class NotPytree(nnx.Object):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))


class HoldsObject(nnx.Module):
    def __init__(self):
        self.inner = NotPytree()


class HoldsScalar(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 2, rngs=rngs)
        self.scale = nnx.data(2.0)  # data that is not an array


class HoldsNamedTuple(nnx.Module):
    def __init__(self, rngs):
        from collections import namedtuple

        Pair = namedtuple("Pair", "first second")
        self.pair = nnx.data(Pair(nnx.Param(jnp.ones(1)), nnx.Param(jnp.zeros(1))))


class IntKeyed(nnx.Module):
    def __init__(self, rngs):
        self.table = nnx.data({1: nnx.Param(jnp.ones(1)), 0: nnx.Param(jnp.zeros(1))})


FALLBACKS = {
    "shared module": lambda: TiedModule(nnx.Rngs(0)),
    "shared variable": lambda: TiedVariable(nnx.Rngs(0)),
    "cycle": lambda: Cycle(nnx.Rngs(0)),
    "non-pytree object": HoldsObject,
    "scalar data": lambda: HoldsScalar(nnx.Rngs(0)),
    "custom pytree": lambda: HoldsNamedTuple(nnx.Rngs(0)),
    "int dict keys": lambda: IntKeyed(nnx.Rngs(0)),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_what_the_walk_does_not_read_takes_the_old_path(name):
    module = FALLBACKS[name]()
    if CHECKED:
        assert _nnx_walk.usable()
    assert _nnx_walk.walk(module, _nnx._role) is None
    tree = bridge.from_nnx(module)
    old = _nnx._from_graph(module)
    assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(old)
    if name != "scalar data":  # a float leaf does not go back (as before the walk)
        back = bridge.to_nnx(tree)
        assert nnx.graph.flatten(back)[0] == nnx.graph.flatten(module)[0]


def test_tree_mode_takes_the_old_path():
    if not hasattr(nnx.graph, "set_graph_mode") and not hasattr(
        getattr(nnx, "graphlib", None), "set_graph_mode"
    ):
        pytest.skip("this flax has no tree mode")
    from flax.nnx import graphlib

    module = models.nnx_mlp()
    with graphlib.set_graph_mode(False):
        assert not _nnx_walk.usable()
        tree = bridge.from_nnx(module)
        old = _nnx._from_graph(module)
    assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(old)


def test_walk_inside_a_trace():
    """Variables holding tracers are read (as flax reads them); the walk's one-time
    self-check holds when it first runs inside a trace."""
    module = models.nnx_mlp()
    graphdef, state = nnx.split(module)
    _nnx_walk._agrees.cache_clear()

    @jax.jit
    def inside(state):
        m = nnx.merge(graphdef, state)
        if CHECKED:
            assert _nnx_walk.usable()
            assert _nnx_walk.walk(m, _nnx._role) is not None
        new, old = bridge.from_nnx(m), _nnx._from_graph(m)
        assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(old)
        return jax.tree_util.tree_leaves(new)

    inside(state)
    assert not CHECKED or _nnx_walk._agrees()
