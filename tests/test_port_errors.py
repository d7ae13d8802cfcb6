"""Every PortError, once with every problem; warnings; compare's own errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import bridge

from . import models
from .helpers import requires


KEY = jax.random.key


def _eqx_mlp(width=models.D_HID, depth=2, **kwargs):
    return eqx.nn.MLP(
        models.D_IN, models.D_OUT, width, depth=depth, key=KEY(0), **kwargs
    )


def test_missing_layer():
    with pytest.raises(bridge.PortError, match=r"missing: target layer \.layers\[1\]"):
        bridge.port(_eqx_mlp(depth=1), models.nnx_mlp())


def test_unexpected_layer():
    with pytest.raises(
        bridge.PortError, match=r"unexpected: source layer \.layers\[1\]"
    ):
        bridge.port(models.nnx_mlp(), _eqx_mlp(depth=1))


def test_strict_false_lists_missing_in_the_plan_and_keeps_the_target():
    source, target = _eqx_mlp(depth=1), models.nnx_mlp(2)
    plan = bridge.port_plan(source, target)
    assert plan.missing == (".layers[1]",)
    assert "missing (kept as they are):" in str(plan)
    ported = bridge.port(source, target, strict=False)
    assert ported.layers[1].kernel[...] is target.layers[1].kernel[...]
    assert jnp.array_equal(ported.layers[2].kernel[...], source.layers[1].weight.T)


def test_shape_mismatch_raises_when_strict_kept_when_not(caplog):
    with pytest.raises(bridge.PortError, match=r"shape: .* `kernel` is \(3, 6\)"):
        bridge.port(_eqx_mlp(width=6), models.nnx_mlp())
    target = models.nnx_mlp()
    with caplog.at_level("WARNING", logger="bridge"):
        kept = bridge.port(_eqx_mlp(width=6), target, strict=False)
    assert "kernel (3, 6) in the source" in caplog.text
    assert jnp.array_equal(kept.layers[0].kernel[...], target.layers[0].kernel[...])


def test_dtype_mismatch():
    source = eqx.nn.Linear(2, 3, key=KEY(0))
    target = eqx.nn.Linear(2, 3, dtype=jnp.float16, key=KEY(1))
    with pytest.raises(bridge.PortError, match=r"dtype: .*float32 in the source"):
        bridge.port(source, target)


@requires("NNX")
def test_ambiguous_pairing_suggests_a_rule():
    source = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(2)])
    target = eqx.nn.Sequential([eqx.nn.Linear(4, 4, key=KEY(0))])
    with pytest.raises(bridge.PortError, match=r"ambiguous: .*rules=") as info:
        bridge.port(source, target, strict=False)
    assert any(".layers[0]" in p for p in info.value.problems)
    ported = bridge.port(source, target, rules={r"\[1\]": ".layers[0]"}, strict=False)
    assert jnp.array_equal(ported.layers[0].weight, source[1].kernel[...].T)


class _WithPReLU(eqx.Module):
    linear: eqx.nn.Linear
    act: eqx.nn.PReLU

    def __init__(self, slope, key):
        self.linear = eqx.nn.Linear(2, 2, key=key)
        self.act = eqx.nn.PReLU(slope)

    def __call__(self, x):
        return self.act(self.linear(x))


def test_a_module_no_codec_knows_ports_its_arrays_as_they_are():
    """PReLU has no codec: its one array is a loose array (kind Array), paired by
    name; the relayout of a checkpoint (no target to pair with) refuses it."""
    source, target = _WithPReLU(0.3, KEY(0)), _WithPReLU(0.25, KEY(1))
    plan = bridge.port_plan(source, target)
    assert [(s.target, s.kind, s.by) for s in plan.steps] == [
        (".linear", "Dense", "path"),
        (".act.negative_slope", "Array", "path"),
    ]
    ported = bridge.port(source, target)
    x = jnp.array([[1.0, -2.0], [-3.0, 4.0]])
    assert bridge.compare(source, ported, x) == 0.0
    assert bridge.compare(target, ported, x) > 0.1


def test_rules_that_do_not_apply():
    source, target = models.linen_mlp(), models.nnx_mlp()
    with pytest.raises(bridge.PortError, match=r"matches no source layer") as info:
        bridge.port(source, target, rules={r"\.nope": ".layers[0]"})
    assert len(info.value.problems) == 1
    with pytest.raises(bridge.PortError, match=r"not a layer of the target"):
        bridge.port(source, target, rules={r"\.Dense_0": ".layers[7]"})
    with pytest.raises(
        bridge.PortError, match=r"paired with \['\.Dense_0', '\.Dense_1'\]"
    ):
        bridge.port(source, target, rules={r"\.Dense_[01]": ".layers[1]"})


def test_rule_across_kinds():
    source, target = models.linen_cnn(), models.nnx_cnn()
    with pytest.raises(bridge.PortError, match=r"kind: the rule pairs \.Dense_0"):
        bridge.port(source, target, rules={r"\.Dense_0": ".bn"})


@requires("NNX")
def test_non_zero_equinox_rms_bias_cannot_go_to_flax():
    source = eqx.tree_at(lambda m: m.bias, eqx.nn.RMSNorm(4), jnp.ones(4))
    with pytest.raises(bridge.PortError, match=r"value: .*`bias` is not 0.0"):
        bridge.port(
            source,
            nnx.RMSNorm(4, rngs=nnx.Rngs(0)),
        )
    zero = bridge.port(
        eqx.nn.RMSNorm(4), nnx.RMSNorm(4, epsilon=1e-5, rngs=nnx.Rngs(0))
    )
    assert zero.scale[...].shape == (4,)


@requires("NNX")
def test_dropping_a_non_zero_bias():
    source = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    source.bias[...] = jnp.ones(3)
    target = eqx.nn.Linear(2, 3, use_bias=False, key=KEY(0))
    with pytest.raises(bridge.PortError, match=r"dropping it changes the output"):
        bridge.port(source, target)
    plan = bridge.port_plan(source, target)
    assert "use_bias is True in the source and False" in plan.warnings[0]


def test_equinox_batch_norm_without_its_state():
    model, _ = models.equinox_cnn()
    with pytest.raises(
        bridge.PortError, match=r"(?s)unreadable: \.bn .*\(model, state\)"
    ):
        bridge.port(models.nnx_cnn(), model)


def test_linen_layer_named_like_another_kind():
    variables = {"params": {"Dense_0": {"scale": jnp.ones(3)}}}
    with pytest.raises(bridge.PortError, match=r"named like a Dense"):
        bridge.port(variables, variables)


@requires("NNX")
def test_every_problem_at_once():
    source = eqx.nn.Sequential([eqx.nn.Linear(2, 3, key=KEY(0)), eqx.nn.PReLU()])
    target = nnx.Sequential(
        nnx.Linear(2, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0))
    )
    with pytest.raises(
        bridge.PortError, match=r"4 problem\(s\), nothing was written"
    ) as info:
        bridge.port(source, target)
    kinds = sorted(p.split(":")[0] for p in info.value.problems)
    assert kinds == ["missing", "shape", "shape", "unexpected"]


@requires("NNX")
def test_hyperparameter_mismatch_warns_and_is_in_the_plan():
    source = eqx.nn.LayerNorm(4)  # eps 1e-5
    target = nnx.LayerNorm(4, rngs=nnx.Rngs(0))  # epsilon 1e-6
    plan = bridge.port_plan(source, target)
    assert len(plan.warnings) == 1 and "epsilon" in plan.warnings[0]
    with pytest.warns(bridge.PortWarning, match=r"epsilon is 1e-05 in the source"):
        bridge.port(source, target)


def test_compare_errors():
    module, variables = models.linen_mlp()
    with pytest.raises(TypeError, match=r"pass `\(module, variables\)`"):
        bridge.compare(variables, models.nnx_mlp(), models.mlp_input())
    with pytest.raises(ValueError, match="do not have the same structure"):
        other = eqx.nn.Linear(models.D_IN, 4, key=KEY(0))
        bridge.compare((module, variables), other, models.mlp_input())


def test_compare_without_inputs_says_how_to_pass_them():
    """It raised Python's 'missing 1 required positional argument: inputs' from
    the model's own call."""
    module, variables = models.linen_mlp()
    with pytest.raises(
        TypeError,
        match=r"(?s)none were\ngiven: pass them after.*bridge\.compare\(a, b, x\)",
    ):
        bridge.compare((module, variables), (module, variables))
    with pytest.raises(TypeError, match="none were"):
        bridge.compare((module, variables), (module, variables), per_side=({}, {}))


def _notes(error: pytest.ExceptionInfo) -> str:
    return "\n".join(getattr(error.value, "__notes__", []))


@requires("NNX")
def test_compare_tells_channel_order_and_per_side_on_a_shape_error():
    """An NNX convolution (channel-last) against an Equinox one (channel-first):
    JAX's own error stays, and a note names the side, the shapes and the fix."""
    source = nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0))
    target = bridge.port(source, eqx.nn.Conv2d(3, 4, 3, padding=1, key=KEY(1)))
    x = jax.random.normal(KEY(2), (2, 8, 8, 3))
    with pytest.raises(ValueError, match="conv_general_dilated") as error:
        bridge.compare(source, target, x)
    notes = _notes(error)
    assert "model `b` on inputs of shapes [(2, 8, 8, 3)]" in notes
    assert "channel_first=(False, True)" in notes and "per_side=" in notes
    assert bridge.compare(source, target, x, channel_first=(False, True)) < 1e-5
    with pytest.raises(ValueError) as error:  # the other way round: side a
        bridge.compare(target, source, x)
    assert "channel_first=(True, False)" in _notes(error)


def test_compare_adds_nothing_to_errors_that_are_not_about_shapes():
    def broken(x):
        raise ValueError("the model's own bug")

    class Model(eqx.Module):
        def __call__(self, x):
            return broken(x)

    with pytest.raises(ValueError, match="own bug") as error:
        bridge.compare(Model(), Model(), jnp.ones((2, 3)))
    assert "bridge.compare" not in _notes(error)  # (JAX may add a note of its own)


@requires("NNX")
def test_attention_entries_without_a_place():
    """NNX attention with `normalize_qk` has LayerNorms Equinox's has not."""
    source = nnx.MultiHeadAttention(
        2, 8, decode=False, normalize_qk=True, rngs=nnx.Rngs(0)
    )
    target = eqx.nn.MultiheadAttention(
        2,
        8,
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
        key=KEY(0),
    )
    with pytest.raises(bridge.PortError, match=r"source has `query_ln/scale` and the"):
        bridge.port(source, target)
    with pytest.raises(bridge.PortError, match=r"target has `query_ln/scale` and the"):
        bridge.port(target, source)


class Gain(nnx.Module):
    def __init__(self):
        self.gain = nnx.Param(jnp.ones(3))


class EqxGain(eqx.Module):
    weight: jax.Array


@requires("NNX")
def test_a_codec_that_makes_the_wrong_shape():
    bridge.register_codec(
        bridge.Codec(
            "TestGain",
            "nnx",
            lambda cls, leaves: cls is Gain,
            lambda leaves, hyper: {"scale": leaves["gain"]},
            lambda canonical, like, hyper: {"gain": canonical["scale"]},
        )
    )
    bridge.register_codec(
        bridge.Codec(
            "TestGain",
            "equinox",
            lambda cls, leaves: cls is EqxGain,
            lambda leaves, hyper: {"scale": leaves["weight"]},
            lambda canonical, like, hyper: {"weight": canonical["scale"][:2]},
        )
    )
    with pytest.raises(bridge.PortError, match=r"the TestGain codec made .*\(2,\)"):
        bridge.port(Gain(), EqxGain(jnp.zeros(3)))
    assert bridge.port(EqxGain(jnp.zeros(3)), Gain()).gain[...].shape == (3,)


def test_register_codec_checks_its_argument():
    with pytest.raises(TypeError, match="`codecs` must be bridge.Codec records"):
        bridge.register_codec({"kind": "X"})
    codec = bridge.Codec("X", "jittor", None, None, None)  # pyright: ignore
    with pytest.raises(ValueError, match="framework must be one of"):
        bridge.register_codec(codec)


@pytest.mark.parametrize("field", ["recognise", "decode", "encode", "build"])
def test_register_codec_refuses_fields_that_are_not_functions(field):
    fine = lambda *args: {}  # noqa: E731
    codec = bridge.Codec("NotAFunction", "nnx", fine, fine, fine)
    codec = codec._replace(**{field: "not callable"})
    with pytest.raises(TypeError, match=f"`{field}` must be a function, got str"):
        bridge.register_codec(codec)
    with pytest.raises(KeyError, match="No codec of kind 'NotAFunction'"):
        bridge.unregister_codec("NotAFunction")  # nothing was registered


def test_dtype_problems_of_one_kind_are_one_line_with_a_count_and_the_fix():
    """A bfloat16 checkpoint into a float32 model: one problem for all its arrays
    (issue #40, item 4), not one identical line per array."""
    source = eqx.nn.MLP(2, 2, 4, 3, dtype=jnp.bfloat16, key=KEY(0))
    target = eqx.nn.MLP(2, 2, 4, 3, key=KEY(1))
    with pytest.raises(bridge.PortError) as error:
        bridge.port(source, target)
    assert len(error.value.problems) == 1
    (line,) = error.value.problems
    assert line.startswith(
        "dtype: 8 arrays are bfloat16 in the source, the target expects float32 ("
    )
    assert " and 5 more). Pass dtype=jnp.float32 to cast them on the way" in line
    assert str(error.value).count("\n") == 2  # header, the problem, the pointer
    ported = bridge.port(source, target, dtype=jnp.float32)
    assert ported.layers[0].weight.dtype == jnp.float32
    one = eqx.nn.Linear(2, 3, use_bias=False, dtype=jnp.float16, key=KEY(2))
    with pytest.raises(bridge.PortError, match=r"dtype: \(root\) -> \(root\)"):
        # one array: its problem as it was
        bridge.port(one, eqx.nn.Linear(2, 3, use_bias=False, key=KEY(3)))
