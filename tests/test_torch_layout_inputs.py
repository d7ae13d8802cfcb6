"""Hostile inputs to `save_state_dict`, `save_pretrained` and `bridge.from_torch`:
each is refused by a `ValueError` naming the argument, what was found and the fix, and
nothing is written."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import bridge

from .helpers import export, requires


def _linen():
    module = nn.Dense(3)
    return module, module.init(jax.random.key(0), jnp.ones((1, 2)))


class WithOptimizer(nnx.Module):
    """A training state as an NNX module: the model and its `nnx.Optimizer`."""

    def __init__(self):
        self.model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        self.optimizer = nnx.Optimizer(self.model, optax.adam(1e-3), wrt=nnx.Param)


def _training_states(arg="obj"):
    """`(what the refusal says it found, a training state)`; `arg`: the name of
    the argument the state was given as."""
    module, variables = _linen()
    adam = optax.adam(1e-3)
    linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    yield (
        f"TrainState at {arg}",
        train_state.TrainState.create(
            apply_fn=module.apply, params=variables["params"], tx=adam
        ),
    )
    yield f"Optimizer at {arg}", nnx.Optimizer(linear, adam, wrt=nnx.Param)
    yield f"ScaleByAdamState at {arg}\\[0\\]", adam.init(variables["params"])
    yield f"Optimizer at {arg}\\.optimizer", WithOptimizer()
    yield (
        f"ScaleByAdamState at {arg}\\[1\\]\\['opt_state'\\]\\[0\\]",
        (module, {**variables, "opt_state": adam.init(variables["params"])}),
    )
    mu = adam.init(variables["params"])[0].mu
    yield "the collection 'opt_state'", {**variables, "opt_state": {"mu": mu}}


@requires("NNX")
@pytest.mark.parametrize("name", ["m.safetensors", "folder"])
def test_a_training_state_is_refused_in_the_torch_layout(tmp_path, name):
    """Was: the Linen collection `opt_state` written as `mu.weight`, an NNX module
    holding its optimizer a raw TypeError, the others 'does not know how to
    convert'."""
    for found, state in _training_states("model"):
        with pytest.raises(
            ValueError,
            match=rf"(?s){name}: a PyTorch-layout export writes a model's arrays "
            rf"only.*holds a training state: {found}.*bridge\.save_training",
        ):
            export(tmp_path / name, state)
        assert list(tmp_path.iterdir()) == []


@requires("NNX")
@pytest.mark.parametrize("name", ["m.safetensors", "ckpt"])
def test_a_training_state_as_the_model_is_refused(tmp_path, name):
    """`save(path, optimizer)` in bridge's layout: was 'does not know how to
    convert', or for an NNX module holding its optimizer a raw `TypeError: tuple
    indices must be integers or slices, not str`. (A Linen collection of optax
    arrays is the model's own collection: saved.)"""
    for found, state in list(_training_states())[:-2]:
        with pytest.raises(
            ValueError,
            match=rf"(?s){name}: the model to save is or holds a training state: "
            rf"{found}.*bridge\.save_training\(path,\nmodel, optimizer",
        ):
            bridge.save(tmp_path / name, state)
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["m.safetensors", "folder"])
@pytest.mark.parametrize("dtype", ["complex128", "int4"])
def test_a_dtype_safetensors_cannot_store_is_named(tmp_path, name, dtype):
    """Was a raw `KeyError: 'complex128'` from the writer."""
    variables = {
        "params": {
            "Dense_0": {
                "kernel": np.zeros((2, 3), dtype),
                "bias": np.zeros(3, np.float32),
            }
        }
    }
    with pytest.raises(
        ValueError,
        match=rf"(?s){name}: a PyTorch-layout checkpoint is safetensors, which cannot "
        rf"store '\.Dense_0\.kernel' \({dtype}\)\.\nIt stores bfloat16, bool, .*float32"
        r".*Convert these arrays first",
    ):
        export(tmp_path / name, variables)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["m.safetensors", "folder"])
def test_a_rule_to_none_is_refused_by_name(tmp_path, name):
    """A rule that left layers out on import has nothing to name on export. Was a
    raw `TypeError: expected string or bytes-like object, got 'NoneType'`."""
    _, variables = _linen()
    rules = {r"fc\.(\d+)": r".Dense_\1", r"head": None, r"pool": None}
    with pytest.raises(
        ValueError,
        match=r"rules 'head', 'pool' leave the source layers they match out \(a "
        r"replacement None\), so\nthey cannot be read backwards for export",
    ):
        export(tmp_path / name, variables, rules=rules)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "array, dtype",
    [
        (np.array([1, "a"], dtype=object), "object"),
        (np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]), r"\[\('a', '<f4'\), "),
        (np.array(["ab", "c"]), "<U2"),
        (np.array([b"ab"]), r"\|S2"),
        (np.zeros(2, "datetime64[s]"), r"datetime64\[s\]"),
    ],
)
def test_from_torch_names_an_array_that_is_not_of_numbers(array, dtype):
    state = {"fc.weight": np.ones((2, 2), np.float32), "x\x1b[2J": array}
    with pytest.raises(
        TypeError,
        match=rf"maps names to arrays, but 'x\\x1b\[2J' is an array of {dtype}",
    ):
        bridge.from_torch(state)


@pytest.mark.parametrize("group", ["\u00b2", "\u0661"])
def test_a_rule_naming_a_group_by_another_digit_is_refused_by_name(tmp_path, group):
    """`\\g<²>` read backwards was `invalid literal for int() with base 10: '²'`."""
    _, variables = _linen()
    rules = {r"fc\.(\d+)": rf".Dense_\g<{group}>"}
    with pytest.raises(
        ValueError,
        match=rf"cannot be read backwards for export: it refers to group '{group}', "
        r"which it does not have",
    ):
        bridge.save_state_dict(tmp_path / "m.safetensors", variables, rules=rules)


def test_a_torch_file_with_01_and_1_is_a_checkpoint_error(tmp_path):
    """`h.01.weight` and `h.1.weight`: one index to a reader of PyTorch's names.
    Was a ValueError naming no file."""
    from safetensors.numpy import save_file

    path = tmp_path / "m.safetensors"
    arrays = {"h.01.weight": np.ones((2, 2), "f4"), "h.1.weight": np.ones((2, 2), "f4")}
    save_file(arrays, path, metadata={"format": "pt"})
    with pytest.raises(
        bridge.CheckpointError,
        match=r"m\.safetensors: bridge\.from_torch: 'h\.01\.weight' and 'h\.1\.weight' "
        r"name the same array",
    ):
        bridge.load(path)


@pytest.mark.parametrize("name", ["m.safetensors", "folder"])
@pytest.mark.parametrize(
    "variables, bad",
    [
        ({"params": {"a": {"": np.ones((2, 2), np.float32)}}}, "'a.'"),
        ({"params": {"": np.ones((2, 2), np.float32)}}, "''"),
    ],
)
def test_an_empty_key_is_refused_before_writing_a_torch_file(
    tmp_path, name, variables, bad
):
    """An empty key makes a name with an empty segment (`'a.'`, `''`): it was
    written, and every reader (bridge's `load` included) refused the file."""
    with pytest.raises(
        ValueError,
        match=rf"(?s){name}: a PyTorch-layout checkpoint names each array by dotted "
        rf"names, none empty.*these names\nare not: {bad}\. Rename",
    ):
        export(tmp_path / name, variables)
    assert list(tmp_path.iterdir()) == []


def test_a_destination_it_cannot_write_is_refused_before_writing(tmp_path):
    """A PyTorch-layout export into a directory that does not exist (a file and a
    folder), onto an existing directory named as a file, and with a training state:
    bridge's own errors naming the path, nothing written. Was: the raw
    `FileNotFoundError` of the writer, and `IsADirectoryError` of a rename after a
    temporary file was written."""
    model, variables = _linen()
    missing = tmp_path / "missing"
    for path in (missing / "m.safetensors", missing / "folder"):
        with pytest.raises(
            FileNotFoundError,
            match=rf"{missing}: no such directory to save {path.name} in\.",
        ):
            export(path, (model, variables))
    (tmp_path / "m.safetensors").mkdir()
    with pytest.raises(
        IsADirectoryError,
        match=r"m\.safetensors is a directory: a PyTorch-layout safetensors file is "
        r"one file; pick a file name",
    ):
        bridge.save_state_dict(tmp_path / "m.safetensors", (model, variables))
    opt_state = optax.adam(1e-3).init(variables["params"])
    for name in ("o.safetensors", "folder"):  # the earlier spelling: refused
        with pytest.raises(ValueError, match="holds the model's arrays only"):
            bridge.save(
                tmp_path / name, (model, variables), layout="torch", opt_state=opt_state
            )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    assert list((tmp_path / "m.safetensors").iterdir()) == []
