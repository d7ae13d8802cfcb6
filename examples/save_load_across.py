"""Save a model from one framework, load it into the others.

An NNX model is saved as safetensors (readable by any framework: the keys are dotted
paths, the metadata records each array's role) and loaded into Equinox and Linen
twins; an Equinox model is saved as an orbax checkpoint and loaded into NNX. Each
loaded model gives the same outputs as the saved one.
"""

import json
import tempfile
from pathlib import Path

import equinox as eqx
import flax.linen as nn
import jax
import safetensors
from flax import nnx

import bridge


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):  # x: (N, H, W, C)
        x = jax.nn.relu(self.bn(self.conv(x)))
        return self.head(x.mean(axis=(1, 2)))


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = jax.nn.relu(
            nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x))
        )
        return nn.Dense(10)(x.mean(axis=(1, 2)))


class EquinoxNet(eqx.Module):
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    head: eqx.nn.Linear
    channel_first = True  # bridge.compare feeds it (C, H, W) examples

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 8, 3, padding="SAME", key=k1)
        self.bn = eqx.nn.BatchNorm(8, "batch", eps=1e-5, momentum=0.99, mode="batch")
        self.head = eqx.nn.Linear(8, 10, key=k2)

    def __call__(self, x, state):  # x: (C, H, W)
        x, state = self.bn(self.conv(x), state)
        return self.head(jax.nn.relu(x).mean(axis=(1, 2))), state


def main():
    x = jax.random.normal(jax.random.key(0), (4, 16, 16, 3))
    source = NNXNet(nnx.Rngs(0))
    source.bn.mean[...] = jax.random.normal(
        jax.random.key(1), (8,)
    )  # non-trivial stats
    directory = Path(tempfile.mkdtemp())

    path = directory / "net.safetensors"
    bridge.save(path, source, metadata={"epoch": "3"})
    with safetensors.safe_open(path, framework="numpy") as f:  # no bridge needed
        meta = f.metadata()
        print(f"{path.name}: keys {sorted(f.keys())}")
    roles = {k: v["role"] for k, v in json.loads(meta["tensors"]).items()}
    print(f"  framework {meta['framework']}, layout {meta['layout']}, roles {roles}")

    equinox = bridge.load(
        path, like=eqx.nn.make_with_state(EquinoxNet)(jax.random.key(2))
    )
    diff = bridge.compare(source, equinox, x)
    print(f"NNX -> file -> Equinox:  max |difference| {diff:.1e}")
    module = LinenNet()
    linen = bridge.load(path, like=(module, module.init(jax.random.key(3), x)))
    diff = bridge.compare(source, linen, x)
    print(f"NNX -> file -> Linen:    max |difference| {diff:.1e}")

    ckpt = directory / "net_orbax"
    bridge.save(ckpt, equinox)
    back = bridge.load(ckpt, like=NNXNet(nnx.Rngs(4)))
    diff = bridge.compare(equinox, back, x)
    print(f"Equinox -> orbax -> NNX: max |difference| {diff:.1e}")


if __name__ == "__main__":
    main()
