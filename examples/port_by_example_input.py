"""Port a Linen MLP-mixer-like block into an NNX rewrite whose layers have names of
their own, created in another order than they are used, with no rules: one example
input, and both forward passes (traced abstractly) pair the layers.

Without the example the port is refused: Linen variables are dicts, which keep no
creation order, and four `Dense` layers of one shape leave the choice open.
"""

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

import bridge


D = 8


class Theirs(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(D, name="token_in")(nn.LayerNorm(name="pre")(x)))
        x = x + nn.Dense(D, name="token_out")(h)
        h = nn.gelu(nn.Dense(D, name="channel_in")(nn.LayerNorm(name="post")(x)))
        return x + nn.Dense(D, name="channel_out")(h)


class Mine(nnx.Module):
    def __init__(self, rngs):
        self.mix_b = nnx.Linear(D, D, rngs=rngs)  # used last
        self.mix_a = nnx.Linear(D, D, rngs=rngs)
        self.up_b = nnx.Linear(D, D, rngs=rngs)
        self.up_a = nnx.Linear(D, D, rngs=rngs)  # used first
        self.norm_b = nnx.LayerNorm(D, rngs=rngs)
        self.norm_a = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x):
        x = x + self.mix_a(jax.nn.gelu(self.up_a(self.norm_a(x))))
        return x + self.mix_b(jax.nn.gelu(self.up_b(self.norm_b(x))))


def main():
    x = np.random.default_rng(0).normal(size=(2, D)).astype(np.float32)
    theirs = Theirs()
    variables = theirs.init(jax.random.key(0), x)
    variables = jax.tree.map(lambda a: a + 0.1, variables)  # no ones or zeros left

    try:
        bridge.port((theirs, variables), Mine(nnx.Rngs(1)))
        raise SystemExit("a port with nothing to pair the layers by went through")
    except bridge.PortError as error:
        print("without example inputs:", str(error).splitlines()[1][:100], "...")

    mine = bridge.port((theirs, variables), Mine(nnx.Rngs(1)), example=(x,))
    print(bridge.port_plan((theirs, variables), Mine(nnx.Rngs(1)), example=(x,)))
    difference = bridge.compare((theirs, variables), mine, x)
    print(f"largest difference of the outputs: {difference:.1e}")
    assert difference < 1e-5


if __name__ == "__main__":
    main()
