"""A file keeps the order its model uses its layers: `bridge.save(path, model,
example=...)` traces the forward pass and records, in the metadata, the arrays in the
order of their first use. A Linen model's file (its variables are dicts: no creation
order survives) then loads into a rewrite with names of its own, created in another
order, given `example=` alone, as the live model would port. Without the record the
load is refused, and the message says what would decide."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import bridge

from .helpers import requires


pytestmark = requires("NNX")

X = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)


def _theirs():
    import flax.linen as nn

    class Theirs(nn.Module):  # the up projection is created after it is used
        @nn.compact
        def __call__(self, x):
            down = nn.Dense(4, name="down")
            h = nn.gelu(nn.Dense(4, name="up")(x))
            return down(nn.LayerNorm(name="mid")(h))

    module = Theirs()
    variables = module.init(jax.random.key(0), X)
    # sorted, as optax or flax serialisation leave them: no order survives
    variables = jax.tree.map(lambda a: a + 0.5, variables)
    return module, variables


class Mine(nnx.Module):  # names of its own, created in another order than used
    def __init__(self, rngs):
        self.proj_out = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.proj_in = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.proj_out(self.norm(jax.nn.gelu(self.proj_in(x))))


def _mine():
    return Mine(nnx.Rngs(1))


def test_linen_file_with_its_order_loads_into_a_rewrite(tmp_path):
    module, variables = _theirs()
    path = tmp_path / "theirs.safetensors"
    bridge.save(path, (module, variables), example=(X,))
    with safe_open(path, "np") as f:
        order = f.metadata()["order"]
    assert order == (
        '["up.kernel", "up.bias", "mid.scale", "mid.bias", "down.kernel", "down.bias"]'
    )
    mine = bridge.load(path, like=_mine(), example=(X,))
    want = module.apply(variables, X)
    np.testing.assert_array_equal(np.asarray(mine(X)), np.asarray(want))
    up = variables["params"]["up"]["kernel"]
    assert bool(jnp.all(mine.proj_in.kernel[...] == up))


def test_linen_file_without_order_is_refused_saying_what_decides(tmp_path):
    module, variables = _theirs()
    path = tmp_path / "theirs.safetensors"
    bridge.save(path, (module, variables))
    with pytest.raises(bridge.PortError, match="ambiguous") as error:
        bridge.load(path, like=_mine(), example=(X,))
    message = str(error.value)
    assert "the source has no forward pass to trace" in message
    assert "bridge.save(path, model, example=(x,))" in message


def test_nnx_file_into_a_rewrite_of_its_own_framework(tmp_path):
    """A file of the target's own framework whose names differ is ported when
    example inputs are given (without them, refused as not fitting)."""

    class Other(nnx.Module):
        def __init__(self, rngs):
            self.b = nnx.LayerNorm(4, rngs=rngs)
            self.c = nnx.Linear(4, 4, rngs=rngs)
            self.a = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return self.c(self.b(jax.nn.gelu(self.a(x))))

    source = bridge.port(_theirs(), _mine(), example=(X,))
    path = tmp_path / "mine.safetensors"
    bridge.save(path, source, example=(X,))
    with pytest.raises(ValueError, match="pass example= inputs"):
        bridge.load(path, like=Other(nnx.Rngs(2)))
    other = bridge.load(path, like=Other(nnx.Rngs(2)), example=(X,))
    np.testing.assert_array_equal(np.asarray(other(X)), np.asarray(source(X)))


def test_order_needs_a_model_that_runs(tmp_path):
    _, variables = _theirs()
    with pytest.raises(ValueError, match="Linen variables alone"):
        bridge.save(tmp_path / "v.safetensors", variables, example=(X,))
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_torch_layout_file_records_no_order(tmp_path):
    """layout="torch" has no metadata of bridge's: `example` there decides only the
    layouts the arrays leave open (none here); the file is PyTorch's plain one."""
    from safetensors import safe_open

    path = tmp_path / "t.safetensors"
    bridge.save_state_dict(path, _mine(), example=(X,))
    with safe_open(path, "np") as f:
        assert f.metadata() == {"format": "pt"}


def test_an_order_naming_no_array_is_refused(tmp_path):
    import json

    from safetensors.numpy import save_file

    module, variables = _theirs()
    path = tmp_path / "theirs.safetensors"
    bridge.save(path, (module, variables), example=(X,))
    with safe_open(path, "np") as f:
        meta = f.metadata()
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    meta["order"] = json.dumps(["up.kernel", "nowhere"])
    save_file(arrays, path, metadata=meta)
    with pytest.raises(
        bridge.CheckpointError, match="'order' metadata names 'nowhere'"
    ):
        bridge.load(path, like=_mine(), example=(X,))
