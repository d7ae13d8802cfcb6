"""Fine-tuning a changed model (issue #23, item 1): `strict=False` keeps the target's
values where shapes differ and reports them (Hugging Face's
`ignore_mismatched_sizes`), `rules={pattern: None}` drops a source layer, and the
failure messages propose the fix (a prefix, why order is unknown)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires


class Source(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(4, 8, rngs=rngs)
        self.head = nnx.Linear(8, 10, rngs=rngs)


class Target(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(4, 8, rngs=rngs)
        self.classifier = nnx.Linear(8, 5, rngs=rngs)


class EqxTarget(eqx.Module):
    body: eqx.nn.Linear
    classifier: eqx.nn.Linear

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.body = eqx.nn.Linear(4, 8, key=a)
        self.classifier = eqx.nn.Linear(8, 5, key=b)


@requires("NNX")
def test_a_new_head_is_refused_by_default_with_the_fix():
    with pytest.raises(bridge.PortError, match="strict=False to keep the target's"):
        bridge.port(Source(nnx.Rngs(0)), Target(nnx.Rngs(1)))


@requires("NNX")
@pytest.mark.parametrize("framework", ["nnx", "equinox"])
def test_strict_false_keeps_the_new_head_and_reports_it(framework, caplog):
    source = Source(nnx.Rngs(0))
    target = Target(nnx.Rngs(1)) if framework == "nnx" else EqxTarget(jax.random.key(1))
    before = bridge.from_nnx(target) if framework == "nnx" else target
    with caplog.at_level("WARNING", logger="bridge"):
        out, report = bridge.port(source, target, strict=False, report=True)
    name = type(target).__name__
    assert caplog.text.count("Some weights") == 1
    assert (
        f"Some weights of {name} were not initialized from the source (Source) and "
        "keep their values because the shapes did not match:\n- .head -> "
        ".classifier (Dense): bias (10,) in the source, (5,) in the target"
    ) in caplog.text
    assert "You should probably TRAIN this model." in caplog.text
    assert report.mismatched == bridge.port_plan(source, target).mismatched
    assert not report.complete and str(report) in caplog.text
    new, old = bridge.to_neutral(out), bridge.to_neutral(before)
    np.testing.assert_array_equal(new.classifier.bias, old.classifier.bias)
    kernel = new.body.kernel if framework == "nnx" else new.body.weight.T
    np.testing.assert_array_equal(kernel, source.body.kernel[...])
    plan = bridge.port_plan(source, target)
    assert plan.mismatched == (
        ".head -> .classifier (Dense): bias (10,) in the source, (5,) in the target; "
        "kernel (8, 10) in the source, (8, 5) in the target",
    )
    assert "mismatched shapes (the target's values kept):" in str(plan)
    assert [s.target for s in plan.steps] == [".body"]


@requires("NNX")
def test_a_rule_to_none_drops_a_source_layer():
    source, target = Source(nnx.Rngs(0)), Target(nnx.Rngs(1))
    plan = bridge.port_plan(source, target, rules={r"\.head": None})
    assert plan.dropped == (".head",) and plan.unexpected == ()
    assert plan.missing == (".classifier",)
    assert "dropped by rules:\n  .head" in str(plan)
    out = bridge.port(source, target, rules={r"\.head": None}, strict=False)
    np.testing.assert_array_equal(
        out.classifier.kernel[...], target.classifier.kernel[...]
    )
    with pytest.raises(bridge.PortError, match=r"missing: target layer \.classifier"):
        bridge.port(source, target, rules={r"\.head": None})
    with pytest.raises(bridge.PortError, match=r"rule '\\\\.tail': matches no source"):
        bridge.port(source, target, rules={r"\.tail": None}, strict=False)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.q = nnx.Linear(4, 4, rngs=rngs)
        self.k = nnx.Linear(4, 4, rngs=rngs)


class Inner(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([Block(rngs) for _ in range(3)])


class Prefixed(nnx.Module):
    def __init__(self, rngs):
        self.model = Inner(rngs)
        self.lm_head = nnx.Linear(4, 9, rngs=rngs)


class Mine(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([Block(rngs) for _ in range(3)])
        self.lm_head = nnx.Linear(4, 9, rngs=rngs)


def state_dict(model):
    tree = bridge.from_nnx(model)
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        name = name.replace("kernel", "weight")
        out[name] = np.asarray(leaf.T if leaf.ndim == 2 else leaf)
    return out


@requires("NNX")
def test_a_prefix_that_would_pair_the_missing_layers_is_proposed():
    sd = state_dict(Prefixed(nnx.Rngs(0)))
    source = bridge.from_torch(sd)
    with pytest.raises(bridge.PortError) as error:
        bridge.port(source, nnx.eval_shape(lambda: Mine(nnx.Rngs(1))))
    text = str(error.value)
    assert "prefix: 6 of the 6 target layers that names did not pair are source " in (
        text
    )
    assert "prefix='model.'" in text
    rule = re.search(r"rules=\{r'(.*?)': r'(.*?)'\}", text)
    assert rule is not None
    out = bridge.port(source, Mine(nnx.Rngs(1)), rules={rule[1]: rule[2]})
    np.testing.assert_array_equal(
        out.layers[2].k.kernel[...], sd["model.layers.2.k.weight"].T
    )


@requires("NNX")
def test_order_unknown_says_why():
    class Three(nnx.Module):
        def __init__(self, rngs, names):
            for name in names:
                setattr(self, name, nnx.Linear(3, 3, rngs=rngs))

    source = Three(nnx.Rngs(0), ["a", "b", "c"])  # sorted: the order may be lost
    target = Three(nnx.Rngs(1), ["z", "y", "x"])
    with pytest.raises(bridge.PortError, match="attributes are in sorted order"):
        bridge.port(source, target)
    module = nnx.bridge  # noqa: F841  (flax installed)
    variables = {
        "params": {n: {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)} for n in "abc"}
    }
    with pytest.raises(bridge.PortError) as error:
        bridge.port(bridge.from_linen(variables), target)
    assert "keys of a dict" in str(error.value)
    assert "optax" not in str(error.value)


@requires("NNX")
def test_load_strict_false_keeps_the_new_head_and_logs_it(tmp_path, caplog):
    path = tmp_path / "source.safetensors"
    bridge.save(path, Source(nnx.Rngs(0)))
    target = Target(nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"missing \.classifier\.bias") as error:
        bridge.load(path, like=target)
    assert "(a new head, layers added or removed), pass strict=False" in " ".join(
        str(error.value).split()
    )
    with caplog.at_level("WARNING", logger="bridge"):
        out, report = bridge.load(path, like=target, strict=False, report=True)
    assert "because the shapes did not match:\n- .head -> .classifier" in caplog.text
    assert f"from the checkpoint at {path} and keep" in caplog.text
    assert caplog.text.count("Some weights") == 1  # once, not a warning as well
    ported = bridge.port(Source(nnx.Rngs(0)), target, strict=False, report=True)[1]
    assert report.mismatched == ported.mismatched  # one code path
    assert str(report) == str(ported).replace(
        "the source (Source)", f"the checkpoint at {path}"
    )
    np.testing.assert_array_equal(
        out.classifier.kernel[...], target.classifier.kernel[...]
    )
    np.testing.assert_array_equal(
        out.body.kernel[...], Source(nnx.Rngs(0)).body.kernel[...]
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="bridge"):
        bridge.load(path, like=target, rules={r"\.head": None}, strict=False)
    assert "were not initialized from the checkpoint" in caplog.text
    assert "['.classifier']" in caplog.text


@requires("NNX")
@pytest.mark.parametrize("layout", ["torch", "nnx"])
def test_load_with_a_prefix(tmp_path, layout):
    path = tmp_path / "prefixed.safetensors"
    source = Prefixed(nnx.Rngs(0))
    if layout == "torch":
        from safetensors.numpy import save_file

        save_file(state_dict(source), path, metadata={"format": "pt"})
    else:
        bridge.save(path, source)
    with pytest.raises(ValueError, match="prefix='model.'"):
        bridge.load(path, like=Mine(nnx.Rngs(1)))
    out = bridge.load(path, like=Mine(nnx.Rngs(1)), prefix="model.")
    np.testing.assert_array_equal(
        out.layers[2].k.kernel[...], source.model.layers[2].k.kernel[...]
    )
    np.testing.assert_array_equal(out.lm_head.bias[...], source.lm_head.bias[...])
    rules = {r"\.model(.*)": r"\1"}
    again = bridge.load(path, like=Mine(nnx.Rngs(1)), rules=rules)
    np.testing.assert_array_equal(
        again.layers[0].q.kernel[...], out.layers[0].q.kernel[...]
    )


@requires("NNX")
def test_port_reports_missing_and_unexpected_layers(caplog):
    """A source with an extra layer into a target with a layer of its own: both
    named in from_pretrained's words, and returned."""
    source, target = Source(nnx.Rngs(0)), Target(nnx.Rngs(1))
    rules = {r"\.head": None}
    with caplog.at_level("INFO", logger="bridge"):
        out, report = bridge.port(
            source, target, rules=rules, strict=False, report=True
        )
    assert report.missing == (".classifier",) and report.dropped == (".head",)
    assert report.unexpected == () and report.mismatched == ()
    assert (
        "Some weights of Target were not initialized from the source (Source) and "
        "keep their values: ['.classifier']\nYou should probably TRAIN this model."
    ) in caplog.text
    assert "Left out by rules: ['.head']" in caplog.text

    class Body(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(4, 8, rngs=rngs)

    _, report = bridge.port(target, Body(nnx.Rngs(2)), strict=False, report=True)
    assert report.unexpected == (".classifier",)
    assert (
        "Some weights of the source (Target) were not used when initializing "
        in str(report)
    )


@requires("NNX")
def test_a_complete_port_reports_nothing(caplog):
    with caplog.at_level("WARNING", logger="bridge"):
        out, report = bridge.port(Source(nnx.Rngs(0)), Source(nnx.Rngs(1)), report=True)
    assert report.complete and caplog.text == ""
    assert str(report) == "Source was filled entirely from the source (Source)."
    assert bridge.port(Source(nnx.Rngs(0)), Source(nnx.Rngs(1))).__class__ is Source


@requires("NNX")
def test_port_warnings_point_at_the_caller_s_line(tmp_path):
    """A PortWarning (here: dtypes cast under strict=False) names the user's line,
    from bridge.port and from bridge.load (which ports inside bridge)."""
    source = nnx.Linear(2, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    target = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    path = tmp_path / "half.safetensors"
    bridge.save_state_dict(path, source)
    with pytest.warns(bridge.PortWarning, match="dtypes differ") as said:
        bridge.port(source, target, strict=False)
        bridge.load(path, like=target, strict=False)
    assert [w.filename for w in said] == [__file__, __file__]


@requires("NNX")
@pytest.mark.parametrize("columns", [100, 60])
def test_the_plan_fits_the_terminal_s_width(monkeypatch, columns):
    """str(plan) folds to $COLUMNS (issue #40: 108 columns at COLUMNS=100), and the
    folded plan still names every pairing."""

    class Deep(nnx.Module):
        def __init__(self, rngs):
            self.model = Inner(rngs)
            self.lm_head_with_a_long_name = nnx.Linear(4, 9, rngs=rngs)

    source = bridge.from_nnx(Deep(nnx.Rngs(0)))
    monkeypatch.setenv("COLUMNS", str(columns))
    text = str(bridge.port_plan(source, Deep(nnx.Rngs(1))))
    assert max(map(len, text.splitlines())) <= columns, text
    assert ".model.layers[0..2].q" in text and ".lm_head_with_a_long_name" in text
    monkeypatch.setenv("COLUMNS", "300")
    assert (
        max(map(len, str(bridge.port_plan(source, Deep(nnx.Rngs(1)))).splitlines()))
        > 60
    )
