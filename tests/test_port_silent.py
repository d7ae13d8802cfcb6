"""Ports that used to be silently wrong (issue 37): each is now exact where the
computation or the model's family tells, and refused where nothing does."""

import json
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import bridge

from .helpers import requires


def _torch_conv1d(x, weight, bias):
    """PyTorch's `Conv1d` on channel-last `x` `(batch, length, in)`: `weight` `(out,
    in, k)` cross-correlated, padding 1."""
    out = jax.lax.conv_general_dilated(
        jnp.asarray(x),
        jnp.asarray(weight),
        (1,),
        ((1, 1),),
        dimension_numbers=("NWC", "OIW", "NWC"),
    )
    return np.asarray(out) + bias


class _Conv(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Conv(4, (3,), padding=1, name="conv")(x)


def test_square_conv_from_a_file_is_told_by_the_trace(tmp_path):
    """A square `Conv1d(4, 4, 3)` in a file (Whisper's `conv2`) into a Linen `Conv`
    named `conv`: the shapes fit a `ConvTranspose` too (it was flipped, no error).
    Without example inputs: refused; with them, the target's forward pass calls an
    `nn.Conv` and the port is exact."""
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(4, 4, 3)).astype(np.float32)
    bias = rng.normal(size=(4,)).astype(np.float32)
    path = tmp_path / "conv.safetensors"
    safetensors.numpy.save_file({"conv.weight": weight, "conv.bias": bias}, path)
    x = rng.normal(size=(2, 5, 4)).astype(np.float32)
    module = _Conv()
    variables = module.init(jax.random.key(0), x)
    with pytest.raises(bridge.PortError, match=r"ConvTranspose and a Conv alike"):
        bridge.load(path, like=(module, variables))
    _, loaded = bridge.load(path, like=(module, variables), example=(x,))
    np.testing.assert_allclose(
        module.apply(loaded, x), _torch_conv1d(x, weight, bias), atol=1e-5
    )


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.c_fc = nnx.Linear(8, 8, rngs=rngs)
        self.c_proj = nnx.Linear(8, 8, rngs=rngs)


_MLP_RULES = {r"\.mlp\.c_fc": ".c_fc", r"\.mlp\.c_proj": ".c_proj"}


def _folder(tmp_path, model_type):
    """A Hugging Face-style folder with a square `mlp.c_fc` and `mlp.c_proj`, and a
    `config.json` naming `model_type` (None: no config)."""
    rng = np.random.default_rng(1)
    folder = tmp_path / str(model_type)
    folder.mkdir()
    tensors = {
        f"mlp.{n}.{e}": rng.normal(size=(8, 8) if e == "weight" else (8,)).astype(
            np.float32
        )
        for n in ("c_fc", "c_proj")
        for e in ("weight", "bias")
    }
    safetensors.numpy.save_file(tensors, folder / "model.safetensors", {"format": "pt"})
    if model_type is not None:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder, tensors


@requires("NNX")
@pytest.mark.parametrize("model_type", ["gpt_neo", "gpt2", None])
def test_square_gpt2_names_follow_the_family(tmp_path, model_type):
    """GPT-Neo keeps GPT-2's `c_fc`/`c_proj` names on `nn.Linear`s (weight `(out,
    in)`); GPT-2's are `Conv1D`s (`(in, out)`). A square one was read as GPT-2's
    whatever the model: now the folder's `config.json` decides, and without one a
    square weight is refused."""
    folder, tensors = _folder(tmp_path, model_type)
    target = _MLP(nnx.Rngs(0))
    if model_type is None:
        with pytest.raises(
            bridge.PortError, match=r"(?s)mlp\.c_fc holds a square weight"
        ):
            bridge.load(folder / "model.safetensors", like=target, rules=_MLP_RULES)
        return
    loaded = bridge.load(folder / "model.safetensors", like=target, rules=_MLP_RULES)
    weight = tensors["mlp.c_fc.weight"]
    expected = weight if model_type == "gpt2" else weight.T
    np.testing.assert_array_equal(loaded.c_fc.kernel[...], expected)


@requires("NNX")
@pytest.mark.parametrize("model_type", ["gpt_neo", "gpt2", None])
def test_square_gpt2_names_written_by_the_family(tmp_path, model_type):
    """Writing the PyTorch layout: a square `c_fc` kernel is written `(out, in)` into
    a GPT-Neo folder, `(in, out)` into a GPT-2 one, and refused with no config."""
    folder = tmp_path / "out"
    folder.mkdir()
    if model_type is not None:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    model = _MLP(nnx.Rngs(0))
    path = folder / "model.safetensors"
    if model_type is None:
        with pytest.raises(ValueError, match=r"(?s)\.c_fc -> c_fc: .*square weight"):
            bridge.save_state_dict(path, model)
        assert not path.exists()
        return
    bridge.save_state_dict(path, model)
    written = safetensors.numpy.load_file(path)["c_fc.weight"]
    kernel = np.asarray(model.c_fc.kernel[...])
    np.testing.assert_array_equal(written, kernel if model_type == "gpt2" else kernel.T)


class _Heads(nnx.Module):
    def __init__(self, first, second, rngs):
        self.body = nnx.Linear(4, 4, rngs=rngs)
        setattr(self, first, nnx.Linear(4, 2, rngs=rngs))
        setattr(self, second, nnx.Linear(4, 3, rngs=rngs))


@requires("NNX")
def test_positional_pairs_in_one_framework_warn():
    """Two NNX models whose heads have unrelated names (`sentiment_head` ->
    `topic_head`) were paired by their shapes without a word: a `PortWarning` now
    names each such pair; rules naming them silence it."""
    source = _Heads("sentiment_head", "extra", nnx.Rngs(0))
    target = _Heads("topic_head", "other", nnx.Rngs(1))
    with pytest.warns(bridge.PortWarning, match=r"sentiment_head -> \.topic_head"):
        bridge.port(source, target, strict=True)
    rules = {r"\.sentiment_head": ".topic_head", r"\.extra": ".other"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ported = bridge.port(source, target, rules=rules)
    np.testing.assert_array_equal(
        ported.topic_head.kernel[...], source.sentiment_head.kernel[...]
    )


class _UsedHeads(_Heads):
    def __init__(self, first, second, rngs):
        super().__init__(first, second, rngs)
        self.heads = (first, second)

    def __call__(self, x):
        h = self.body(x)
        return sum(getattr(self, n)(h).sum() for n in self.heads)


@requires("NNX")
def test_positional_pairs_confirmed_by_both_traces():
    """Given example inputs, the only layers of their kind and shapes that both
    forward passes use are paired by the traces (their order checked against the
    passes), with no warning; from a file (no forward pass) the warning says the
    source has none instead of asking again for the inputs that were given."""
    source = _UsedHeads("sentiment_head", "extra", nnx.Rngs(0))
    target = _UsedHeads("topic_head", "other", nnx.Rngs(1))
    x = jnp.ones((2, 4))
    plan = bridge.port_plan(source, target, example=(x,))
    assert [s.by for s in plan.steps if s.renamed] == ["trace", "trace"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ported = bridge.port(source, target, example=(x,))
    assert float(source(x)) == float(ported(x))
    part = bridge.from_nnx(nnx.List([source]))[0]  # a part: nothing to run
    assert float(bridge.port(part, target, example=(x,))(x)) == float(source(x))


class _LinenHeads(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="body")(x)
        return nn.Dense(2, name="topic_head")(h).sum() + nn.Dense(3, name="other")(h)


def test_positional_warning_names_the_untraced_side():
    """Example inputs given, but the source is Linen variables alone (no module to
    run): the warning says the source has no forward pass instead of asking again
    for the inputs that were given."""
    x = jnp.ones((2, 4))
    variables = _LinenHeads().init(jax.random.key(0), x)
    params = dict(variables["params"])
    params["sentiment_head"] = params.pop("topic_head")
    with pytest.warns(bridge.PortWarning) as said:
        bridge.port({"params": params}, (_LinenHeads(), variables), example=(x,))
    text = str(said[0].message)
    assert "sentiment_head -> .topic_head" in text
    assert "source has no forward pass" in text and "give example" not in text


class _Twins(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="left")(x) + nn.Dense(4, name="right")(x)


def test_ambiguous_offers_no_guessed_rules(tmp_path):
    """Two alike layers a file cannot order: the refusal proposes no concrete pairs
    (they were a guess by name order, which loaded a ConvNeXt wrong), and once
    example inputs were given it says which side has no forward pass instead of
    asking for them again."""
    rng = np.random.default_rng(2)
    path = tmp_path / "twins.safetensors"
    safetensors.numpy.save_file(
        {
            f"{n}.{e}": rng.normal(size=(4, 4) if e == "weight" else (4,)).astype(
                np.float32
            )
            for n in ("a", "b")
            for e in ("weight", "bias")
        },
        path,
    )
    x = np.ones((1, 4), np.float32)
    module = _Twins()
    variables = module.init(jax.random.key(0), x)
    with pytest.raises(bridge.PortError) as refused:
        bridge.load(path, like=(module, variables))
    message = str(refused.value)
    assert "Give example inputs" in message
    assert ": '.left'" not in message and ": '.right'" not in message
    with pytest.raises(bridge.PortError) as refused:
        bridge.load(path, like=(module, variables), example=(x,))
    message = str(refused.value)
    assert "Give example inputs" not in message
    assert "the source has no forward pass to trace" in message


class _GatedSource(nnx.Module):
    """A gated MLP: `down(silu(gate(x)) * up(x))`, the gate computed first."""

    def __init__(self, rngs):
        self.gate = nnx.Linear(4, 8, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(4, 8, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(8, 4, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class _GatedTarget(nnx.Module):
    """The same computation, other names, the linear branch computed first."""

    def __init__(self, rngs):
        self.fc_out = nnx.Linear(8, 4, use_bias=False, rngs=rngs)
        self.fc_lin = nnx.Linear(4, 8, use_bias=False, rngs=rngs)
        self.fc_act = nnx.Linear(4, 8, use_bias=False, rngs=rngs)

    def __call__(self, x):
        lin = self.fc_lin(x)
        return self.fc_out(jax.nn.silu(self.fc_act(x)) * lin)


@requires("NNX")
def test_side_by_side_branches_used_in_another_order():
    """Exact or refused, never silently wrong: gate/up of a gated MLP into a
    rewrite that names them otherwise and computes the linear branch first."""
    source, target = _GatedSource(nnx.Rngs(0)), _GatedTarget(nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (2, 4))
    try:
        ported = bridge.port(source, target, example=(x,))
    except bridge.PortError:
        return
    np.testing.assert_allclose(ported(x), source(x), atol=1e-6)
