"""Property: the dict order of the source or the target never changes what `port`
makes. Random Linen models of Dense, Conv, LayerNorm and Embed layers with random
names and repeated shapes: after shuffling either side's dicts, a port is exact or
refused (ambiguous, missing, unexpected), never a different model. And with example
inputs: a Linen chain and an NNX chain of other names, created in other orders, port
exactly or are refused (test_example_inputs_port_...)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings, strategies as st

import bridge

from .helpers import requires


KINDS = ("Dense", "Conv", "LayerNorm")
WORDS = ("proj", "mix", "norm", "gate", "out", "up")


def _layer(kind, width_in, width_out, rng):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    if kind == "Dense":
        return {"kernel": normal(width_in, width_out), "bias": normal(width_out)}
    if kind == "Conv":
        return {"kernel": normal(2, width_in, width_out), "bias": normal(width_out)}
    if kind == "LayerNorm":
        return {"scale": normal(width_in), "bias": normal(width_in)}
    return {"embedding": normal(5, width_out)}


def _apply(params, names, kinds, ids):
    x = None
    for name, kind in zip(names, kinds):
        p = params[name]
        if kind == "Embed":
            x = p["embedding"][ids]
        elif kind == "Dense":
            x = jnp.tanh(x @ p["kernel"] + p["bias"][None, None])
        elif kind == "Conv":
            padded = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))
            x = padded[:, :-1] @ p["kernel"][0] + padded[:, 1:] @ p["kernel"][1]
            x = jnp.tanh(x + p["bias"][None, None])
        else:
            mean = x.mean(-1, keepdims=True)
            var = ((x - mean) ** 2).mean(-1, keepdims=True)
            x = (x - mean) * jax.lax.rsqrt(var + 1e-6)
            x = x * p["scale"][None, None] + p["bias"][None, None]
    return x


@st.composite
def models(draw):
    n = draw(st.integers(2, 6))
    kinds = ["Embed"] + [draw(st.sampled_from(KINDS)) for _ in range(n)]
    widths = [draw(st.sampled_from((2, 3)))]
    for kind in kinds[1:]:
        widths.append(
            widths[-1] if kind == "LayerNorm" else draw(st.sampled_from((2, 3)))
        )
    counts: dict[str, int] = {}
    source_names, words = [], list(WORDS)
    for kind in kinds:
        if draw(st.booleans()) and words:  # a name from setup, not numbered
            source_names.append(words.pop(draw(st.integers(0, len(words) - 1))))
        else:  # a Linen auto-name
            source_names.append(f"{kind}_{counts.get(kind, 0)}")
        counts[kind] = counts.get(kind, 0) + 1
    target_names = (
        [f"layers_{i}" for i in range(len(kinds))]
        if draw(st.booleans())
        else list(source_names)
    )
    seed = draw(st.integers(0, 2**16))
    order = (
        draw(st.permutations(range(len(kinds)))),
        draw(st.permutations(range(len(kinds)))),
    )
    return kinds, widths, source_names, target_names, seed, order


def _params(kinds, widths, names, seed, order):
    rng = np.random.default_rng(seed)
    layers = []
    for i, kind in enumerate(kinds):
        w_in = widths[i - 1] if i else widths[0]
        layers.append((names[i], _layer(kind, w_in, widths[i], rng)))
    return {"params": dict(layers[i] for i in order)}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_dict_order_never_changes_the_ported_model(case):
    kinds, widths, source_names, target_names, seed, order = case
    ids = jnp.array([[0, 3, 4], [1, 2, 0]])
    natural = list(range(len(kinds)))
    expected = _apply(
        _params(kinds, widths, source_names, seed, natural)["params"],
        source_names,
        kinds,
        ids,
    )
    for source_order, target_order in (
        (natural, natural),
        (order[0], natural),
        (natural, order[1]),
    ):
        source = _params(kinds, widths, source_names, seed, source_order)
        target = _params(kinds, widths, target_names, seed + 1, target_order)
        try:
            ported = bridge.port(source, target)
        except bridge.PortError as error:
            assert all(
                p.split(":")[0] in ("ambiguous", "missing", "unexpected")
                for p in error.problems
            ), error
            continue
        out = _apply(ported["params"], target_names, kinds, ids)
        assert np.array_equal(out, expected), bridge.port_plan(source, target)


# --- with example inputs: two models that compute the same chain, each written with
# its own names, created in any order, its dicts and attributes in any order ------

IDS = jnp.array([[0, 3, 4], [1, 2, 0]])
SOURCE_WORDS = ("proj", "mix", "norm", "gate", "out", "up", "embed")
TARGET_WORDS = ("alpha", "beta", "gamma", "delta", "epsilon_", "zeta", "eta")


def _linen_layer(kind, width, name):
    if kind == "Embed":
        return nn.Embed(5, width, name=name)
    if kind == "Dense":
        return nn.Dense(width, name=name)
    if kind == "Conv":
        return nn.Conv(width, (2,), name=name)
    return nn.LayerNorm(name=name)


class LinenChain(nn.Module):
    """Layers created in the order `created`, applied in the order `kinds` lists
    them (Linen's auto-names count creations: `Dense_0` may be applied last)."""

    kinds: tuple
    widths: tuple
    names: tuple  # None: a Linen auto-name
    created: tuple

    @nn.compact
    def __call__(self, ids):
        layers = {}
        for i in self.created:
            layers[i] = _linen_layer(self.kinds[i], self.widths[i], self.names[i])
        x = ids
        for i, kind in enumerate(self.kinds):
            x = layers[i](x)
            x = jnp.tanh(x) if kind in ("Dense", "Conv") else x
        return x


def _nnx_layer(kind, width_in, width, rngs):
    if kind == "Embed":
        return nnx.Embed(5, width, rngs=rngs)
    if kind == "Dense":
        return nnx.Linear(width_in, width, rngs=rngs)
    if kind == "Conv":
        return nnx.Conv(width_in, width, (2,), rngs=rngs)
    return nnx.LayerNorm(width_in, rngs=rngs)


class NNXChain(nnx.Module):
    """The same chain in NNX: attributes set in the order `created`, named `names`."""

    def __init__(self, kinds, widths, names, created, rngs):
        self.chain = tuple(zip(names, kinds))
        for i in created:
            width_in = widths[i - 1] if i else widths[0]
            setattr(self, names[i], _nnx_layer(kinds[i], width_in, widths[i], rngs))

    def __call__(self, ids):
        x = ids
        for name, kind in self.chain:
            x = getattr(self, name)(x)
            x = jnp.tanh(x) if kind in ("Dense", "Conv") else x
        return x


def _chain(kinds, widths, source_names, created, seed, target_words, target_created):
    """`(kinds, widths, linen module, variables, target names, target's creation
    order)`; `target_words` None: the target uses the source's names."""
    linen = LinenChain(kinds, tuple(widths), tuple(source_names), tuple(created))
    variables = linen.init(jax.random.key(seed), IDS)
    given_names = [
        n if n is not None else auto_name(kinds, source_names, created, i)
        for i, n in enumerate(source_names)
    ]
    assert sorted(given_names) == sorted(variables["params"])
    target_names = tuple(target_words[: len(kinds)] if target_words else given_names)
    return kinds, tuple(widths), linen, variables, target_names, tuple(target_created)


@st.composite
def chains(draw):
    n = draw(st.integers(2, 5))
    kinds = ("Embed", *(draw(st.sampled_from(KINDS)) for _ in range(n)))
    widths = [draw(st.sampled_from((2, 3)))]
    for kind in kinds[1:]:
        widths.append(
            widths[-1] if kind == "LayerNorm" else draw(st.sampled_from((2, 3)))
        )
    words = draw(st.permutations(SOURCE_WORDS))
    source_names = [  # a word from setup, or a Linen auto-name
        words[i] if draw(st.booleans()) else None for i in range(len(kinds))
    ]
    created = draw(st.permutations(range(len(kinds))))
    target_words = draw(st.permutations(TARGET_WORDS)) if draw(st.booleans()) else None
    target_created = draw(st.permutations(range(len(kinds))))
    case = _chain(
        kinds,
        widths,
        source_names,
        created,
        draw(st.integers(0, 99)),
        target_words,
        target_created,
    )
    shuffled = draw(st.permutations(list(case[3]["params"])))
    return case, tuple(shuffled)


def auto_name(kinds, names, created, i):
    """Linen's auto-name of layer `i`: its kind, counted over the auto-named layers
    created before it."""
    before = created[: created.index(i)]
    n = sum(kinds[j] == kinds[i] and names[j] is None for j in before)
    return f"{kinds[i]}_{n}"


REFUSALS = ("ambiguous", "missing", "unexpected")


def assert_ports_or_is_refused(case, shuffled):
    """Asserts that the port with example inputs gives the source's outputs, or is
    refused with only ambiguous/missing/unexpected problems; True when it ported."""
    kinds, widths, linen, variables, target_names, target_created = case
    params = {k: variables["params"][k] for k in shuffled}  # any dict order
    source = (linen, {"params": params})
    target = NNXChain(kinds, widths, target_names, target_created, nnx.Rngs(1))
    ids = IDS
    try:
        ported = bridge.port(source, target, example=ids)
    except bridge.PortError as error:  # a clear refusal, never a wrong model
        assert all(p.split(":")[0] in REFUSALS for p in error.problems), error
        return False
    assert bridge.compare(source, ported, ids) < 1e-5, bridge.port_plan(
        source, target, example=ids
    )
    return True


@requires("NNX")
def test_example_inputs_port_whatever_the_names_and_orders_a_few_cases():
    """The default session's cases: auto-names counted in another order than the
    layers are applied, repeated shapes, sorted and reversed dicts; each ports."""
    kinds = ("Embed", "Dense", "Dense", "LayerNorm", "Dense", "Conv")
    widths = (3, 3, 3, 3, 3, 2)
    names = (None, "proj", None, None, None, "mix")
    case = _chain(kinds, widths, names, (4, 2, 0, 5, 3, 1), 0, TARGET_WORDS, range(6))
    assert assert_ports_or_is_refused(case, tuple(sorted(case[3]["params"])))
    target = NNXChain(*case[:2], *case[4:], nnx.Rngs(1))
    # the example decided: without it, ambiguous, and example inputs are proposed
    with pytest.raises(bridge.PortError, match=r"(?s)ambiguous.*Give example inputs"):
        bridge.port(case[2:4], target)
    case = _chain(kinds, widths, names, range(6), 1, None, (5, 4, 3, 2, 1, 0))
    assert assert_ports_or_is_refused(case, tuple(reversed(case[3]["params"])))


@requires("NNX")
@pytest.mark.slow  # each case builds, traces and runs two small models
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_example_inputs_port_whatever_the_names_and_orders(chain):
    """Both sides' names, creation orders, dict and attribute orders drawn at
    random: with example inputs, a port gives the source's outputs, or is refused."""
    assert_ports_or_is_refused(*chain)
