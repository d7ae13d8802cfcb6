"""Damaged training records (round 3 of the hostile-input audit): each was loaded
into a wrong optimizer state, or raised a raw exception that named no file. Each is
one `CheckpointError` naming the file and what is wrong; the model alone still
loads from it."""

import json
import re

import optax
import pytest

import bridge

from .helpers import tree_equal_bits
from .models import linen_mlp
from .test_training_checkpoint import _rewrite_training


def _nodes(rec, kind):
    """Every node of `kind` in a record, depth first."""
    if isinstance(rec, dict):
        if rec.get("t") == kind:
            yield rec
        for child in rec.get("c", []):
            yield from _nodes(child, kind)


def _params(r):
    return next(_nodes(r["opt_state"], "params"))


def _count(r):
    adam = next(
        n for n in _nodes(r["opt_state"], "namedtuple") if "count" in n["fields"]
    )
    return adam["c"][adam["fields"].index("count")]


def _edit(change):
    def edit(r):
        change(r)
        return json.dumps(r)

    return edit


def _leaf(i, value):
    return _edit(lambda r: _params(r)["leaves"][i].__setitem__(0, value))


def _swap_shapes(r):
    leaves = _params(r)["leaves"]
    shapes = {}  # a bias (1-D) and a kernel (2-D): swap their arrays
    for leaf in leaves:
        shapes.setdefault(len(leaf[0]) and leaf[0][-1], leaf)
    bias, kernel = shapes["bias"], shapes["kernel"]
    bias[1], kernel[1] = kernel[1], bias[1]


def _twice(r):
    leaves = _params(r)["leaves"]
    leaves[1][0] = leaves[0][0]


def _count_a_matrix(r):
    kernel = next(n for p, n in _params(r)["leaves"] if p[-1] == "kernel")
    _count(r)["name"] = kernel


def _fields_short(r):
    adam = next(
        n for n in _nodes(r["opt_state"], "namedtuple") if "count" in n["fields"]
    )
    adam["fields"] = adam["fields"][:1]


CASES = [
    (
        "a 5,000-digit step",
        lambda r: json.dumps(r).replace('"step": 1', '"step": ' + "9" * 5000),
        "Exceeds the limit",
    ),
    (
        "step true",
        _edit(lambda r: r.update(step=True)),
        "step True is not a whole number",
    ),
    ("step -5", _edit(lambda r: r.update(step=-5)), "step -5 is not"),
    (
        "step 2**80",
        _edit(lambda r: r.update(step=2**80)),
        "step 1208925819614629174706176 is not",
    ),
    (
        "a leaf path a string",
        _leaf(0, "params.Dense_0.kernel"),
        "a leaf path is 'params.Dense_0.kernel', not a list",
    ),
    (
        "a leaf the model lacks",
        _leaf(0, ["params", "Dense_9", "kernel"]),
        "names '.params.Dense_9.kernel', which the file's model lacks",
    ),
    (
        "a leaf of another parameter's shape",
        _edit(_swap_shapes),
        "has shape .*, its parameter",
    ),
    ("two leaves for one parameter", _edit(_twice), "two leaves name"),
    (
        "count naming a matrix",
        _edit(_count_a_matrix),
        "count opt_state.* has shape .*, not a scalar",
    ),
    (
        "a node a number",
        _edit(lambda r: r.update(opt_state=5)),
        "a node is 5, not an object",
    ),
    ("fewer fields than children", _edit(_fields_short), "has 1 names, 3 children"),
    (
        "extra not a list",
        _edit(lambda r: r.update(extra="seed")),
        "extra is 'seed', not a list",
    ),
    (
        "extra naming no array",
        _edit(lambda r: r.update(extra=["extra.nope"])),
        "names an array 'extra.nope' the file does not hold",
    ),
    (
        "an array name a number",
        _edit(lambda r: _count(r).update(name=3)),
        "names an array 3",
    ),
]


@pytest.mark.parametrize(
    "change, match", [pytest.param(c, m, id=n) for n, c, m in CASES]
)
def test_damaged_training_records_are_refused_naming_the_file(tmp_path, change, match):
    tx = optax.adam(1e-2)
    module, variables = linen_mlp(0)
    path = tmp_path / "linen.safetensors"
    bridge.save(path, variables, opt_state=tx.init(variables["params"]), step=1)
    _rewrite_training(path, change)
    with pytest.raises(
        bridge.CheckpointError, match="does not describe an optimizer"
    ) as info:
        bridge.load(path, like=variables, opt_state_like=tx.init(variables["params"]))
    message = str(info.value)
    assert "linen.safetensors" in message and len(message) < 1_000
    assert re.search(match, message), message
    assert tree_equal_bits(bridge.load(path, like=variables), variables)
