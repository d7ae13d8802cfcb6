"""Nesting depth: models and files nested up to `MAX_DEPTH` keys work everywhere;
deeper ones are refused with one clear error, never a `RecursionError` half way."""

import equinox as eqx
import jax
import numpy as np
import pytest
import safetensors.numpy

import bridge
from bridge._paths import MAX_DEPTH

from .helpers import tree_equal_bits


def _linen(levels: int) -> dict:
    """`{"params": {"a": {"a": ... {"w": array}}}}`: the leaf's path has `levels` keys
    below the collection."""
    node: dict = {"w": np.arange(2, dtype=np.float32)}
    for _ in range(levels - 1):
        node = {"a": node}
    return {"params": node}


@pytest.mark.parametrize("name", ["m.safetensors", "m.msgpack", "m_orbax"])
def test_the_deepest_model_works_everywhere(tmp_path, name):
    variables = _linen(MAX_DEPTH)
    tree = bridge.from_linen(variables)
    assert tree_equal_bits(bridge.to_linen(tree), variables)
    assert "w float32[2]" in repr(tree)
    spec = bridge.trainable(tree, lambda t: t)
    assert jax.tree.structure(spec) == jax.tree.structure(tree)
    assert jax.tree.leaves(spec) == [True]
    bridge.save(tmp_path / name, tree)
    assert tree_equal_bits(bridge.to_native(bridge.load(tmp_path / name)), variables)
    assert tree_equal_bits(bridge.load(tmp_path / name, like=variables), variables)
    assert tree_equal_bits(bridge.port(tree, variables), variables)


class Box(eqx.Module):
    inner: object


def _nested_equinox(levels: int):
    model = np.ones(2, np.float32)
    for _ in range(levels):
        model = Box(model)
    return model


DEEPER = MAX_DEPTH + 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: bridge.from_linen(_linen(DEEPER)),
        lambda: bridge.from_equinox(_nested_equinox(DEEPER)),
        lambda: bridge.from_torch({"a." * (DEEPER - 1) + "w": np.ones(2)}),
    ],
    ids=["linen", "equinox", "torch"],
)
def test_a_deeper_model_is_refused_naming_the_limit(make):
    with pytest.raises(
        ValueError,
        match=rf"^\.(a|inner)\.\1\.\1\.\1\.\.\. is nested {DEEPER} levels deep; "
        rf"bridge handles at most {MAX_DEPTH} \(real models nest a few dozen\): "
        "flatten the structure",
    ):
        make()


def test_a_deeper_file_is_refused_as_unreadable(tmp_path):
    path = tmp_path / "deep.safetensors"
    safetensors.numpy.save_file({"a." * MAX_DEPTH + "w": np.ones(2)}, path)
    with pytest.raises(bridge.CheckpointError, match=f"over {MAX_DEPTH} of them"):
        bridge.load(path)
