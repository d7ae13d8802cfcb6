"""Property: the dict order of the source or the target never changes what `port`
makes. Random Linen models of Dense, Conv, LayerNorm and Embed layers with random
names and repeated shapes: after shuffling either side's dicts, a port is exact or
refused (ambiguous, missing, unexpected), never a different model."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import bridge


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
