"""Custom layers: `Codec.same_layout`, `unregister_codec`, and the CLI refusing a
recorded class no codec knows (a Gemma `x * (1 + scale)` norm, an `nnx.Einsum`)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import bridge
from bridge._cli import main
from bridge._io._read import open_checkpoint, read
from bridge._io._relayout import relayout

from .helpers import requires


D = 4


def _last(v, x):
    """`v` of shape `(D,)` broadcast against `x` of shape `(..., D)`."""
    return jnp.reshape(v, (1,) * (x.ndim - 1) + v.shape)


class GemmaNorm(nnx.Module):
    """Gemma's RMSNorm: `x * (1 + scale)`, `scale` starts at 0 (not Flax's RMSNorm)."""

    def __init__(self, n):
        self.scale = nnx.Param(jnp.zeros(n))

    def __call__(self, x):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return x * _last(1 + self.scale[...], x)


class EqxGemmaNorm(eqx.Module):
    scale: jax.Array

    def __call__(self, x):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return x * (1 + self.scale)


class Shifted(nnx.Module):
    """Two arrays of its own next to a sublayer: one layer with `same_layout`."""

    def __init__(self, rngs):
        self.gain = nnx.Param(jax.random.normal(rngs.params(), (D,)))
        self.shift = nnx.Param(jax.random.normal(rngs.params(), (D,)))
        self.norm = GemmaNorm(D)
        self.norm.scale[...] = jax.random.normal(rngs.params(), (D,))

    def __call__(self, x):
        return self.norm(x) * _last(self.gain[...], x) + _last(self.shift[...], x)


class EqxShifted(eqx.Module):
    shift: jax.Array
    gain: jax.Array
    norm: EqxGemmaNorm

    def __call__(self, x):
        return self.norm(x) * self.gain + self.shift


@pytest.fixture
def same_layout_codecs():
    codecs = bridge.register_codec(
        *bridge.Codec.same_layout("GemmaNorm", [GemmaNorm, EqxGemmaNorm]),
        *bridge.Codec.same_layout("Shifted", [Shifted, EqxShifted]),
    )
    yield codecs
    bridge.unregister_codec("GemmaNorm")
    bridge.unregister_codec("Shifted")


@requires("NNX")
def test_same_layout_claims_own_arrays_and_leaves_sublayers(same_layout_codecs):
    assert [c.framework for c in same_layout_codecs] == ["nnx", "equinox"] * 2
    source = Shifted(nnx.Rngs(0))
    target = EqxShifted(jnp.zeros(D), jnp.zeros(D), EqxGemmaNorm(jnp.zeros(D)))
    plan = bridge.port_plan(source, target)
    assert [(s.source, s.kind, s.shapes) for s in plan.steps] == [
        ("(root)", "Shifted", "gain (4,), shift (4,)"),
        (".norm", "GemmaNorm", "scale (4,)"),
    ]
    x = jax.random.normal(jax.random.key(1), (2, D))
    ported = bridge.port(source, target, check=x)
    assert bridge.compare(source, ported, x) == 0
    # unregistered: the same arrays are loose, one row each, paired by name
    bridge.unregister_codec("Shifted")
    plan = bridge.port_plan(source, target)
    assert [s.kind for s in plan.steps] == ["Array", "Array", "GemmaNorm"]
    bridge.register_codec(*same_layout_codecs[2:])


@requires("NNX")
def test_unregister_and_same_layout_errors():
    with pytest.raises(KeyError, match=r"No codec of kind 'Nope' is registered"):
        bridge.unregister_codec("Nope")
    with pytest.raises(KeyError, match=r"kind 'Dense' for 'nope'"):
        bridge.unregister_codec("Dense", "nope")
    with pytest.raises(TypeError, match=r"not an nnx.Module or eqx.Module class"):
        bridge.Codec.same_layout("X", [int])
    removed = bridge.unregister_codec("Embed", "equinox")
    assert [c.framework for c in removed] == ["equinox"]
    try:
        source = nnx.Embed(5, 3, rngs=nnx.Rngs(0))
        with pytest.raises(bridge.PortError, match=r"missing: target layer"):
            bridge.port(source, eqx.nn.Embedding(5, 3, key=jax.random.key(0)))
    finally:
        bridge.register_codec(*removed)
    bridge.port(source, eqx.nn.Embedding(5, 3, key=jax.random.key(0)))


class GemmaBlock(nnx.Module):
    def __init__(self, rngs):
        self.pre_norm = GemmaNorm(D)
        self.proj = nnx.Einsum("td,dhk->thk", (D, 2, 2), rngs=rngs)
        self.out = nnx.Linear(D, D, rngs=rngs)


@requires("NNX")
def test_cli_refuses_recorded_classes_no_codec_knows(tmp_path, capsys):
    src, dst = tmp_path / "gemma.safetensors", tmp_path / "out.safetensors"
    bridge.save(src, GemmaBlock(nnx.Rngs(0)))
    assert main(["convert", str(src), str(dst), "--to-layout", "equinox"]) == 1
    err = capsys.readouterr().err
    # its __call__ computes x * (1 + scale): a Gemma norm, with no Equinox layer
    assert ".pre_norm (GemmaRMSNorm) has no Equinox counterpart" in err
    assert ".proj (Einsum) holds ['kernel']" in err
    assert ".out" not in err
    assert not dst.exists()


@requires("NNX")
def test_cli_refuses_recorded_classes_it_cannot_import(tmp_path):
    """The class is recorded but its module is not imported (the CLI imports
    nothing): the arrays alone (`scale`) look like Flax's RMSNorm, yet it is refused."""
    src = tmp_path / "gemma.safetensors"
    bridge.save(src, GemmaBlock(nnx.Rngs(0)))
    contents = open_checkpoint(src)
    modules = tuple(
        (p, c.replace("tests.test_port_custom", "gemma.modules"), f)
        for p, c, f in contents.modules
    )
    contents = dataclasses.replace(contents, modules=modules)
    with pytest.raises(ValueError, match=r"nothing was written") as info:
        relayout(contents, read(contents), "equinox")
    message = str(info.value)
    assert ".pre_norm is a gemma.modules:GemmaNorm in the file" in message
    assert ".proj (Einsum) holds ['kernel']" in message
