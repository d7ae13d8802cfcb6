"""`bridge convert --to-layout equinox|flax`: Flax checkpoints (Linen, NNX) to the
Equinox layout without the model, and back. The oracle is the Equinox model of the
same architecture in `tests/models.py`: the converted file must hold exactly the
arrays `bridge.save` writes for it (so `bridge.load` fills it directly, no port) and
give the source's outputs."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge
from bridge._cli import main
from bridge._io import _checkpoint
from bridge._io._read import open_checkpoint, read
from bridge._io._relayout import relayout

from . import models
from .helpers import child_reads_orbax, requires
from .test_cli import run


# Linen auto-names -> the Equinox models' field names
LINEN_RULES = {
    "mlp": [r"Dense_(\d+)=layers.\1"],
    "cnn": ["Conv_0=conv", "BatchNorm_0=bn", "Dense_0=head"],
    "block": [
        "Embed_0=embed",
        "LayerNorm_0=norm1",
        "LayerNorm_1=norm2",
        "MultiHeadDotProductAttention_0=attn",
        "Dense_0=dense",
    ],
}

ARCHITECTURES = {
    "mlp": (models.linen_mlp, models.nnx_mlp, models.equinox_mlp, models.mlp_input),
    "cnn": (models.linen_cnn, models.nnx_cnn, models.equinox_cnn, models.cnn_input),
    "block": (
        models.linen_block,
        models.nnx_block,
        models.equinox_block,
        models.tokens,
    ),
}


def _random_stats(variables):
    """Linen variables with non-trivial BatchNorm statistics (init gives 0 and 1)."""
    stats = variables["batch_stats"]["BatchNorm_0"]
    mean = jax.random.normal(jax.random.key(7), stats["mean"].shape)
    var = jax.random.uniform(jax.random.key(8), stats["var"].shape, minval=0.5)
    return {**variables, "batch_stats": {"BatchNorm_0": {"mean": mean, "var": var}}}


def _source(framework, architecture):
    linen, nnx_, _, _ = ARCHITECTURES[architecture]
    if framework == "linen":
        module, variables = linen()
        if architecture == "cnn":
            variables = _random_stats(variables)
        return (module, variables), variables
    model = nnx_()
    if architecture == "cnn":
        model.bn.mean[...] = jax.random.normal(jax.random.key(7), (4,))
        model.bn.var[...] = jax.random.uniform(jax.random.key(8), (4,), minval=0.5)
    return model, model


def _described(path):
    """What a file holds: (key, role, shape, dtype) of each array, in order."""
    return [(s.key, s.role, s.shape, s.dtype) for s in open_checkpoint(path).tensors]


def _no_port(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("bridge.load went through bridge.port")

    monkeypatch.setattr(_checkpoint, "port_and_plan", refuse)


# the Equinox CNN has a BatchNorm(mode=...)
_BATCH_NORM = requires("eqx.nn.BatchNorm(mode=...)")


@pytest.mark.parametrize(
    "architecture",
    [pytest.param(a, marks=_BATCH_NORM if a == "cnn" else ()) for a in ARCHITECTURES],
)
@pytest.mark.parametrize(
    "framework", ["linen", pytest.param("nnx", marks=requires("NNX"))]
)
def test_flax_to_equinox_loads_directly(framework, architecture, tmp_path, monkeypatch):
    source, saved = _source(framework, architecture)
    _, _, equinox, inputs = ARCHITECTURES[architecture]
    names = ("src.safetensors", "e.safetensors", "ref.safetensors")
    src, dst, ref = (tmp_path / n for n in names)
    bridge.save(src, saved)
    rules = LINEN_RULES[architecture] if framework == "linen" else []
    argv = ["convert", str(src), str(dst), "--to-layout", "equinox"]
    assert main(argv + [f"--rename={rule}" for rule in rules]) == 0
    like = equinox(1)
    bridge.save(ref, like)
    assert _described(dst) == _described(ref)  # the same keys, roles, shapes, dtypes
    contents = open_checkpoint(dst)
    assert (contents.framework, contents.layout) == ("equinox", "equinox")
    classes = {path: cls for path, cls, _ in contents.modules}
    reference = {path: cls for path, cls, _ in open_checkpoint(ref).modules}
    assert classes and classes.items() <= reference.items()  # each layer's class
    _no_port(monkeypatch)
    loaded = bridge.load(dst, like=like)
    assert bridge.compare(source, loaded, inputs()) <= 1e-5


@requires("eqx.nn.BatchNorm(mode=...)")
@child_reads_orbax
def test_subprocess_nnx_cnn_from_orbax_batch_norm_ema(tmp_path, monkeypatch):
    source, saved = _source("nnx", "cnn")
    bridge.save(tmp_path / "src", saved)  # an orbax directory
    dst = tmp_path / "e.safetensors"
    done = run(
        "convert", tmp_path / "src", dst, "--to-layout", "equinox",
        "--batch-norm-mode", "ema",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "9 arrays" in done.stdout
    like = models.equinox_cnn(1, mode="ema")
    bridge.save(tmp_path / "ref.safetensors", like)
    assert _described(dst) == _described(tmp_path / "ref.safetensors")
    assert "bn.ema_state_index.0" in [key for key, *_ in _described(dst)]
    _no_port(monkeypatch)
    loaded = bridge.load(dst, like=like)
    assert not loaded[1].get(loaded[0].bn.ema_first_time_index)  # stats kept next step
    assert bridge.compare(source, loaded, models.cnn_input()) <= 1e-5


@requires("eqx.nn.BatchNorm(mode=...)")
def test_linen_msgpack_to_equinox(tmp_path):
    (module, variables), _ = _source("linen", "cnn")
    bridge.save(tmp_path / "src.msgpack", variables)
    dst = tmp_path / "e.safetensors"
    argv = ["convert", str(tmp_path / "src.msgpack"), str(dst), "--to-layout"]
    rules = [f"--rename={rule}" for rule in LINEN_RULES["cnn"]]
    assert main([*argv, "equinox", *rules]) == 0
    loaded = bridge.load(dst, like=models.equinox_cnn(1))
    assert bridge.compare((module, variables), loaded, models.cnn_input()) <= 1e-5


def _arrays(path):
    contents = open_checkpoint(path)
    return {k: np.asarray(v) for k, v in read(contents).items()}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_round_trip_equinox_flax_equinox_same_bits(architecture, tmp_path):
    model = ARCHITECTURES[architecture][2](0)
    names = ("eqx.safetensors", "flax.safetensors", "back.safetensors")
    first, flax_file, back = (tmp_path / n for n in names)
    bridge.save(first, model)
    assert main(["convert", str(first), str(flax_file), "--to-layout", "flax"]) == 0
    assert main(["convert", str(flax_file), str(back), "--to-layout", "equinox"]) == 0
    assert _described(back) == _described(first)
    before, after = _arrays(first), _arrays(back)
    if architecture == "cnn":
        # a fresh Equinox BatchNorm counts 0 steps; the Flax layout has no counter, and
        # its statistics come back settled (2**30): the same inference, the same bits
        # for every other array, and a second round trip changes nothing at all
        assert before.pop("bn.batch_counter") == 0
        assert after.pop("bn.batch_counter") == 2**30
        again = tmp_path / "again.safetensors"
        again_flax = [str(back), str(flax_file), "--to-layout", "flax", "--overwrite"]
        assert main(["convert", *again_flax]) == 0
        assert (
            main(["convert", str(flax_file), str(again), "--to-layout", "equinox"]) == 0
        )
        assert _arrays(again).keys() == _arrays(back).keys()
        for key, value in _arrays(again).items():
            assert value.tobytes() == _arrays(back)[key].tobytes(), key
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype, key
        assert before[key].tobytes() == after[key].tobytes(), key


# --- errors --------------------------------------------------------------------------


class Gain(nnx.Module):
    def __init__(self):
        self.gain = nnx.Param(jnp.ones(3))
        self.shift = nnx.Param(jnp.zeros(3))


class Odd(nnx.Module):
    def __init__(self, rngs):
        self.first = Gain()
        self.dense = nnx.Linear(3, 3, rngs=rngs)
        self.second = Gain()
        self.general = nnx.LinearGeneral(3, (2, 4), rngs=rngs)


@requires("NNX")
def test_unrecognised_layers_one_line_each(tmp_path, capsys):
    src, dst = tmp_path / "odd.safetensors", tmp_path / "e.safetensors"
    bridge.save(src, Odd(nnx.Rngs(0)))
    assert main(["convert", str(src), str(dst), "--to-layout", "equinox"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("bridge convert: error:")
    assert err.count("\n") == 4  # the header and one line per problem
    assert ".first (Gain) holds ['gain', 'shift']" in err
    assert ".second (Gain) holds ['gain', 'shift']" in err
    assert ".general (DenseGeneral) has no Equinox counterpart" in err
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["odd.safetensors"]


# slow (another process): test_unrecognised_layers_one_line_naming_each runs the same
# refusal through `main` by default.
@pytest.mark.slow
@requires("NNX")
def test_unrecognised_layers_subprocess(tmp_path):
    src, dst = tmp_path / "odd.safetensors", tmp_path / "e.safetensors"
    bridge.save(src, Odd(nnx.Rngs(0)))
    done = run("convert", src, dst, "--to-layout", "equinox")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    # the class is not imported in that process: the paths are named all the same
    assert ".first (Linen module) holds ['gain', 'shift']" in done.stderr
    assert ".second (Linen module) holds ['gain', 'shift']" in done.stderr
    assert not dst.exists()


def _convert_error(tmp_path, variables, *options):
    src = tmp_path / "src.safetensors"
    bridge.save(src, variables)
    contents = open_checkpoint(src)
    return lambda: relayout(contents, read(contents), "equinox", **dict(options))


@pytest.mark.parametrize(
    "rules, message",
    [
        (
            ["Conv_9=conv"],
            r"rename 'Conv_9=conv': matches no layer. A rename's PATTERN must "
            r"match a layer's whole dotted path \(re.fullmatch\). The layers: Conv_0",
        ),
        ([r"(Conv|Dense)_0=x"], r"\['Conv_0', 'Dense_0'\] would all be called 'x'"),
        (["Conv_0"], r"rename 'Conv_0': expected PATTERN=PATH"),
        (["Conv_(0=conv"], r"rename 'Conv_\(0=conv': PATTERN is not a regex"),
        (
            [r"Conv_0=conv\1"],
            r"rename 'Conv_0=conv.*': bad PATH: invalid group reference 1",
        ),
    ],
)
def test_rename_errors(tmp_path, rules, message):
    _, variables = models.linen_cnn()
    with pytest.raises(ValueError, match=message):
        _convert_error(tmp_path, variables, ("rename", rules))()


@pytest.mark.parametrize(
    "option, flag",
    [(("rename", ["Conv_0=conv"]), "--rename"), (("batch_norm_mode", "ema"), "mode")],
)
def test_equinox_options_elsewhere(tmp_path, option, flag):
    bridge.save(tmp_path / "eqx.safetensors", models.equinox_mlp())
    contents = open_checkpoint(tmp_path / "eqx.safetensors")
    for layout in ("flax", "equinox"):
        with pytest.raises(ValueError, match=rf"{flag} only apply when converting a"):
            relayout(contents, read(contents), layout, **dict([option]))


def test_unknown_batch_norm_mode(tmp_path):
    _, variables = models.linen_cnn()
    with pytest.raises(ValueError, match=r"Unknown BatchNorm mode 'legacy'"):
        _convert_error(tmp_path, variables, ("batch_norm_mode", "legacy"))()


@requires("NNX")
def test_error_writes_nothing_over_an_existing_file(tmp_path, capsys):
    src, dst = tmp_path / "odd.safetensors", tmp_path / "e.safetensors"
    bridge.save(src, Odd(nnx.Rngs(0)))
    bridge.save(dst, models.equinox_mlp())
    before = dst.read_bytes()
    assert main(["convert", str(src), str(dst), "--to-layout", "equinox"]) == 1
    assert dst.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["e.safetensors", "odd.safetensors"]


@requires("NNX")
def test_dtypes_and_root_layer_kept(tmp_path, monkeypatch):
    source = nnx.Linear(3, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    bridge.save(tmp_path / "src.safetensors", source)
    dst = tmp_path / "e.safetensors"
    argv = ["convert", str(tmp_path / "src.safetensors"), str(dst)]
    assert main([*argv, "--to-layout", "equinox"]) == 0
    assert _described(dst) == [
        ("weight", "params", (2, 3), "bfloat16"),
        ("bias", "params", (2,), "bfloat16"),
    ]
    like = eqx.nn.Linear(3, 2, dtype=jnp.bfloat16, key=jax.random.key(1))
    _no_port(monkeypatch)
    loaded = bridge.load(dst, like=like)
    assert (loaded.weight == source.kernel[...].T).all()


def test_linen_to_equinox_to_flax_ports_back(tmp_path):
    """The converted file records each Equinox layer's class and settings: it converts
    back to the Flax layout and ports into the Linen model."""
    (module, variables), _ = _source("linen", "block")
    bridge.save(tmp_path / "src.safetensors", variables)
    eqx_file, flax_file = tmp_path / "e.safetensors", tmp_path / "f.safetensors"
    argv = ["convert", str(tmp_path / "src.safetensors"), str(eqx_file)]
    assert main([*argv, "--to-layout", "equinox"]) == 0
    assert main(["convert", str(eqx_file), str(flax_file), "--to-layout", "flax"]) == 0
    back = bridge.load(flax_file, like=models.linen_block(1))
    assert bridge.compare((module, variables), back, models.tokens()) <= 1e-5


def test_trained_equinox_batch_norm_round_trip(tmp_path):
    """A trained Equinox BatchNorm (counter > 0) holds debiased statistics: through the
    Flax layout and back it gives the same outputs."""
    model, state = models.equinox_cnn(0)
    x = jnp.moveaxis(models.cnn_input(), -1, 1)

    def train(x, state):
        return model.bn(model.conv(x), state)[1]

    state = jax.vmap(train, in_axes=(0, None), out_axes=None, axis_name="batch")(
        x, state
    )
    bridge.save(tmp_path / "eqx.safetensors", (model, state))
    flax_file, back = tmp_path / "f.safetensors", tmp_path / "back.safetensors"
    argv = ["convert", str(tmp_path / "eqx.safetensors"), str(flax_file)]
    assert main([*argv, "--to-layout", "flax"]) == 0
    assert main(["convert", str(flax_file), str(back), "--to-layout", "equinox"]) == 0
    loaded = bridge.load(back, like=models.equinox_cnn(1))
    assert loaded[1].get(loaded[0].bn.batch_counter) == 2**30
    assert bridge.compare((model, state), loaded, models.cnn_input()) <= 1e-5


def _torch_file(path):
    """A PyTorch-layout `nn.Linear(4, 4)`, `nn.Linear(4, 2)` state dict, as numpy."""
    import safetensors.numpy

    rng = np.random.default_rng(0)
    state = {
        "a.weight": rng.normal(size=(4, 4)).astype("float32"),
        "a.bias": rng.normal(size=4).astype("float32"),
        "b.weight": rng.normal(size=(2, 4)).astype("float32"),
        "b.bias": rng.normal(size=2).astype("float32"),
    }
    safetensors.numpy.save_file(state, path, metadata={"format": "pt"})


class _TwoLinears(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 4, rngs=rngs)
        self.b = nnx.Linear(4, 2, rngs=rngs)


@requires("NNX")
def test_msgpack_of_the_torch_layout_is_refused(tmp_path, capsys):
    """A msgpack file holds Flax variables and keeps no metadata: a PyTorch-layout
    checkpoint written to one read back as variables of unknown layout, which
    `bridge.load(like=...)` paired with no layer and no --to-layout converted.
    Refused, nothing written (as `bridge.save_state_dict` refuses it);
    with --to-layout flax it is written and loads as its source does."""
    src = tmp_path / "src.safetensors"
    _torch_file(src)
    dst = tmp_path / "out.msgpack"
    for extra in ([], ["--to-layout", "torch"]):
        assert main(["convert", str(src), str(dst), *extra]) == 1
        err = capsys.readouterr().err
        assert not dst.exists()
        assert "PyTorch layout" in err and "--to-layout flax" in err
        assert "out.safetensors" in err  # the other fix: a format keeping the layout
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert main(["convert", str(src), str(dst), "--to-layout", "flax"]) == 0
    expected = bridge.load(src, like=_TwoLinears(nnx.Rngs(1)))
    loaded = bridge.load(dst, like=_TwoLinears(nnx.Rngs(1)))
    for layer in ("a", "b"):
        for leaf in ("kernel", "bias"):
            np.testing.assert_array_equal(
                getattr(getattr(loaded, layer), leaf)[...],
                getattr(getattr(expected, layer), leaf)[...],
            )


def test_msgpack_of_the_equinox_layout_still_loads_into_equinox(tmp_path):
    """An Equinox checkpoint in a msgpack file loads back into its model by names,
    as `bridge.save(path.msgpack, equinox_model)` does: not refused."""
    src, dst = tmp_path / "src.safetensors", tmp_path / "out.msgpack"
    model = models.equinox_mlp(0)
    bridge.save(src, model)
    assert main(["convert", str(src), str(dst)]) == 0
    loaded = bridge.load(dst, like=models.equinox_mlp(1))
    assert bridge.compare(model, loaded, models.mlp_input()) == 0
