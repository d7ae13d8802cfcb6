"""A Linen forward pass traced once per repeated block (`bridge/_adapters/
_linen_blocks.py`): the port's trace of a model of identical blocks runs each block's
Python once or twice, not once per block, and reads the same facts as the plain pass:
positions, contractions, the submodules called."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import bridge
from bridge._adapters import _registry
from bridge._adapters._linen import _called
from bridge._port._trace import Example, Trace


CALLS = []


class Block(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, scale=1.0):
        CALLS.append(self.name)
        h = nn.Dense(2 * self.features, name="up")(x)
        return x + scale * nn.Dense(self.features, use_bias=False, name="down")(
            nn.gelu(h)
        )


class Deep(nn.Module):
    depth: int = 6

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="embed")(x)
        for i in range(self.depth):
            # the last block is another computation: a setting of its own
            x = Block(4 if i < self.depth - 1 else 4, name=f"block_{i}")(
                x, 0.5 if i == self.depth - 1 else 1.0
            )
        return nn.LayerNorm(name="norm")(x)


def _tree():
    module = Deep()
    variables = module.init(jax.random.key(0), jnp.ones((2, 3)))
    return module, variables, bridge.from_linen(variables, module)


def _plain(run):
    """`_called` without the block cache: every module run as it is."""
    seen = {}

    def record(method, args, kwargs, context):
        if context.module.scope is not None:
            seen.setdefault(tuple(context.module.scope.path), context.module)
        return method(*args, **kwargs)

    with nn.intercept_methods(record):
        out = run()
    return out, seen


def test_repeated_blocks_are_traced_once_and_read_alike(monkeypatch):
    module, variables, tree = _tree()
    example = Example((jax.ShapeDtypeStruct((2, 3), jnp.float32),), None)
    CALLS.clear()
    cached = Trace(tree, example, 0, [])
    positions = dict(cached())
    # block_0 plainly, block_1 traced in its jit, block_2..4 from the cache; the
    # last block's `scale` differs: a computation of its own
    assert CALLS == ["block_0", "block_1", "block_5"], CALLS
    adapter = _registry.adapter_named("linen")
    monkeypatch.setitem(_registry._ADAPTERS, "linen", adapter._replace(called=_plain))
    CALLS.clear()
    plain = Trace(tree, example, 0, [])
    uses = dict(plain())
    assert len(CALLS) == 6
    order = lambda uses: sorted(uses, key=uses.get)  # noqa: E731
    assert order(positions) == order(uses)
    assert cached.contractions() == plain.contractions()
    assert set(cached.modules()) == set(plain.modules())
    assert type(cached.modules()[("block_3", "down")]) is nn.Dense


def test_outputs_through_the_cache_equal_the_plain_pass():
    module, variables, _ = _tree()
    x = jnp.arange(6.0).reshape(2, 3)
    out, seen = _called(lambda: module.apply(variables, x))
    np.testing.assert_array_equal(out, module.apply(variables, x))
    assert ("block_4", "up") in seen
