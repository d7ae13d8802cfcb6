"""Twins of Haiku's own models, written in the other frameworks as their users write
them (torchvision-free PyTorch): `hk.nets.ResNet18` (v1: a 7x7 stem with "SAME"
padding, max pool, four groups of two blocks, a projection on the first block of
groups 1 to 3, BatchNorm decay 0.9 and eps 1e-5) and a pre-norm transformer made of
Haiku's modules (`hk.Embed`, `hk.MultiHeadAttention`, `hk.LayerNorm`, `hk.Linear`).
The twins name their layers as torchvision and PyTorch users do (`conv1`, `bn1`,
`layer1`, `downsample`), compute the main path before the shortcut (Haiku the
shortcut first), and share no name with Haiku's: a port pairs them by what they
compute."""

from functools import partial

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


CHANNELS = (64, 128, 256, 512)
STRIDES = (1, 2, 2, 2)
CLASSES = 5
DECAY, EPS = 0.9, 1e-5
SHORTCUT_FIRST = False


def blocks():
    """`(in, out, stride, projection)` of ResNet18's eight blocks, in order."""
    out, cin = [], 64
    for group, (cout, stride) in enumerate(zip(CHANNELS, STRIDES)):
        for i in range(2):
            out.append((cin, cout, stride if i == 0 else 1, i == 0 and group > 0))
            cin = cout
    return out


def image(batch: int = 2, size: int = 16) -> jax.Array:
    return jax.random.normal(jax.random.key(7), (batch, size, size, 3))


def max_pool(x):
    """3x3, stride 2, "SAME" (pads with -inf), channel-last: Haiku's `hk.max_pool`."""
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")


# --- NNX ---


class NNXBlock(nnx.Module):
    def __init__(self, cin, cout, stride, project, rngs):
        conv = partial(nnx.Conv, padding="SAME", use_bias=False, rngs=rngs)
        norm = partial(nnx.BatchNorm, momentum=DECAY, epsilon=EPS, rngs=rngs)
        self.conv1 = conv(cin, cout, (3, 3), (stride, stride))
        self.bn1 = norm(cout)
        self.conv2 = conv(cout, cout, (3, 3))
        self.bn2 = norm(cout)
        self.downsample = (
            nnx.List([conv(cin, cout, (1, 1), (stride, stride)), norm(cout)])
            if project
            else None
        )

    def __call__(self, x):
        if SHORTCUT_FIRST and self.downsample is not None:
            x, y = self.downsample[1](self.downsample[0](x)), x
            y = self.bn2(self.conv2(nnx.relu(self.bn1(self.conv1(y)))))
            return nnx.relu(x + y)
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.downsample is not None:
            x = self.downsample[1](self.downsample[0](x))
        return nnx.relu(x + y)


class NNXResNet18(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(
            3, 64, (7, 7), (2, 2), padding="SAME", use_bias=False, rngs=rngs
        )
        self.bn1 = nnx.BatchNorm(64, momentum=DECAY, epsilon=EPS, rngs=rngs)
        self.layers = nnx.List([NNXBlock(*b, rngs=rngs) for b in blocks()])
        self.fc = nnx.Linear(512, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = max_pool(nnx.relu(self.bn1(self.conv1(x))))
        for block in self.layers:
            x = block(x)
        return self.fc(jnp.mean(x, axis=(1, 2)))


# --- Linen ---


class LinenBlock(nn.Module):
    cout: int
    stride: int
    project: bool

    @nn.compact
    def __call__(self, x, train: bool = False):
        conv = partial(nn.Conv, padding="SAME", use_bias=False)
        norm = partial(
            nn.BatchNorm, use_running_average=not train, momentum=DECAY, epsilon=EPS
        )
        s = (self.stride, self.stride)
        shortcut = x
        if self.project and SHORTCUT_FIRST:
            shortcut = norm(name="down_bn")(
                conv(self.cout, (1, 1), s, name="down_conv")(x)
            )
        y = nn.relu(norm(name="bn1")(conv(self.cout, (3, 3), s, name="conv1")(x)))
        y = norm(name="bn2")(conv(self.cout, (3, 3), name="conv2")(y))
        if self.project and not SHORTCUT_FIRST:
            shortcut = norm(name="down_bn")(
                conv(self.cout, (1, 1), s, name="down_conv")(x)
            )
        return nn.relu(shortcut + y)


class LinenResNet18(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(64, (7, 7), (2, 2), padding="SAME", use_bias=False, name="conv1")(x)
        x = nn.BatchNorm(
            use_running_average=not train, momentum=DECAY, epsilon=EPS, name="bn1"
        )(x)
        x = max_pool(nn.relu(x))
        for i, (_, cout, stride, project) in enumerate(blocks()):
            x = LinenBlock(cout, stride, project, name=f"layer_{i}")(x, train)
        return nn.Dense(CLASSES, name="fc")(jnp.mean(x, axis=(1, 2)))


# --- Equinox (channel first, statistics in eqx.nn.State) ---


class EqxBlock(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: eqx.nn.BatchNorm
    downsample: tuple | None

    def __init__(self, cin, cout, stride, project, key):
        k = jax.random.split(key, 3)
        conv = partial(eqx.nn.Conv2d, padding="SAME", use_bias=False)
        norm = partial(
            eqx.nn.BatchNorm, axis_name="batch", momentum=DECAY, eps=EPS, mode="ema"
        )
        self.conv1 = conv(cin, cout, 3, stride, key=k[0])
        self.bn1 = norm(cout)
        self.conv2 = conv(cout, cout, 3, 1, key=k[1])
        self.bn2 = norm(cout)
        self.downsample = (
            (conv(cin, cout, 1, stride, key=k[2]), norm(cout)) if project else None
        )

    def __call__(self, x, state):
        shortcut = x
        if self.downsample is not None and SHORTCUT_FIRST:
            conv, norm = self.downsample
            shortcut, state = norm(conv(x), state)
        y, state = self.bn1(self.conv1(x), state)
        y, state = self.bn2(self.conv2(jax.nn.relu(y)), state)
        if self.downsample is not None and not SHORTCUT_FIRST:
            conv, norm = self.downsample
            shortcut, state = norm(conv(x), state)
        return jax.nn.relu(shortcut + y), state


class EqxResNet18(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    layers: list
    fc: eqx.nn.Linear
    channel_first = True

    def __init__(self, key):
        keys = jax.random.split(key, 10)
        self.conv1 = eqx.nn.Conv2d(
            3, 64, 7, 2, padding="SAME", use_bias=False, key=keys[0]
        )
        self.bn1 = eqx.nn.BatchNorm(64, "batch", momentum=DECAY, eps=EPS, mode="ema")
        self.layers = [EqxBlock(*b, key=k) for b, k in zip(blocks(), keys[2:])]
        self.fc = eqx.nn.Linear(512, CLASSES, key=keys[1])

    def __call__(self, x, state):
        """`x`: one example, `(C, H, W)`."""
        x, state = self.bn1(self.conv1(x), state)
        x = jnp.moveaxis(max_pool(jnp.moveaxis(jax.nn.relu(x), 0, -1)), -1, 0)
        for block in self.layers:
            x, state = block(x, state)
        return self.fc(jnp.mean(x, axis=(1, 2))), state


def equinox_resnet18(seed: int = 1):
    return eqx.nn.make_with_state(EqxResNet18)(jax.random.key(seed))


# --- PyTorch (torchvision-free; "SAME" padding written out) ---


def torch_resnet18():
    """A PyTorch ResNet18 computing Haiku's, as a torchvision user would write it
    with TensorFlow's "SAME" padding (`F.pad` before each strided op)."""
    import torch
    import torch.nn.functional as F
    from torch import nn as tnn

    def same(x, k, s, value=0.0):
        pads = []
        for size in reversed(x.shape[2:]):
            total = max((-(-size // s) - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return F.pad(x, pads, value=value)

    class Conv(tnn.Conv2d):
        def __init__(self, cin, cout, k, s=1):
            super().__init__(cin, cout, k, s, bias=False)

        def forward(self, x):
            return super().forward(same(x, self.kernel_size[0], self.stride[0]))

    def norm(c):
        return tnn.BatchNorm2d(c, eps=EPS, momentum=1 - DECAY)

    class Block(tnn.Module):
        def __init__(self, cin, cout, stride, project):
            super().__init__()
            self.conv1, self.bn1 = Conv(cin, cout, 3, stride), norm(cout)
            self.conv2, self.bn2 = Conv(cout, cout, 3), norm(cout)
            self.downsample = (
                tnn.Sequential(Conv(cin, cout, 1, stride), norm(cout))
                if project
                else None
            )

        def forward(self, x):
            shortcut = x
            if self.downsample is not None and SHORTCUT_FIRST:
                shortcut = self.downsample(x)
            y = F.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            if self.downsample is not None and not SHORTCUT_FIRST:
                shortcut = self.downsample(x)
            return F.relu(shortcut + y)

    class ResNet18(tnn.Module):
        """Takes Haiku's channel-last images (bridge's torch trace passes the
        example inputs as they are: the team's notes on Haiku and Keras, outside
        this repository)."""

        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = Conv(3, 64, 7, 2), norm(64)
            self.layers = tnn.ModuleList([Block(*b) for b in blocks()])
            self.fc = tnn.Linear(512, CLASSES)

        def forward(self, x):
            x = F.relu(self.bn1(self.conv1(x.permute(0, 3, 1, 2))))
            x = F.max_pool2d(same(x, 3, 2, value=float("-inf")), 3, 2)
            for block in self.layers:
                x = block(x)
            return self.fc(x.mean(dim=(2, 3)))

    torch.manual_seed(0)
    return ResNet18().eval()


def randomised(tree_like, seed: int = 0):
    """Numpy-random values of the shapes of a pytree (variances in [0.5, 1.5))."""
    rng = np.random.default_rng(seed)

    def one(path, s):
        name = jax.tree_util.keystr(path)
        if jnp.issubdtype(s.dtype, jnp.integer):
            return jnp.full(s.shape, 3, s.dtype)
        if "var" in name:
            return jnp.asarray(rng.uniform(0.5, 1.5, s.shape), s.dtype)
        return jnp.asarray(0.2 * rng.standard_normal(s.shape), s.dtype)

    return jax.tree_util.tree_map_with_path(one, tree_like)


# --- a transformer of Haiku's modules, and its twins ---

VOCAB, SEQ, D, HEADS, DEPTH = 32, 6, 16, 2, 2


def tokens(batch: int = 2) -> jax.Array:
    return jax.random.randint(jax.random.key(8), (batch, SEQ), 0, VOCAB)


def causal() -> jax.Array:
    return jnp.tril(jnp.ones((1, 1, SEQ, SEQ), bool))


def haiku_lm(ids):
    """A pre-norm decoder made of Haiku's own modules: `hk.Embed`, a learned position
    table, `hk.MultiHeadAttention`, `hk.LayerNorm`, `hk.Linear` (gelu MLP), an
    untied head."""
    import haiku as hk

    norm = partial(hk.LayerNorm, axis=-1, create_scale=True, create_offset=True)
    x = hk.Embed(VOCAB, D)(ids)
    positions = hk.get_parameter(
        "positions", [SEQ, D], init=hk.initializers.RandomNormal()
    )
    x = x + positions[None]
    for _ in range(DEPTH):
        h = norm()(x)
        x = x + hk.MultiHeadAttention(
            HEADS, D // HEADS, model_size=D, w_init=hk.initializers.VarianceScaling()
        )(h, h, h, mask=causal())
        h = norm()(x)
        x = x + hk.Linear(D)(jax.nn.gelu(hk.Linear(4 * D)(h)))
    return hk.Linear(VOCAB)(norm()(x))


class NNXDecoderLayer(nnx.Module):
    def __init__(self, rngs):
        self.attn_norm = nnx.LayerNorm(D, epsilon=EPS, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(D, epsilon=EPS, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x), mask=causal())
        return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class NNXLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.positions = nnx.Param(jax.random.normal(rngs.params(), (SEQ, D)))
        self.layers = nnx.List([NNXDecoderLayer(rngs) for _ in range(DEPTH)])
        self.norm = nnx.LayerNorm(D, epsilon=EPS, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids) + self.positions[...][None]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D, name="embed")(ids)
        x = x + self.param("positions", nn.initializers.normal(1.0), (SEQ, D))[None]
        for i in range(DEPTH):
            h = nn.LayerNorm(epsilon=EPS, name=f"attn_norm_{i}")(x)
            x = x + nn.MultiHeadDotProductAttention(HEADS, name=f"attn_{i}")(
                h, mask=causal()
            )
            h = nn.LayerNorm(epsilon=EPS, name=f"mlp_norm_{i}")(x)
            h = nn.Dense(4 * D, name=f"up_{i}")(h)
            x = x + nn.Dense(D, name=f"down_{i}")(nn.gelu(h))
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm(epsilon=EPS, name="norm")(x))


class EqxDecoderLayer(eqx.Module):
    attn_norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.attn_norm = eqx.nn.LayerNorm(D, eps=EPS)
        self.attn = eqx.nn.MultiheadAttention(
            HEADS, D, use_query_bias=True, use_key_bias=True, use_value_bias=True,
            use_output_bias=True, key=k[0],
        )  # fmt: skip
        self.mlp_norm = eqx.nn.LayerNorm(D, eps=EPS)
        self.up = eqx.nn.Linear(D, 4 * D, key=k[1])
        self.down = eqx.nn.Linear(4 * D, D, key=k[2])

    def __call__(self, x):
        h = jax.vmap(self.attn_norm)(x)
        x = x + self.attn(h, h, h, mask=causal()[0, 0])
        h = jax.vmap(self.mlp_norm)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class EqxLM(eqx.Module):
    embed: eqx.nn.Embedding
    positions: jax.Array
    layers: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, DEPTH + 3)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=k[0])
        self.positions = jax.random.normal(k[1], (SEQ, D))
        self.layers = [EqxDecoderLayer(kk) for kk in k[3:]]
        self.norm = eqx.nn.LayerNorm(D, eps=EPS)
        self.head = eqx.nn.Linear(D, VOCAB, key=k[2])

    def __call__(self, ids):
        """`ids`: one sequence, `(SEQ,)`."""
        x = jax.vmap(self.embed)(ids) + self.positions
        for layer in self.layers:
            x = layer(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def torch_lm():
    """The decoder in PyTorch as Hugging Face writes attention: separate `q_proj`,
    `k_proj`, `v_proj`, `o_proj` linears."""
    import torch
    import torch.nn.functional as F
    from torch import nn as tnn

    class Attention(tnn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = tnn.Linear(D, D), tnn.Linear(D, D)
            self.v_proj, self.o_proj = tnn.Linear(D, D), tnn.Linear(D, D)

        def forward(self, x):
            b, t, _ = x.shape
            split = lambda y: y.view(b, t, HEADS, D // HEADS).transpose(1, 2)  # noqa: E731
            q, k, v = (
                split(self.q_proj(x)),
                split(self.k_proj(x)),
                split(self.v_proj(x)),
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, t, D))

    class Layer(tnn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.attn = tnn.LayerNorm(D, eps=EPS), Attention()
            self.mlp_norm = tnn.LayerNorm(D, eps=EPS)
            self.up, self.down = tnn.Linear(D, 4 * D), tnn.Linear(4 * D, D)

        def forward(self, x):
            x = x + self.attn(self.attn_norm(x))
            return x + self.down(F.gelu(self.up(self.mlp_norm(x)), approximate="tanh"))

    class LM(tnn.Module):
        def __init__(self):
            super().__init__()
            self.embed = tnn.Embedding(VOCAB, D)
            self.positions = tnn.Parameter(torch.randn(SEQ, D))
            self.layers = tnn.ModuleList([Layer() for _ in range(DEPTH)])
            self.norm, self.head = tnn.LayerNorm(D, eps=EPS), tnn.Linear(D, VOCAB)

        def forward(self, ids):
            x = self.embed(ids) + self.positions
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return LM().eval()
