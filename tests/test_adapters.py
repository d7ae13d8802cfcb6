"""What every adapter must do: the checklist for a new framework.

Each registered framework has a row in `FRAMEWORKS`; every test below runs for each
row: the round trip is exact (structure, dtypes, bits) and zero copy, the source is
never mutated, `to_neutral`/`to_native` dispatch to it, errors name the fix, and it
survives 8 threads converting at once. Then a toy fourth framework (a dict of arrays,
with its own codecs) is registered from inside this file, touching no other file, and
works with `to_neutral`, `to_native`, `trainable`, `make_step`, `port` (both ways
with NNX), `save`/`load`: the proof that the adapter registry is the whole recipe.
Last, a user codec pair (the porting guide's `Scale`) goes through a checkpoint file
and through `bridge convert --to-layout equinox`.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import bridge
from bridge._adapters import _registry
from bridge._adapters._build import build, native_leaves
from bridge._cli import main
from bridge._tree import Tree, framework

from . import models
from .helpers import (
    DTYPES,
    array_of,
    in_threads,
    leaf_objects,
    missing,
    requires,
    same_objects,
    skip_unless,
    snapshot,
    tree_equal_bits,
)


# --- the checklist, one row per framework --------------------------------------------


class _LinenHolder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x


class _NNXHolder(nnx.Module):
    def __init__(self, leaf):
        self.value = nnx.Param(leaf)


class _EqxHolder(eqx.Module):
    value: Any


@dataclass(frozen=True)
class Framework:
    """A row of the checklist: how to make a model, run it, and hold one array."""

    name: str
    make: Callable[[], Any]  # a model, in a form to_neutral takes
    run: Callable[[Any], Any]  # its output on models.mlp_input(), for a native model
    holding: Callable[[Any], Any]  # a model whose only array is the given one
    array: Callable[[Any], Any] = lambda x: x  # a JAX array as the model holds one
    keys: bool = True  # holds typed PRNG key arrays
    # the model's arrays (a Keras model is no pytree: its variables' values)
    leaves: Callable[[Any], list] = leaf_objects


def _torch_mlp() -> dict:
    """The Equinox MLP's state dict, as the PyTorch `nn.Sequential` of the same
    layers names and lays it out (`nn.Linear` weight `(out, in)`, as Equinox's)."""
    layers = models.equinox_mlp().layers
    return {
        f"layers.{i}.{name}": np.asarray(getattr(layer, name))
        for i, layer in enumerate(layers)
        for name in ("weight", "bias")
    }


def _torch_run(state: dict) -> Any:
    x, n = models.mlp_input(), len(state) // 2
    for i in range(n):
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"][None]
        x = jax.nn.relu(x) if i < n - 1 else x
    return x


def _haiku_mlp(seed: int = 0) -> tuple:
    """`(fn, params)` of Haiku's own `hk.nets.MLP`, the shapes of `models.mlp_input`."""
    hk = pytest.importorskip("haiku")
    fn = hk.without_apply_rng(
        hk.transform(
            lambda x: hk.nets.MLP([models.D_HID, models.D_HID, models.D_OUT])(x)
        )
    )
    return fn, fn.init(jax.random.key(seed), models.mlp_input())


def _haiku_holding(leaf: Any) -> tuple:
    """`(fn, params)` whose only array is `leaf` (a function that reads it)."""
    hk = pytest.importorskip("haiku")
    fn = hk.without_apply_rng(hk.transform(lambda: hk.get_parameter("value", (2, 3))))
    return fn, {"holder": {"value": leaf}}


def _keras_mlp(seed: int = 0) -> Any:
    """A Keras `Sequential` MLP of the shapes of `models.mlp_input`."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((models.D_IN,)),
            keras.layers.Dense(models.D_HID, activation="relu"),
            keras.layers.Dense(models.D_HID, activation="relu"),
            keras.layers.Dense(models.D_OUT),
        ]
    )


def _keras_run(model: Any, x: Any) -> Any:
    """`model(x)`; Keras's own layers broadcast by rank (`tests/conftest.py` makes
    that an error for bridge's code)."""
    with jax.numpy_rank_promotion("allow"):
        return model(x)


def _keras_holding(leaf: Any) -> Any:
    """A Keras layer whose only variable holds `leaf` (the very array)."""
    keras = pytest.importorskip("keras")

    class Holder(keras.layers.Layer):
        def __init__(self, shape, kind, **kwargs):
            super().__init__(**kwargs)
            self.shape_and_kind = (tuple(shape), kind)
            self.value = self.add_weight(shape, dtype=kind, name="value")

        def get_config(self):
            shape, kind = self.shape_and_kind
            return {**super().get_config(), "shape": shape, "kind": kind}

    layer = Holder(leaf.shape, str(leaf.dtype), name="holder")
    layer.value._direct_assign(leaf)
    return layer


FRAMEWORKS = {
    "linen": Framework(
        "linen",
        lambda: models.linen_mlp(),
        lambda m: m[0].apply(m[1], models.mlp_input()),
        lambda leaf: {"params": {"value": leaf}},
    ),
    "nnx": Framework(
        "nnx",
        models.nnx_mlp,
        lambda m: m(models.mlp_input()),
        _NNXHolder,
    ),
    "equinox": Framework(
        "equinox",
        models.equinox_mlp,
        lambda m: jax.vmap(m)(models.mlp_input()),
        _EqxHolder,
    ),
    # state dicts of numpy arrays; torch.Tensors: tests/test_torch_adapter.py
    "torch": Framework(
        "torch",
        _torch_mlp,
        _torch_run,
        lambda leaf: {"value": leaf},
        array=np.asarray,
        keys=False,
    ),
    # Haiku's own MLP, `(fn, params)`; dicts alone: tests/test_haiku_adapter.py
    "haiku": Framework(
        "haiku",
        _haiku_mlp,
        lambda m: m[0].apply(m[1], models.mlp_input()),
        _haiku_holding,
        keys=False,
    ),
    "keras": Framework(
        "keras",
        _keras_mlp,
        lambda m: _keras_run(m, models.mlp_input()),
        _keras_holding,
        keys=False,
        leaves=lambda m: [v.value for v in m.variables],
    ),
}


# the parameter for each row; NNX's needs a flax with bridge's NNX adapter
NAMES = [
    pytest.param(n, marks=requires("NNX")) if n == "nnx" else n for n in FRAMEWORKS
]


def _native_form(name: str, native: Any, source: Any) -> Any:
    """`to_native`'s result in the form `run` takes (Linen: `(module, variables)`)."""
    if name == "linen":
        return source[0], native.variables if isinstance(native, nn.Module) else native
    return native


def test_every_registered_framework_has_a_row():
    assert set(_registry.names()) >= set(FRAMEWORKS)
    for name in FRAMEWORKS:
        adapter = _registry.adapter_named(name)
        assert adapter.name == name and adapter.display and adapter.layout


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_exact_zero_copy_and_leaves_the_source(name):
    row = FRAMEWORKS[name]
    source = row.make()
    before = snapshot(row.leaves(source))
    tree = bridge.to_neutral(source)
    assert framework(tree) == name and bridge.to_neutral(tree) is tree
    native = bridge.to_native(tree)
    # zero copy: the Tree's leaves are the source's arrays, and so are the result's
    arrays = [x for x in row.leaves(source) if hasattr(x, "dtype")]
    assert {id(x) for x in leaf_objects(tree)} == {id(x) for x in arrays}
    rebuilt = row.leaves(_native_form(name, native, source))
    assert {id(x) for x in rebuilt} >= {id(x) for x in arrays}
    again = bridge.to_neutral(native if name != "linen" else source)
    assert same_objects(leaf_objects(again), leaf_objects(tree))
    # the same function, bit for bit, and the source untouched
    assert tree_equal_bits(row.run(_native_form(name, native, source)), row.run(source))
    assert snapshot(row.leaves(source)) == before


@pytest.mark.parametrize("dtype", DTYPES + ("key",))
@pytest.mark.parametrize("name", NAMES)
def test_every_dtype_round_trips_exactly(name, dtype):
    row = FRAMEWORKS[name]
    if dtype == "key" and not row.keys:
        pytest.skip(f"a {name} model holds no PRNG keys")
    leaf = jax.random.split(jax.random.key(7), 3) if dtype == "key" else array_of(dtype)
    leaf = row.array(leaf)
    model = row.holding(leaf)
    tree = bridge.to_neutral(model)
    (stored,) = jax.tree_util.tree_leaves(tree)
    assert stored is leaf and stored.dtype == leaf.dtype
    back = bridge.to_neutral(bridge.to_native(tree))
    (again,) = jax.tree_util.tree_leaves(back)
    assert again is leaf and tree_equal_bits(again, leaf)


def test_to_neutral_dispatches_on_what_it_is_given():
    module, variables = models.linen_mlp()
    model, state = models.equinox_cnn()
    cases = [
        (models.nnx_mlp(), "nnx"),
        (model, "equinox"),
        ((model, state), "equinox"),
        (variables, "linen"),
        ((module, variables), "linen"),
        (module.bind(variables), "linen"),
        (_torch_mlp(), "torch"),
    ]
    for obj, expected in cases:
        tree = bridge.to_neutral(obj)
        assert framework(tree) == expected
        assert bridge.to_neutral(tree) is tree
    assert isinstance(bridge.to_native(bridge.to_neutral((model, state))), tuple)


def test_to_native_gives_each_framework_its_own_model():
    module, variables = models.linen_mlp()
    x = models.mlp_input()
    bound = bridge.to_native(bridge.to_neutral((module, variables)))
    assert isinstance(bound, nn.Module) and tree_equal_bits(
        bound(x), module.apply(variables, x)
    )
    assert isinstance(bridge.to_native(bridge.to_neutral(models.nnx_mlp())), nnx.Module)
    eqx_model = bridge.to_native(bridge.to_neutral(models.equinox_mlp()))
    assert isinstance(eqx_model, eqx.nn.MLP)
    assert tree_equal_bits(jax.vmap(eqx_model)(x), jax.vmap(models.equinox_mlp())(x))


def test_an_unknown_object_is_refused():
    with pytest.raises(TypeError, match="does not know how to convert `obj`, a int"):
        bridge.to_neutral(3)
    with pytest.raises(TypeError, match="does not know how to convert `obj`, a tuple"):
        bridge.to_neutral((1, 2))


def test_an_unbound_linen_module_is_refused():
    module, _ = models.linen_mlp()
    with pytest.raises(TypeError, match="unbound Linen module holds no weights"):
        bridge.to_neutral(module)


def test_a_subtree_is_refused():
    t = bridge.from_nnx(models.nnx_mlp())
    with pytest.raises(TypeError, match="a part of a model .a subtree."):
        bridge.to_native(t.layers)
    with pytest.raises(TypeError, match="`tree` must be a bridge.Tree, got dict"):
        bridge.to_native({})


@pytest.mark.parametrize(
    "source, to",
    [
        ("nnx", bridge.to_linen),
        ("nnx", bridge.to_equinox),
        ("linen", bridge.to_nnx),
        ("equinox", bridge.to_nnx),
        ("equinox", bridge.to_linen),
    ],
)
def test_a_tree_from_another_framework_is_refused(source, to):
    tree = bridge.to_neutral(FRAMEWORKS[source].make())
    with pytest.raises(
        TypeError, match=r"use bridge.to_native\(tree\), or bridge.port"
    ):
        to(tree)


def test_a_second_adapter_of_a_name_is_refused():
    linen = _registry.adapter_named("linen")
    with pytest.raises(ValueError, match="'linen' is registered already"):
        _registry.register_adapter(linen)
    with pytest.raises(TypeError, match="Expected an Adapter, got dict"):
        _registry.register_adapter({"name": "x"})  # pyright: ignore[reportArgumentType]


def _linen_variables(i: int) -> dict:
    """Linen variables of structure `i` (each `i` another structure)."""
    return {"params": {f"Dense_{j}": {"kernel": jnp.ones((2, 2))} for j in range(i)}}


@pytest.mark.parametrize("name", NAMES)
def test_eight_threads_converting_at_once_never_fail(name):
    # more structures than the Linen adapter remembers (32), so that threads evict
    # each other's entries while they convert
    if name == "linen":
        sources = [_linen_variables(i) for i in range(1, 41)]
    else:
        sources = [FRAMEWORKS[name].make() for _ in range(4)]
    want = [jax.tree_util.tree_leaves(bridge.to_neutral(s)) for s in sources]

    def work(k: int) -> list[bool]:
        same = []
        for _ in range(5):
            for i in range(k % 3, len(sources), 3):
                tree = bridge.to_neutral(sources[i])
                same.append(same_objects(jax.tree_util.tree_leaves(tree), want[i]))
                bridge.to_native(tree)
        return same

    results = in_threads(work)
    assert all(all(same) and same for same in results)


# --- a toy fourth framework, registered from this file only --------------------------


class ToyLinear(dict):
    """The toy framework's layer: `{"w": (out, in), "b": (out,)}`, `y = w @ x + b`."""


class ToyMLP(dict):
    """The toy framework's model: named layers, applied in order, relu between."""

    def __call__(self, x):
        layers = list(self.values())
        for layer in layers[:-1]:
            x = jax.nn.relu(_affine(x, layer))
        return _affine(x, layers[-1])


def _affine(x, layer):
    y = x @ layer["w"].T
    return y + jnp.broadcast_to(layer["b"], y.shape)


def toy_mlp(seed: int = 0) -> ToyMLP:
    sizes = [models.D_IN, models.D_HID, models.D_HID, models.D_OUT]
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return ToyMLP(
        {
            f"l{i}": ToyLinear(
                w=jax.random.normal(key, (n_out, n_in)),
                b=jnp.full((n_out,), 0.1 * i),
            )
            for i, (key, n_in, n_out) in enumerate(zip(keys, sizes, sizes[1:]))
        }
    )


def toy_arrays(model: ToyMLP) -> list:
    """The toy model's arrays in order (its classes are not pytree nodes)."""
    return [array for layer in model.values() for array in layer.values()]


def _toy_to_tree(model: ToyMLP) -> Tree:
    entries, kinds = [], {(): type(model)}
    record = []
    for name, layer in model.items():
        kinds[(name,)] = type(layer)
        record.append((name, type(layer), tuple(layer)))
        for key, array in layer.items():
            entries.append(((name, key), "params", array, len(entries)))
    return build(entries, kinds, "toy", tuple(record))


def _toy_to_native(tree: Tree) -> ToyMLP:
    src, leaves = native_leaves(tree, "toy")
    arrays = iter(leaves)
    return ToyMLP(
        {name: cls({k: next(arrays) for k in keys}) for name, cls, keys in src.record}
    )


def _toy_embed(tree, args, kwargs, keys, inference):
    """A call inside a wrapper: the toy model has no state, mode or randomness."""
    return _toy_to_native(tree)(*args, **kwargs), None, ()


TOY = _registry.Adapter(
    name="toy",
    display="Toy",
    recognise=lambda obj: isinstance(obj, ToyMLP),
    to_tree=_toy_to_tree,
    to_native=_toy_to_native,
    module_types=(ToyMLP, ToyLinear),
    layout="toy",
    embed=_toy_embed,
)

TOY_DENSE = bridge.Codec(
    kind="Dense",
    framework="toy",
    recognise=lambda cls, leaves: cls is ToyLinear,
    decode=lambda leaves, hyper: {"kernel": leaves["w"].T, "bias": leaves["b"]},
    encode=lambda canonical, like, hyper: {
        "w": canonical["kernel"].T,
        "b": canonical["bias"],
    },
    layout="w (out,in)",
)


@pytest.fixture(scope="module")
def toy():
    """The toy adapter and its codec, registered for this module's tests only."""
    _registry.register_adapter(TOY)
    bridge.register_codec(TOY_DENSE)
    yield TOY
    _registry._unregister("toy")


def test_toy_round_trip_is_exact_and_zero_copy(toy):
    model = toy_mlp()
    tree = bridge.to_neutral(model)
    assert framework(tree) == "toy" and tree.l1.w.shape == (models.D_HID,) * 2
    back = bridge.to_native(tree)
    assert type(back) is ToyMLP and type(back["l0"]) is ToyLinear
    assert same_objects(toy_arrays(back), toy_arrays(model))
    x = models.mlp_input()
    assert tree_equal_bits(back(x), model(x))
    with pytest.raises(ValueError, match="this Tree came from a Toy model. Pass"):
        bridge.to_native(tree, rngs=jax.random.key(0))


def test_toy_trains_only_what_the_spec_marks(toy):
    model, x, y = toy_mlp(), models.mlp_input(), jnp.zeros((4, models.D_OUT))
    tree = bridge.to_neutral(model)
    spec = bridge.trainable(tree, r"\.l2\..*")

    def loss_fn(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    # the oracle: plain JAX on the dict, gradient of the last layer only
    last = {k: jnp.array(v) for k, v in model["l2"].items()}  # copies: the step donates

    def oracle(last):
        return loss_fn(ToyMLP({**model, "l2": last}), x, y)

    value, grads = jax.value_and_grad(oracle)(last)
    step = bridge.make_step(loss_fn, optax.sgd(0.1), spec)
    assert isinstance(step, bridge.TrainStep)
    new, _, loss = step(tree, step.init(tree), x, y)
    assert np.allclose(loss, value, rtol=1e-6)
    for k in ("w", "b"):
        assert np.allclose(new.l2[k], last[k] - 0.1 * grads[k], rtol=1e-5, atol=1e-7)
    assert new.l0.w is tree.l0.w and new.l1.b is tree.l1.b  # frozen: the same arrays


def test_toy_ports_to_and_from_nnx(toy):
    x = models.mlp_input()
    source = toy_mlp(seed=3)
    ported = bridge.port(source, models.nnx_mlp())
    assert isinstance(ported, nnx.Module)
    assert bridge.compare(source, ported, x) < 1e-6
    assert np.array_equal(ported.layers[0].kernel[...], source["l0"]["w"].T)
    back = bridge.port(ported, toy_mlp(seed=9))
    assert type(back) is ToyMLP
    assert tree_equal_bits(toy_arrays(back), toy_arrays(source))
    plan = bridge.port_plan(models.nnx_mlp(), toy_mlp())
    assert [r.transform for r in plan.steps] == ["Flax -> w (out,in)"] * 3


def test_toy_saves_and_loads_into_itself_and_into_nnx(toy, tmp_path):
    source = toy_mlp(seed=5)
    path = tmp_path / "toy.safetensors"
    bridge.save(path, source)
    loaded = bridge.load(path, like=toy_mlp(seed=6))
    assert type(loaded) is ToyMLP
    assert tree_equal_bits(toy_arrays(loaded), toy_arrays(source))
    # the file records the toy classes: its layers are read by the toy codecs
    into_nnx = bridge.load(path, like=models.nnx_mlp())
    assert bridge.compare(source, into_nnx, models.mlp_input()) < 1e-6


@pytest.mark.parametrize("wrap", [bridge.as_nnx, bridge.as_linen, bridge.as_equinox])
def test_toy_runs_inside_every_framework(toy, wrap):
    # `embed` in the adapter is all a framework needs to be wrapped
    if wrap is bridge.as_nnx:
        skip_unless("NNX")
    model, x = toy_mlp(seed=4), models.mlp_input()
    wrapper = wrap(model)
    if wrap is bridge.as_linen:
        variables = wrapper.init(jax.random.key(0), x)
        run = lambda v: wrapper.apply(v, x).sum()  # noqa: E731
        out, grads = wrapper.apply(variables, x), jax.grad(run)(variables)["params"]
    elif wrap is bridge.as_nnx:
        out = wrapper(x)
        grads = nnx.grad(lambda m: m(x).sum())(wrapper)
    else:
        out = wrapper(x)
        grads = eqx.filter_grad(lambda m: m(x).sum())(wrapper).model
    assert tree_equal_bits(out, model(x))
    plain = {name: dict(layer) for name, layer in model.items()}
    toy_of = lambda p: ToyMLP({n: ToyLinear(v) for n, v in p.items()})  # noqa: E731
    want = jax.grad(lambda p: toy_of(p)(x).sum())(plain)
    assert tree_equal_bits(jnp.asarray(grads["l1"]["w"]), want["l1"]["w"])


# --- a user codec pair through a checkpoint and through `convert --to-layout` --------


class Scale(nnx.Module):  # y = x * gain, as in docs/guides/codecs.md
    def __init__(self, n):
        self.gain = nnx.Param(jnp.ones(n))

    def __call__(self, x):
        return x * jnp.broadcast_to(self.gain[...], x.shape)


class EqxScale(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return x * self.weight


def _scale_codecs(build: bool) -> None:
    bridge.register_codec(
        bridge.Codec(
            kind="Scale",
            framework="nnx",
            recognise=lambda cls, leaves: cls is Scale,
            decode=lambda leaves, hyper: {"scale": leaves["gain"]},
            encode=lambda canonical, like, hyper: {"gain": canonical["scale"]},
        )
    )
    bridge.register_codec(
        bridge.Codec(
            kind="Scale",
            framework="equinox",
            recognise=lambda cls, leaves: cls is EqxScale,
            decode=lambda leaves, hyper: {"scale": leaves["weight"]},
            encode=lambda canonical, like, hyper: {"weight": canonical["scale"]},
            layout="weight",
            build=(
                lambda canonical, options: EqxScale(
                    jnp.zeros(canonical["scale"].shape, canonical["scale"].dtype)
                )
            )
            if build
            else None,
        )
    )


def _scale(n=3) -> Scale:
    model = Scale(n)
    model.gain[...] = jnp.arange(1.0, n + 1)
    return model


@requires("NNX")
def test_a_user_codec_loads_a_file_into_another_framework(tmp_path):
    _scale_codecs(build=False)
    path = tmp_path / "scale.safetensors"
    bridge.save(path, _scale())
    loaded = bridge.load(path, like=EqxScale(jnp.zeros(3)))
    assert isinstance(loaded, EqxScale)
    assert np.array_equal(loaded.weight, jnp.arange(1.0, 4.0))


@requires("NNX")
def test_a_user_codec_converts_a_file_to_the_equinox_layout(tmp_path, capsys):
    source, target = tmp_path / "scale.safetensors", tmp_path / "eqx.safetensors"
    bridge.save(source, _scale())
    _scale_codecs(build=False)
    argv = ["convert", str(source), str(target), "--to-layout", "equinox"]
    assert main(argv) == 1 and not target.exists()
    err = capsys.readouterr().err
    assert "the Equinox codec of kind 'Scale' has no `build`" in err
    _scale_codecs(build=True)
    assert main(argv) == 0
    loaded = bridge.load(target, like=EqxScale(jnp.zeros(3)))
    assert np.array_equal(loaded.weight, jnp.arange(1.0, 4.0))
    assert bridge.compare(_scale(), loaded, jnp.ones((2, 3))) == 0.0


def test_require_runs_the_adapters_check():
    """`_registry.require` (what `bridge.as_nnx` and the demo call first) runs the
    adapter's `check`: a framework too old for its adapter is an ImportError that
    says so, before any of its models is built."""

    def too_old() -> None:
        raise ImportError("toy 0.1 is installed; the toy adapter needs toy >= 0.2")

    _registry.register_adapter(
        _registry.Adapter(
            name="toy_old",
            display="Toy (old)",
            recognise=lambda obj: False,
            to_tree=lambda obj: obj,
            to_native=lambda tree: tree,
            module_types=(),
            layout="toy_old",
            check=too_old,
        )
    )
    try:
        with pytest.raises(ImportError, match=r"needs toy >= 0\.2"):
            _registry.require("toy_old")
    finally:
        _registry._unregister("toy_old")
    if missing("NNX") is None:  # the installed flax is new enough
        assert _registry.require("nnx").name == "nnx"
    else:
        with pytest.raises(ImportError, match=r"needs flax >= 0\.12\.1"):
            _registry.require("nnx")
