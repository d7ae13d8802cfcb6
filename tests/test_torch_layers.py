"""Every layer family against real PyTorch modules: torch -> NNX, Linen and Equinox,
outputs equal to torch's forward; and back, accepted by `load_state_dict(strict=True)`
with the same outputs. Skipped without torch (`nox -s tests_torch` installs it)."""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires


torch = pytest.importorskip("torch")
# minutes of compilation: `nox -s tests_torch` runs them, the fast suite does not
pytestmark = [pytest.mark.slow, requires("NNX")]

KEY = jax.random.key


def _nchw(x):  # torch channels-first -> Flax channels-last
    return np.moveaxis(x, 1, -1)


def _torch_layout(y):
    return np.moveaxis(np.asarray(y), -1, 1)


def _linen(module, x):
    variables = module.init(KEY(0), x)
    return module, variables


def _run_linen(ported, x):
    module, variables = ported
    return module.apply(variables, x)


def _vmap(model, x, state=None):
    if state is None:
        return jax.vmap(model)(x)
    return jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(
        x, state
    )[0]


R = np.random.default_rng(0)


def _x(*shape):
    return R.normal(size=shape).astype(np.float32)


def _conv_case(dim, groups):
    conv = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[dim]
    k, cin, cout = 3, 4, 6
    x = _x(2, cin, *([5] * dim))
    return dict(
        torch=lambda: conv(cin, cout, k, padding=1, groups=groups),
        x=x,
        nnx=lambda: nnx.Conv(
            cin,
            cout,
            (k,) * dim,
            padding=1,
            feature_group_count=groups,
            rngs=nnx.Rngs(0),
        ),
        run_nnx=lambda m, x: _torch_layout(m(_nchw(x))),
        linen=lambda: _linen(
            nn.Conv(cout, (k,) * dim, padding=1, feature_group_count=groups), _nchw(x)
        ),
        run_linen=lambda m, x: _torch_layout(_run_linen(m, _nchw(x))),
        equinox=lambda: eqx.nn.Conv(
            dim, cin, cout, k, padding=1, groups=groups, key=KEY(1)
        ),
        run_equinox=lambda m, x: _vmap(m, x),
    )


CASES = {
    "Linear": dict(
        torch=lambda: torch.nn.Linear(3, 4),
        x=_x(2, 3),
        nnx=lambda: nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
        run_nnx=lambda m, x: m(x),
        linen=lambda: _linen(nn.Dense(4), _x(1, 3)),
        run_linen=_run_linen,
        equinox=lambda: eqx.nn.Linear(3, 4, key=KEY(1)),
        run_equinox=lambda m, x: _vmap(m, x),
    ),
    "Conv1d-groups2": _conv_case(1, 2),
    "Conv2d-groups2": _conv_case(2, 2),
    "Conv3d": _conv_case(3, 1),
    "ConvTranspose2d": dict(
        torch=lambda: torch.nn.ConvTranspose2d(4, 3, 3, stride=2),
        x=_x(2, 4, 5, 5),
        nnx=lambda: nnx.ConvTranspose(
            4, 3, (3, 3), strides=2, padding="VALID", rngs=nnx.Rngs(0)
        ),
        run_nnx=lambda m, x: _torch_layout(m(_nchw(x))),
        linen=lambda: _linen(
            nn.ConvTranspose(3, (3, 3), strides=(2, 2), padding="VALID"),
            _x(1, 5, 5, 4),
        ),
        run_linen=lambda m, x: _torch_layout(_run_linen(m, _nchw(x))),
        equinox=lambda: eqx.nn.ConvTranspose2d(4, 3, 3, stride=2, key=KEY(1)),
        run_equinox=lambda m, x: _vmap(m, x),
    ),
    "Embedding": dict(
        torch=lambda: torch.nn.Embedding(10, 4),
        x=np.array([[1, 7, 3], [0, 9, 2]]),
        nnx=lambda: nnx.Embed(10, 4, rngs=nnx.Rngs(0)),
        run_nnx=lambda m, x: m(x),
        linen=lambda: _linen(nn.Embed(10, 4), np.array([[1]])),
        run_linen=_run_linen,
        equinox=lambda: eqx.nn.Embedding(10, 4, key=KEY(1)),
        run_equinox=lambda m, x: jax.vmap(jax.vmap(m))(x),
    ),
    "LayerNorm": dict(
        torch=lambda: torch.nn.LayerNorm(4),
        x=_x(2, 4),
        nnx=lambda: nnx.LayerNorm(4, epsilon=1e-5, rngs=nnx.Rngs(0)),
        run_nnx=lambda m, x: m(x),
        linen=lambda: _linen(nn.LayerNorm(epsilon=1e-5), _x(1, 4)),
        run_linen=_run_linen,
        equinox=lambda: eqx.nn.LayerNorm(4, eps=1e-5),
        run_equinox=lambda m, x: _vmap(m, x),
    ),
    "RMSNorm": dict(
        torch=lambda: torch.nn.RMSNorm(4, eps=1e-6),
        x=_x(2, 4),
        nnx=lambda: nnx.RMSNorm(4, epsilon=1e-6, rngs=nnx.Rngs(0)),
        run_nnx=lambda m, x: m(x),
        linen=lambda: _linen(nn.RMSNorm(epsilon=1e-6), _x(1, 4)),
        run_linen=_run_linen,
        equinox=lambda: eqx.nn.RMSNorm(4, eps=1e-6),
        run_equinox=lambda m, x: _vmap(m, x),
    ),
    "GroupNorm": dict(
        torch=lambda: torch.nn.GroupNorm(2, 4),
        x=_x(2, 4, 3),
        nnx=lambda: nnx.GroupNorm(4, num_groups=2, epsilon=1e-5, rngs=nnx.Rngs(0)),
        run_nnx=lambda m, x: _torch_layout(m(_nchw(x))),
        linen=lambda: _linen(nn.GroupNorm(num_groups=2, epsilon=1e-5), _x(1, 3, 4)),
        run_linen=lambda m, x: _torch_layout(_run_linen(m, _nchw(x))),
        equinox=lambda: eqx.nn.GroupNorm(2, 4, eps=1e-5),
        run_equinox=lambda m, x: _vmap(m, x),
    ),
    "BatchNorm2d": dict(
        torch=lambda: _trained_batch_norm(),
        x=_x(2, 3, 4, 4),
        nnx=lambda: nnx.BatchNorm(
            3, use_running_average=True, epsilon=1e-5, momentum=0.9, rngs=nnx.Rngs(0)
        ),
        run_nnx=lambda m, x: _torch_layout(m(_nchw(x))),
        linen=lambda: _linen(
            nn.BatchNorm(use_running_average=True, epsilon=1e-5, momentum=0.9),
            _x(1, 4, 4, 3),
        ),
        run_linen=lambda m, x: _torch_layout(_run_linen(m, _nchw(x))),
        equinox=lambda: eqx.nn.make_with_state(eqx.nn.BatchNorm)(
            3, "batch", eps=1e-5, momentum=0.9, mode="batch", inference=True
        ),
        run_equinox=lambda m, x: _vmap(m[0], x, m[1]),
    ),
    "MultiheadAttention": dict(
        torch=lambda: torch.nn.MultiheadAttention(8, 2, batch_first=True),
        x=_x(2, 5, 8),
        nnx=lambda: nnx.MultiHeadAttention(
            num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0)
        ),
        run_nnx=lambda m, x: m(x),
        linen=lambda: _linen(
            nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8), _x(1, 5, 8)
        ),
        run_linen=_run_linen,
        equinox=lambda: eqx.nn.MultiheadAttention(
            2,
            8,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=KEY(1),
        ),
        run_equinox=lambda m, x: jax.vmap(lambda s: m(s, s, s))(x),
    ),
}


def _trained_batch_norm():
    """A BatchNorm2d after a few training steps: statistics far from 0 and 1."""
    bn = torch.nn.BatchNorm2d(3)
    opt = torch.optim.SGD(bn.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(8, 3, 4, 4, generator=gen) * 3 + 2
        loss = (bn(x) * torch.arange(3.0).reshape(1, 3, 1, 1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return bn.eval()


def _torch_forward(module, x):
    with torch.no_grad():
        x = torch.from_numpy(x)
        if isinstance(module, torch.nn.MultiheadAttention):
            return module(x, x, x, need_weights=False)[0].numpy()
        return module(x).numpy()


def _assert_close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fw", ["nnx", "linen", "equinox"])
@pytest.mark.parametrize("name", list(CASES))
def test_layer_round_trip(name, fw):
    case = CASES[name]
    torch.manual_seed(0)
    source = case["torch"]()
    if isinstance(source, torch.nn.Module) and not name.startswith("BatchNorm"):
        with torch.no_grad():  # biases and scales away from their init values
            for p in source.parameters():
                p.add_(torch.randn_like(p) * 0.5)
    source.eval()
    x = case["x"]
    expected = _torch_forward(source, x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ported = bridge.port(source, case[fw]())
    _assert_close(case[f"run_{fw}"](ported, x), expected)

    # and back, into a fresh module of the same settings
    torch.manual_seed(1)
    fresh = case["torch"]()
    state = bridge.port(ported, fresh)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    fresh.load_state_dict(state, strict=True)
    fresh.eval()
    _assert_close(_torch_forward(fresh, x), expected)


def test_state_dict_without_classes():
    """A state dict alone (no module): layers by names and shapes, the heads of a
    fused attention taken from the target."""
    torch.manual_seed(0)
    source = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    target = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0)
    )
    ported = bridge.port(source.state_dict(), target)
    x = _x(2, 5, 8)
    _assert_close(ported(x), _torch_forward(source, x))
    numpy_sd = {k: v.numpy() for k, v in source.state_dict().items()}
    back = bridge.port(ported, numpy_sd)
    assert all(isinstance(v, np.ndarray) for v in back.values())
    for k, v in numpy_sd.items():
        np.testing.assert_array_equal(back[k], v)


def test_hyperparameters_differ_warns():
    source = torch.nn.LayerNorm(4)  # eps 1e-5
    with pytest.warns(bridge.PortWarning, match="epsilon"):
        bridge.port(source, nnx.LayerNorm(4, rngs=nnx.Rngs(0)))


def test_grouped_conv_transpose_refused():
    source = torch.nn.ConvTranspose2d(4, 4, 3, groups=2)
    target = nnx.ConvTranspose(4, 4, (3, 3), rngs=nnx.Rngs(0))
    with pytest.raises(bridge.PortError, match="grouped ConvTranspose"):
        bridge.port(source, target)


def test_batch_norm_counter_kept():
    """`num_batches_tracked` belongs to the torch model: kept, never ported."""
    source = _trained_batch_norm()
    target = nnx.BatchNorm(3, epsilon=1e-5, momentum=0.9, rngs=nnx.Rngs(0))
    ported = bridge.port(source, target)
    fresh = torch.nn.BatchNorm2d(3)
    state = bridge.port(ported, fresh)
    assert state["num_batches_tracked"].dtype == torch.int64
    assert int(state["num_batches_tracked"]) == 0
    np.testing.assert_array_equal(
        state["running_var"].numpy(), source.running_var.numpy()
    )
