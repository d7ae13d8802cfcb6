"""Per-head kernels (`nnx.LinearGeneral(D, (H, hd))`, Linen `DenseGeneral`) pair
with fused ones (`nnx.Linear(D, H * hd)`, Equinox `Linear`): the kernel reshaped to
`(prod(in axes), prod(out axes))` computes the same product. Outputs compared."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import bridge

from .helpers import requires


pytestmark = requires("NNX")
D, H, HD = 8, 2, 4
X = jax.random.normal(jax.random.key(5), (2, 3, D))


def _attend(q, k, v):
    """`q, k, v`: `(B, T, H, hd)`."""
    w = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", w, v)


class PerHead(nnx.Module):
    def __init__(self, rngs):
        def split():
            return nnx.LinearGeneral(D, (H, HD), use_bias=False, rngs=rngs)

        self.q_proj, self.k_proj, self.v_proj = split(), split(), split()
        self.o_proj = nnx.LinearGeneral(
            (H, HD), D, axis=(-2, -1), use_bias=False, rngs=rngs
        )

    def __call__(self, x):
        return self.o_proj(_attend(self.q_proj(x), self.k_proj(x), self.v_proj(x)))


class Fused(nnx.Module):
    def __init__(self, rngs):
        fused = lambda: nnx.Linear(D, H * HD, use_bias=False, rngs=rngs)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = fused(), fused(), fused()
        self.o_proj = nnx.Linear(H * HD, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        heads = lambda y: y.reshape(b, t, H, HD)  # noqa: E731
        out = _attend(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.o_proj(out.reshape(b, t, H * HD))


class EqxFused(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.q_proj, self.k_proj, self.v_proj = (
            eqx.nn.Linear(D, H * HD, use_bias=False, key=k[i]) for i in range(3)
        )
        self.o_proj = eqx.nn.Linear(H * HD, D, use_bias=False, key=k[3])

    def __call__(self, x):
        """`x`: one example `(T, D)`."""
        t = x.shape[0]
        heads = lambda f: jax.vmap(f)(x).reshape(1, t, H, HD)  # noqa: E731
        out = _attend(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj))
        return jax.vmap(self.o_proj)(out.reshape(t, H * HD))


class LinenPerHead(nn.Module):
    """MaxText's query, key and value: `DenseGeneral` kernels `(D, H, hd)`, no bias
    (the output projection as a Dense of the fused heads)."""

    @nn.compact
    def __call__(self, x):
        def split(name):
            return nn.DenseGeneral((H, HD), use_bias=False, name=name)

        q, k, v = split("q_proj")(x), split("k_proj")(x), split("v_proj")(x)
        out = _attend(q, k, v)
        fused = out.reshape(*out.shape[:-2], H * HD)
        return nn.Dense(D, use_bias=False, name="o_proj")(fused)


def test_per_head_nnx_into_fused_nnx_and_equinox_and_back():
    source = PerHead(nnx.Rngs(0))
    for target in (Fused(nnx.Rngs(1)), EqxFused(jax.random.key(1))):
        ported = bridge.port(source, target, check=X)
        assert bridge.compare(source, ported, X) < 1e-5
        back = bridge.port(ported, PerHead(nnx.Rngs(2)), check=X)
        assert bridge.compare(source, back, X) < 1e-5


def test_linen_dense_general_without_bias_into_fused_nnx():
    """Without a module or a bias, a Linen kernel `(D, H, hd)` has Flax's default
    one input axis."""
    module = LinenPerHead()
    source = (module, module.init(jax.random.key(0), X))
    ported = bridge.port(source, Fused(nnx.Rngs(1)), check=X)
    assert bridge.compare(source, ported, X) < 1e-5


class EinsumQuery(nn.Module):
    """An Einsum kernel `(H, D, hd)` (heads first, Gemma's einsum order): its input
    axis is 1, not the first. `spec` may put the result's axes in another order."""

    heads: int = 4
    spec: str = "btd,ndh->btnh"

    @nn.compact
    def __call__(self, x):
        y = nn.Einsum((self.heads, x.shape[-1], HD), self.spec, use_bias=False)(x)
        return y.reshape(*y.shape[:2], -1)


H2 = 4  # heads = features: every axis of the kernel could be the input one


class FusedQuery(nnx.Module):
    def __init__(self, rngs, heads=H2, features=H2):
        self.q_proj = nnx.Linear(features, heads * HD, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.q_proj(x)


class EqxQuery(eqx.Module):
    q_proj: eqx.nn.Linear

    def __init__(self, key, heads=H2, features=H2):
        self.q_proj = eqx.nn.Linear(features, heads * HD, use_bias=False, key=key)

    def __call__(self, x):
        """`x`: one example `(T, D)`."""
        return jax.vmap(self.q_proj)(x)


def _query(heads=H2, features=H2, spec="btd,ndh->btnh"):
    x = jax.random.normal(jax.random.key(0), (2, 3, features))
    module = EinsumQuery(heads, spec)
    return x, (module, module.init(jax.random.key(1), x))


def test_a_per_head_kernel_whose_axes_shapes_cannot_tell_is_refused():
    """`(H, D, hd)` with `H = D = hd`: any axis could meet the input, every reading
    fits the fused kernel's shapes. Without example inputs nothing decides: refused
    (it ported silently wrong before: largest output difference 1.18)."""
    x, source = _query()
    for target in (FusedQuery(nnx.Rngs(0)), EqxQuery(jax.random.key(0))):
        with pytest.raises(
            bridge.PortError,
            match=r"ambiguous: \.Einsum_0 \(per-head kernel \(4, 4, 4\)\) pairs with "
            r"\.q_proj .* inputs \(1,\), outputs \(0, 2\).*example=",
        ):
            bridge.port(source, target)


@pytest.mark.parametrize("spec", ["btd,ndh->btnh", "btd,ndh->bthn"])
def test_a_per_head_kernel_is_read_by_the_trace_both_ways(spec):
    """With example inputs the forward pass says which axis meets the input (1)
    and in which order the result holds the others (`bthn`: heads last): the port
    is exact into NNX and Equinox, and back into the Einsum model."""
    x, source = _query(spec=spec)
    for target in (FusedQuery(nnx.Rngs(0)), EqxQuery(jax.random.key(0))):
        ported = bridge.port(source, target, example=x)
        assert bridge.compare(source, ported, x) < 1e-6
        module, variables = source
        blank = (module, jax.tree.map(jnp.zeros_like, variables))
        back = bridge.port(ported, blank, example=x)
        assert bridge.compare(source, back, x) < 1e-6


def test_load_reads_a_per_head_kernel_with_example_inputs(tmp_path):
    """A fused file into an Einsum model whose `(H, D, hd)` kernel the shapes cannot
    read: `bridge.load(like=)` refuses it, and with `example=` the target's forward
    pass decides (the file itself cannot run): exact."""
    x, source = _query()
    path = tmp_path / "fused.safetensors"
    bridge.save(path, bridge.port(source, FusedQuery(nnx.Rngs(0)), example=x))
    module, variables = source
    blank = (module, jax.tree.map(jnp.zeros_like, variables))
    with pytest.raises(bridge.PortError, match=r"per-head kernel \(4, 4, 4\)"):
        bridge.load(path, like=blank)
    loaded = bridge.load(path, like=blank, example=x)
    assert bridge.compare(source, loaded, x) == 0.0


def test_a_per_head_kernel_whose_shapes_decide_ports_without_example():
    """`(H, D, hd) = (3, 8, 4)` into a fused `(8, 12)`: only axis 1 as the input
    gives those shapes, so no example is needed (the reading is that one)."""
    x, source = _query(heads=3, features=8)
    ported = bridge.port(source, FusedQuery(nnx.Rngs(0), heads=3, features=8))
    assert bridge.compare(source, ported, x) < 1e-6


class NamedPerHead(nn.Module):
    """MaxText's projections: `DenseGeneral` under its own names, no bias, `D = H *
    hd`, so `(D, H, hd)` also reads as `(H * hd) -> D`. `auto` leaves Flax's auto-name
    (`DenseGeneral_0`), which says inputs come first."""

    auto: bool = False

    @nn.compact
    def __call__(self, x):
        name = None if self.auto else "q_proj"
        y = nn.DenseGeneral((H, HD), use_bias=False, name=name)(x)
        return y.reshape(*y.shape[:-2], H * HD)


def test_a_dense_general_under_its_own_name_needs_the_trace_when_d_is_h_times_hd():
    module = NamedPerHead()
    source = (module, module.init(jax.random.key(0), X))
    target = FusedQuery(nnx.Rngs(0), heads=H, features=D)
    with pytest.raises(bridge.PortError, match=r"ambiguous: \.q_proj .*example="):
        bridge.port(source, target)
    ported = bridge.port(source, target, example=X)
    assert bridge.compare(source, ported, X) < 1e-6
    auto = NamedPerHead(auto=True)
    source = (auto, source[1]["params"]["q_proj"])
    source = (auto, {"params": {"DenseGeneral_0": source[1]}})
    ported = bridge.port(source, target)  # the class says: inputs first
    assert bridge.compare(source, ported, X) < 1e-6


class ScannedQuery(nn.Module):
    """A MaxText-style stack of Einsum queries (`nn.scan`, params' layer axis 1)."""

    @nn.compact
    def __call__(self, x):
        class Layer(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                y = EinsumQuery(name="attn")(nn.RMSNorm(name="norm")(h))
                return h + y[..., : h.shape[-1]], None

        scan = nn.scan(
            Layer,
            variable_axes={"params": 1},
            split_rngs={"params": True},
            length=2,
        )
        return scan(name="layers")(x, None)[0]


class NormQuery(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(H2, rngs=rngs)
        self.q_proj = nnx.Linear(H2, H2 * HD, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return x + self.q_proj(self.norm(x))[..., : x.shape[-1]]


class LoopQuery(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([NormQuery(rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_stack_of_per_head_kernels_is_read_by_the_trace_through_the_scan():
    """The layout check over stacks: the scan's slices of `(H, L, D, hd)` kernels
    are traced as stored (the layer axis dropped), so the stack's layers read
    right with example inputs, and are refused without."""
    x = jax.random.normal(jax.random.key(0), (2, 3, H2))
    module = ScannedQuery()
    source = (module, module.init(jax.random.key(1), x))
    kernel = source[1]["params"]["layers"]["attn"]["Einsum_0"]["kernel"]
    assert kernel.shape == (H2, 2, H2, HD)
    with pytest.raises(
        bridge.PortError, match=r"ambiguous: \.layers\[0\]\.attn\.Einsum_0 \(per-head"
    ):
        bridge.port(source, LoopQuery(nnx.Rngs(0)))
    ported = bridge.port(source, LoopQuery(nnx.Rngs(0)), example=x)
    assert bridge.compare(source, ported, x) < 1e-6
