"""ResNet-18 written three ways, as their codebases write it: Flax's ImageNet example
(`examples/imagenet/models.py`: `ResNetBlock` with auto-named `Conv_0, BatchNorm_0,
Conv_1, BatchNorm_1` and `conv_proj, norm_proj`), and NNX and Equinox ResNets whose
blocks name their layers `conv1, bn1, conv2, bn2, proj_conv, proj_bn`. Tiny widths."""

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


STAGES = (2, 2, 2, 2)
FILTERS = 2
CLASSES = 3


def image(batch: int = 2) -> jax.Array:
    return jax.random.normal(jax.random.key(9), (batch, 8, 8, 3))


# --- Flax ImageNet example (examples/imagenet/models.py), verbatim but for widths ----


class ResNetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(
                residual
            )
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int]
    block_cls: Any
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable = nn.relu
    conv: Any = nn.Conv

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = partial(self.conv, use_bias=False, dtype=self.dtype)
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name="batch",
        )
        x = conv(
            self.num_filters,
            (7, 7),
            (2, 2),
            padding=[(3, 3), (3, 3)],
            name="conv_init",
        )(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(
                    self.num_filters * 2**i,
                    strides=strides,
                    conv=conv,
                    norm=norm,
                    act=self.act,
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


ResNet18 = partial(ResNet, stage_sizes=STAGES, block_cls=ResNetBlock)


def linen_resnet(seed: int = 0):
    """`(module, module.init(...))`, as the example's `initialized` makes them."""
    module = ResNet18(num_classes=CLASSES, num_filters=FILTERS)
    variables = module.init({"params": jax.random.key(seed)}, image(1), train=False)
    return module, variables


def _widths():
    """`(in, out, strides)` of every block, in order."""
    out, cin = [], FILTERS
    for i, size in enumerate(STAGES):
        for j in range(size):
            cout = FILTERS * 2**i
            out.append((cin, cout, (2, 2) if i > 0 and j == 0 else (1, 1)))
            cin = cout
    return out


# --- NNX ---------------------------------------------------------------------


class NNXBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, strides, rngs: nnx.Rngs):
        conv = partial(nnx.Conv, use_bias=False, rngs=rngs)
        norm = partial(nnx.BatchNorm, momentum=0.9, epsilon=1e-5, rngs=rngs)
        self.conv1 = conv(cin, cout, (3, 3), strides)
        self.bn1 = norm(cout)
        self.conv2 = conv(cout, cout, (3, 3))
        self.bn2 = norm(cout)
        self.project = cin != cout or strides != (1, 1)
        if self.project:
            self.proj_conv = conv(cin, cout, (1, 1), strides)
            self.proj_bn = norm(cout)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.project:
            x = self.proj_bn(self.proj_conv(x))
        return nnx.relu(x + y)


class NNXResNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.stem = nnx.Conv(
            3, FILTERS, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
            rngs=rngs,
        )  # fmt: skip
        self.stem_bn = nnx.BatchNorm(FILTERS, momentum=0.9, epsilon=1e-5, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(*w, rngs=rngs) for w in _widths()])
        self.head = nnx.Linear(_widths()[-1][1], CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.stem_bn(self.stem(x)))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


# --- Equinox (channel-first, statistics in eqx.nn.State) -----------------------


class EqxBlock(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: eqx.nn.BatchNorm
    proj_conv: eqx.nn.Conv2d | None
    proj_bn: eqx.nn.BatchNorm | None

    def __init__(self, cin: int, cout: int, strides, key: jax.Array):
        k = jax.random.split(key, 3)
        norm = partial(eqx.nn.BatchNorm, axis_name="batch", momentum=0.9, eps=1e-5)
        self.conv1 = eqx.nn.Conv2d(cin, cout, 3, strides, 1, use_bias=False, key=k[0])
        self.bn1 = norm(cout, mode="batch")
        self.conv2 = eqx.nn.Conv2d(cout, cout, 3, 1, 1, use_bias=False, key=k[1])
        self.bn2 = norm(cout, mode="batch")
        project = cin != cout or strides != (1, 1)
        self.proj_conv = (
            eqx.nn.Conv2d(cin, cout, 1, strides, use_bias=False, key=k[2])
            if project
            else None
        )
        self.proj_bn = norm(cout, mode="batch") if project else None

    def __call__(self, x, state):
        y, state = self.bn1(self.conv1(x), state)
        y, state = self.bn2(self.conv2(jax.nn.relu(y)), state)
        if self.proj_conv is not None and self.proj_bn is not None:
            x, state = self.proj_bn(self.proj_conv(x), state)
        return jax.nn.relu(x + y), state


class EqxResNet(eqx.Module):
    stem: eqx.nn.Conv2d
    stem_bn: eqx.nn.BatchNorm
    blocks: list[EqxBlock]
    head: eqx.nn.Linear
    channel_first = True

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, len(_widths()) + 2)
        self.stem = eqx.nn.Conv2d(3, FILTERS, 7, 2, 3, use_bias=False, key=keys[0])
        self.stem_bn = eqx.nn.BatchNorm(
            FILTERS, "batch", momentum=0.9, eps=1e-5, mode="batch"
        )
        self.blocks = [EqxBlock(*w, key=k) for w, k in zip(_widths(), keys[2:])]
        self.head = eqx.nn.Linear(_widths()[-1][1], CLASSES, key=keys[1])

    def __call__(self, x, state):
        """`x`: one example, channel-first `(C, H, W)`."""
        x, state = self.stem_bn(self.stem(x), state)
        x = jax.nn.relu(x)
        x = jnp.moveaxis(x, 0, -1)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = jnp.moveaxis(x, -1, 0)
        for block in self.blocks:
            x, state = block(x, state)
        return self.head(jnp.mean(x, axis=(1, 2))), state


def equinox_resnet(seed: int = 1):
    return eqx.nn.make_with_state(EqxResNet)(jax.random.key(seed))
