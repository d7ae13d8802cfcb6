"""Port an NNX transformer block into its Linen twin and compare their outputs.

NNX attribute names (`embed`, `attn`, ...) and Linen auto-names (`Embed_0`,
`MultiHeadDotProductAttention_0`, ...) differ; layers pair by kind, shape and
definition order.
"""

import flax.linen as nn
import jax
from flax import nnx

import bridge


VOCAB, D, HEADS = 50, 16, 4


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.out = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.norm(x))
        return self.out(x)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D)(ids)
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(h)
        return nn.Dense(VOCAB)(x)


def main():
    ids = jax.random.randint(jax.random.key(0), (2, 7), 0, VOCAB)
    source = NNXBlock(nnx.Rngs(0))
    module = LinenBlock()
    target = (module, module.init(jax.random.key(1), ids))
    print(bridge.port_plan(source, target))
    before = bridge.compare(source, target, ids)
    ported = bridge.port(source, target)
    after = bridge.compare(source, ported, ids)
    print(f"\nmax |nnx - linen| before the port: {before:.3g}")
    print(f"max |nnx - linen| after the port:  {after:.3g}")
    assert after < 1e-5


if __name__ == "__main__":
    main()
