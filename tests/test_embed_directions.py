"""The six directions (Equinox/Linen/NNX inside each other) on an MLP, a CNN with
BatchNorm in training mode and an attention block with dropout: the wrapper's
outputs, state updates, gradients and training runs equal the wrapped model's own."""

import numpy as np
import pytest

from .embed_models import (
    DIRECTIONS,
    KINDS,
    Idiom,
    inputs,
    native,
    step_keys,
    train_with_make_step,
    wrap,
)
from .helpers import requires


def _case(inner, outer, kind, *, slow=False):
    """NNX on either side needs bridge's NNX adapter; the Equinox CNN has a
    BatchNorm(mode=...)."""
    marks = [requires("NNX")] if "nnx" in (inner, outer) else []
    if kind == "cnn" and "equinox" in (inner, outer):
        marks.append(requires("eqx.nn.BatchNorm(mode=...)"))
    return pytest.param(inner, outer, kind, marks=marks + [pytest.mark.slow] * slow)


CASES = [_case(i, o, k) for i, o in DIRECTIONS for k in KINDS]
IDS = [f"{i}-in-{o}-{k}" for i, o in DIRECTIONS for k in KINDS]
# the MLP of each direction in the default suite, the CNN and the attention block
# with the slow tests (`nox -s tests_slow`)
SLOW_CASES = [_case(i, o, k, slow=k != "mlp") for i, o in DIRECTIONS for k in KINDS]


def _mismatches(a: dict, b: dict, exact: bool = True) -> list[str]:
    """The paths where `a` and `b` differ (bits, or 1e-6 when not `exact`); a
    mismatch of the path sets, or an empty `a`, counts as a difference too."""
    if not a or a.keys() != b.keys():
        return [f"paths {sorted(map(str, a))} vs {sorted(map(str, b))}"]
    out = []
    for path in a:
        x, y = np.asarray(a[path]), np.asarray(b[path])
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{path}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        elif exact and x.tobytes() != y.tobytes():
            out.append(f"{path}: bits differ")
        elif not exact and not np.allclose(x, y, rtol=1e-6, atol=1e-6):
            out.append(f"{path}: max |diff| {np.max(np.abs(x - y)):.3g}")
    return out


def _pair(inner, outer, kind):
    base = Idiom(inner, native(inner, kind), inner, kind)
    wrapped = Idiom(outer, wrap(inner, outer, native(inner, kind)), inner, kind)
    return base, wrapped


@pytest.mark.parametrize("inner,outer,kind", SLOW_CASES, ids=IDS)
def test_gradients_equal_native(inner, outer, kind):
    base, wrapped = _pair(inner, outer, kind)
    x, y = inputs(kind)
    key = step_keys(1)[0]
    loss, grads = base.loss_and_grad(x, y, key)
    wloss, wgrads = wrapped.loss_and_grad(x, y, key)
    assert np.asarray(loss).tobytes() == np.asarray(wloss).tobytes()
    assert not _mismatches(grads, wgrads)


@pytest.mark.parametrize("inner,outer,kind", SLOW_CASES, ids=IDS)
def test_training_equals_native(inner, outer, kind):
    # the outer framework's own loop (nnx.Optimizer, TrainState, filter_grad) on the
    # wrapper; the wrapped model's own loop natively: same parameters and state
    base, wrapped = _pair(inner, outer, kind)
    x, y = inputs(kind)
    keys = step_keys(2)
    assert not _mismatches(base.train(x, y, keys), wrapped.train(x, y, keys))


@pytest.mark.parametrize("inner,outer,kind", SLOW_CASES, ids=IDS)
def test_make_step_equals_native(inner, outer, kind):
    # bridge.make_step on the wrapper's Tree, in the outer framework's terms
    base, wrapped = _pair(inner, outer, kind)
    x, y = inputs(kind)
    keys = step_keys(2)
    native_result = base.train(x, y, keys)
    bridged = train_with_make_step(wrapped, x, y, keys)
    assert not _mismatches(native_result, bridged, exact=False)
