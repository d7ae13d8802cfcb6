"""`bridge convert` to and from the PyTorch layout, without torch: `nn.Sequential`
names (`0.weight`, `2.bias`: numbers at the root), `--rename` with `--to-layout
torch` (a rename undone by its reverse rule), and training checkpoints, which
`--to-layout` refuses unless `--weights-only` leaves their training state out."""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx

import bridge
from bridge._cli import main
from bridge._io._read import open_checkpoint, read
from bridge._io._relayout import relayout

from .helpers import requires, skip_unless


R = np.random.default_rng(0)


def _sequential(gap: bool) -> dict[str, np.ndarray]:
    """`nn.Sequential(Linear(3, 4), ReLU(), Linear(4, 2))`'s state dict (`gap`: the
    ReLU holds no array, so the names are `0.` and `2.`) or, without the gap,
    `nn.Sequential(Linear(3, 4), Linear(4, 2))`'s."""
    f = lambda *s: R.normal(size=s).astype("f4")  # noqa: E731
    last = 2 if gap else 1
    return {
        "0.weight": f(4, 3),
        "0.bias": f(4),
        f"{last}.weight": f(2, 4),
        f"{last}.bias": f(2),
    }


def _file(tmp_path, state, name="seq.safetensors"):
    path = tmp_path / name
    safetensors.numpy.save_file(state, path, metadata={"format": "pt"})
    return path


def _convert(src, dst, layout, *options):
    return main(["convert", str(src), str(dst), "--to-layout", layout, *options])


def _same(path, state):
    back = safetensors.numpy.load_file(path)
    assert back.keys() == state.keys()
    for k in state:
        np.testing.assert_array_equal(back[k], state[k])


@pytest.mark.parametrize("gap", [True, False], ids=["0-2", "0-1"])
@pytest.mark.parametrize("layout", ["equinox", "flax"])
def test_sequential_names_there_and_back(tmp_path, gap, layout):
    """Names that start with a number: to Equinox or Flax and back, the same bits."""
    state = _sequential(gap)
    src = _file(tmp_path, state)
    mid, back = tmp_path / "m.safetensors", tmp_path / "b.safetensors"
    assert _convert(src, mid, layout) == 0
    converted = safetensors.numpy.load_file(mid)
    if layout == "equinox":
        np.testing.assert_array_equal(converted["0.weight"], state["0.weight"])
    else:
        np.testing.assert_array_equal(converted["0.kernel"], state["0.weight"].T)
    assert _convert(mid, back, "torch") == 0
    _same(back, state)


def _eqx_sequential():
    keys = jax.random.split(jax.random.key(1), 2)
    return eqx.nn.Sequential(
        [
            eqx.nn.Linear(3, 4, key=keys[0]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Linear(4, 2, key=keys[1]),
        ]
    )


def test_rename_to_equinox_and_reverse_rule_back(tmp_path):
    """`(\\d+)=layers.\\1` makes the Equinox `Sequential`'s names (the file loads
    into it directly, outputs as PyTorch's); `layers\\.(\\d+)=\\1` undoes it."""
    state = _sequential(gap=True)
    src = _file(tmp_path, state)
    eqx_file, back = tmp_path / "e.safetensors", tmp_path / "b.safetensors"
    assert _convert(src, eqx_file, "equinox", "--rename", r"(\d+)=layers.\1") == 0
    model = bridge.load(eqx_file, like=_eqx_sequential())
    x = R.normal(size=(3,)).astype("f4")
    h = np.maximum(state["0.weight"] @ x + state["0.bias"], 0)
    expected = state["2.weight"] @ h + state["2.bias"]
    np.testing.assert_allclose(model(x), expected, rtol=1e-6, atol=1e-6)
    assert _convert(eqx_file, back, "torch", "--rename", r"layers\.(\d+)=\1") == 0
    _same(back, state)


@requires("NNX")
def test_rename_flax_to_torch(tmp_path):
    """An NNX model whose layers are `layers[0]`, `layers[1]`, as the PyTorch
    `nn.Sequential` of the same layers names them (`0.weight`, `1.weight`)."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)]
            )

    model = Net(nnx.Rngs(0))
    bridge.save(tmp_path / "nnx.safetensors", model)
    dst = tmp_path / "t.safetensors"
    args = ["--rename", r"layers\.(\d+)=\1"]
    assert _convert(tmp_path / "nnx.safetensors", dst, "torch", *args) == 0
    saved = safetensors.numpy.load_file(dst)
    assert sorted(saved) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    np.testing.assert_array_equal(
        saved["1.weight"], np.asarray(model.layers[1].kernel).T
    )
    np.testing.assert_array_equal(saved["0.bias"], model.layers[0].bias[...])


@pytest.mark.parametrize(
    "rules, message",
    [
        (
            [r"layers\.9=x"],
            r"rename 'layers.*9=x': matches no layer. A rename's PATTERN must match "
            r"a layer's whole dotted path \(re.fullmatch\). The layers: layers.0, ",
        ),
        (
            [r"layers\.\d+=x"],
            r"1 problem.*\n.*\['layers.0', 'layers.2'\] would all be called 'x'$",
        ),
        (["layers.0"], r"rename 'layers.0': expected PATTERN=PATH"),
    ],
)
def test_rename_to_torch_errors(tmp_path, rules, message):
    src = _file(tmp_path, _sequential(gap=True))
    eqx_file = tmp_path / "e.safetensors"
    assert _convert(src, eqx_file, "equinox", "--rename", r"(\d+)=layers.\1") == 0
    contents = open_checkpoint(eqx_file)
    with pytest.raises(ValueError, match=message):
        relayout(contents, read(contents), "torch", rename=rules)


def test_batch_norm_mode_not_for_torch(tmp_path):
    src = _file(tmp_path, _sequential(gap=True))
    eqx_file = tmp_path / "e.safetensors"
    assert _convert(src, eqx_file, "equinox") == 0
    contents = open_checkpoint(eqx_file)
    with pytest.raises(ValueError, match="--batch-norm-mode only apply when"):
        relayout(contents, read(contents), "torch", batch_norm_mode="ema")


@requires("NNX")
def test_root_layer_names(tmp_path):
    """A model that is one layer: its arrays are `weight` and `bias`."""
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    bridge.save_state_dict(tmp_path / "t.safetensors", model)
    saved = safetensors.numpy.load_file(tmp_path / "t.safetensors")
    assert sorted(saved) == ["bias", "weight"]
    np.testing.assert_array_equal(saved["weight"], np.asarray(model.kernel).T)


@pytest.fixture
def training_file(tmp_path):
    """An NNX model saved with its Adam state after one update (moments not 0)."""
    skip_unless("NNX")  # nnx.Optimizer.update(model, grads)
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    grads = nnx.grad(lambda m: (m(np.ones((1, 2), "f4")) ** 2).sum())(model)
    optimizer.update(model, grads)
    path = tmp_path / "run.safetensors"
    bridge.save_training(path, model, optimizer)
    return path, model


@pytest.mark.parametrize("layout", ["equinox", "torch"])
def test_training_checkpoint_refused(training_file, layout, capsys):
    """--to-layout on a training checkpoint: an error saying what to do instead
    (load it with `opt_state_like`, or --weights-only); nothing written."""
    path, _ = training_file
    dst = path.with_name("out.safetensors")
    src = open_checkpoint(path)
    with pytest.raises(
        ValueError, match=r"(?s)is a training checkpoint \(step: 1.*--weights-only"
    ):
        relayout(src, read(src), layout)
    assert _convert(path, dst, layout) == 1
    assert "opt_state_like" in capsys.readouterr().err
    assert not dst.exists()


@pytest.mark.parametrize("layout", ["equinox", "torch", None])
def test_training_checkpoint_weights_only(training_file, layout, capsys):
    """--weights-only: the weights converted (or kept, without --to-layout), the
    training state left out, which the command says."""
    path, model = training_file
    dst = path.with_name("out.safetensors")
    to = ["--to-layout", layout] if layout else []
    assert main(["convert", str(path), str(dst), *to, "--weights-only"]) == 0
    assert "left out the training state: 5 arrays" in capsys.readouterr().out
    saved = safetensors.numpy.load_file(dst)
    if layout is None:  # Flax's layout, as saved
        assert sorted(saved) == ["bias", "kernel"]
        np.testing.assert_array_equal(saved["kernel"], model.kernel[...])
    else:
        assert sorted(saved) == ["bias", "weight"]
        np.testing.assert_array_equal(saved["weight"], np.asarray(model.kernel).T)
    assert not open_checkpoint(dst).training


@requires("NNX")
def test_loose_arrays_under_their_names(tmp_path):
    """Arrays a module holds next to its layers (ViT's `cls_token`) are written
    under their own names, and read back."""

    class Embeddings(nnx.Module):
        def __init__(self, rngs):
            self.cls_token = nnx.Param(jax.random.normal(rngs.params(), (1, 1, 4)))
            self.projection = nnx.Linear(3, 4, rngs=rngs)

    model = Embeddings(nnx.Rngs(0))
    bridge.save_state_dict(tmp_path / "t.safetensors", model)
    saved = safetensors.numpy.load_file(tmp_path / "t.safetensors")
    assert sorted(saved) == ["cls_token", "projection.bias", "projection.weight"]
    np.testing.assert_array_equal(saved["cls_token"], model.cls_token[...])
    again = bridge.load(tmp_path / "t.safetensors", like=Embeddings(nnx.Rngs(1)))
    np.testing.assert_array_equal(again.cls_token[...], model.cls_token[...])
    np.testing.assert_array_equal(
        again.projection.kernel[...], model.projection.kernel[...]
    )
