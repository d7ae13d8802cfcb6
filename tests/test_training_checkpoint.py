"""Training checkpoints: `bridge.save_training(path, model, opt_state, step=,
extra=)` and `bridge.load(..., opt_state_like=)`, resumed in another framework."""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
import safetensors.numpy
from flax import nnx

import bridge
from bridge._adapters._nnx import as_pure
from bridge._cli import main

from .helpers import tree_allclose, tree_equal_bits
from .models import equinox_mlp, linen_mlp, nnx_mlp
from .test_opt_state import OPTIMIZERS, RUNS, K, N, copied, mse, train


def resume_from_file(a, b, optimizer, path):
    """`(A for K + N steps, A for K, saved, loaded into B, B for N)`, as Trees."""
    tx = OPTIMIZERS[optimizer]()
    ra, rb = RUNS[a], RUNS[b]
    model = ra.model(0)
    model, opt = train(ra, model, ra.init(model, tx), tx, 0, K)
    bridge.save_training(path, model, opt, step=K, extra={"seed": jnp.uint32(7)})
    fresh = rb.model(1)
    loaded = bridge.load(path, like=fresh, opt_state_like=rb.init(fresh, tx))
    assert loaded.step == K and int(loaded.extra["seed"]) == 7
    model_b, _ = train(rb, copied(loaded.model), loaded.opt_state, tx, K, N)
    model_a, _ = train(ra, model, opt, tx, K, N)
    reference = bridge.to_neutral(model_a)
    return reference, bridge.port(model_b, reference)


CASES = [
    ("linen", "nnx", "adam", "ckpt.safetensors"),
    ("nnx", "equinox", "freeze", "ckpt"),
    ("equinox", "make_step", "adam", "ckpt.safetensors"),
    ("make_step", "linen", "freeze", "ckpt.safetensors"),
]
SLOW = [
    (a, b, o, f)
    for a in RUNS
    for b in RUNS
    for o in sorted(OPTIMIZERS)
    for f in ("ckpt.safetensors", "ckpt")
    if (a, b, o, f) not in CASES
]


@pytest.mark.parametrize(
    "a,b,optimizer,name",
    CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW],
)
def test_resume_from_a_checkpoint_in(tmp_path, a, b, optimizer, name):
    reference, resumed = resume_from_file(a, b, optimizer, tmp_path / name)
    assert tree_allclose(reference, resumed, rtol=1e-5, atol=1e-6)
    if {a, b} <= {"linen", "nnx"}:
        assert tree_equal_bits(reference, resumed)


def test_same_framework_same_bits(tmp_path):
    """Saved and loaded in NNX: the optimizer and its step come back exactly."""
    tx = OPTIMIZERS["freeze"]()
    model = nnx_mlp(0)
    model, opt = train(
        RUNS["nnx"], model, nnx.Optimizer(model, tx, wrt=nnx.Param), tx, 0, K
    )
    path = tmp_path / "nnx.safetensors"
    bridge.save_training(path, model, opt)
    fresh = nnx_mlp(1)
    loaded = bridge.load(
        path, like=fresh, opt_state_like=nnx.Optimizer(fresh, tx, wrt=nnx.Param)
    )
    assert isinstance(loaded.opt_state, nnx.Optimizer)
    assert int(loaded.opt_state.step[...]) == K and loaded.step == K
    assert tree_equal_bits(as_pure(loaded.opt_state.opt_state), as_pure(opt.opt_state))
    assert tree_equal_bits(nnx.state(loaded.model), nnx.state(model))


def test_model_alone_from_a_training_checkpoint(tmp_path):
    tx = optax.adam(1e-2)
    module, variables = linen_mlp(0)
    path = tmp_path / "linen.safetensors"
    bridge.save_training(path, variables, tx.init(variables["params"]), step=3)
    assert tree_equal_bits(bridge.load(path, like=variables), variables)
    tree = bridge.load(path)
    assert "opt_state" not in dict(bridge.to_native(tree))


def test_target_trains_more_layers(tmp_path):
    """Saved from a make_step run that trained the last layer; loaded into an
    Equinox run that trains all: the last layer's moments come back, the others are
    fresh, with a warning listing them."""
    tx = optax.adam(1e-2)
    tree = bridge.from_nnx(nnx_mlp(0))
    step = bridge.make_step(
        lambda m, x, y: mse(m(x), y), tx, bridge.trainable(tree, lambda t: t.layers[2])
    )
    opt = step.init(tree)
    x = jnp.ones((4, 3))
    tree, opt, _ = step(tree, opt, x, jnp.zeros((4, 2)))
    path = tmp_path / "last.safetensors"
    bridge.save_training(path, tree, opt, step=1)
    target = equinox_mlp(1)
    like = tx.init(eqx.filter(target, eqx.is_array))
    with pytest.warns(
        bridge.PortWarning, match=r"(?s)start fresh.*\.layers\[1\]\.bias"
    ):
        loaded = bridge.load(path, like=target, opt_state_like=like)
    mu = loaded.opt_state[0].mu
    assert jnp.array_equal(mu.layers[2].weight, opt[0].mu[".layers[2].kernel"].T)
    assert not jnp.any(mu.layers[0].weight)


def test_no_optimizer_state_in_the_file(tmp_path):
    tx = optax.adam(1e-2)
    module, variables = linen_mlp(0)
    path = tmp_path / "model.safetensors"
    bridge.save(path, variables)
    with pytest.raises(ValueError, match=r"holds no optimizer state"):
        bridge.load(path, like=variables, opt_state_like=tx.init(variables["params"]))


def test_msgpack_holds_no_training_state(tmp_path):
    module, variables = linen_mlp(0)
    with pytest.raises(ValueError, match=r"msgpack checkpoint holds arrays only"):
        bridge.save_training(tmp_path / "m.msgpack", variables, None, step=3)
    assert not (tmp_path / "m.msgpack").exists()


def test_unsupported_state_node(tmp_path):
    module, variables = linen_mlp(0)
    opt = (optax.adam(1e-2).init(variables["params"]), {"schedule": object()})
    with pytest.raises(TypeError, match=r"opt_state\[1\]\['schedule'\] is a object"):
        bridge.save_training(tmp_path / "x.safetensors", variables, opt)
    assert not (tmp_path / "x.safetensors").exists()


def _rewrite_training(path, change):
    """Rewrite the `training` record of a safetensors file with `change(record)`."""
    arrays = safetensors.numpy.load_file(path)
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    meta = header["__metadata__"]
    meta["training"] = change(json.loads(meta["training"]))
    safetensors.numpy.save_file(arrays, path, metadata=meta)


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


DAMAGED = [  # round 3: each was taken, or a raw exception naming no file
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
    "change, match",
    [
        (lambda r: "{not json", "JSONDecodeError"),
        (lambda r: json.dumps([1, 2]), "not a JSON object"),
        (
            lambda r: json.dumps(
                {**r, "opt_state": {"t": "array", "name": "opt_state.9"}}
            ),
            "names an array 'opt_state.9'",
        ),
        (
            lambda r: json.dumps({**r, "opt_state": {"t": "tuple", "c": 5}}),
            "children are 5",
        ),
        (lambda r: json.dumps({**r, "step": "ten"}), "step 'ten' is not"),
    ]
    + [pytest.param(c, m, id=n) for n, c, m in DAMAGED],
)
def test_damaged_training_record(tmp_path, capsys, change, match):
    tx = optax.adam(1e-2)
    module, variables = linen_mlp(0)
    path = tmp_path / "linen.safetensors"
    bridge.save_training(path, variables, tx.init(variables["params"]), step=1)
    _rewrite_training(path, change)
    with pytest.raises(
        bridge.CheckpointError, match=r"does not describe an optimizer"
    ) as info:
        bridge.load(path, like=variables, opt_state_like=tx.init(variables["params"]))
    message = str(info.value)
    assert "linen.safetensors" in message and len(message) < 1_000
    assert re.search(match, message), message
    assert tree_equal_bits(bridge.load(path, like=variables), variables)
    assert main(["inspect", str(path)]) == 0


def test_recorded_classes_outside_optax_are_not_looked_up(tmp_path):
    """A class name in the file that is not an optax class is never resolved: the
    named tuple comes back as a dict of its fields, which ports all the same."""
    tx = optax.adam(1e-2)
    module, variables = linen_mlp(0)
    path = tmp_path / "linen.safetensors"
    state = tx.init(variables["params"])
    state = (state[0]._replace(mu=jax.tree.map(jnp.ones_like, state[0].mu)), state[1])
    bridge.save_training(path, variables, state)

    def evil(record):
        record["opt_state"]["c"][0]["cls"] = "os:system"
        return json.dumps(record)

    _rewrite_training(path, evil)
    loaded = bridge.load(path, like=variables, opt_state_like=state)
    assert type(loaded.opt_state[0]) is optax.ScaleByAdamState
    assert tree_equal_bits(loaded.opt_state, state)


def test_recorded_classes_reached_through_optax_imports_are_never_built(
    tmp_path, monkeypatch
):
    """`optax.tree_utils._random` imports `inspect`, so the name
    `optax.tree_utils._random:inspect.Arguments` starts with an optax module yet walks
    to another module's class: only the allow-list of optax's own state classes is
    looked up, so it is never constructed."""
    import inspect

    import optax.tree_utils._random  # noqa: F401  (the module the walk starts from)

    built = []
    original = inspect.Arguments.__new__
    monkeypatch.setattr(
        inspect.Arguments,
        "__new__",
        lambda cls, *a: built.append(a) or original(cls, *a),
    )
    tx = optax.adam(1e-2)
    module, variables = linen_mlp(0)
    path = tmp_path / "linen.safetensors"
    state = tx.init(variables["params"])
    bridge.save_training(path, variables, state)

    def walk(record):
        node = record["opt_state"]["c"][0]
        node["cls"] = "optax.tree_utils._random:inspect.Arguments"
        node["fields"] = ["args", "varargs", "varkw"]
        return json.dumps(record)

    _rewrite_training(path, walk)
    # read as a dict of the recorded fields, which are not adam's
    with pytest.raises(ValueError, match=r"opt_state\[0\]\.varargs has no counterpart"):
        bridge.load(path, like=variables, opt_state_like=state)
    assert not built


def test_inspect_shows_the_optimizer_state(tmp_path, capsys):
    tx = OPTIMIZERS["freeze"]()
    model = nnx_mlp(0)
    path = tmp_path / "nnx.safetensors"
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    bridge.save_training(path, model, opt, step=5, extra={"key": jax.random.key(0)})
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step: 5" in out
    assert "optimizer state: 3 parts, 340 B" in out
    assert ".inner_states.train.inner_state[1][0].mu: 4 arrays (2 masked)" in out
    assert "extra: key, 8 B" in out


def test_convert_keeps_the_training_state(tmp_path, capsys):
    tx = optax.adam(1e-2)
    module, variables = linen_mlp(0)
    state = tx.init(variables["params"])
    src = tmp_path / "run.safetensors"
    bridge.save_training(src, variables, state, step=2)
    assert main(["convert", str(src), str(tmp_path / "run")]) == 0
    loaded = bridge.load(tmp_path / "run", like=variables, opt_state_like=state)
    assert loaded.step == 2 and tree_equal_bits(loaded.opt_state, state)
    assert main(["convert", str(src), str(tmp_path / "run.msgpack")]) == 1
    assert "msgpack checkpoint holds arrays only" in capsys.readouterr().err
    assert not (tmp_path / "run.msgpack").exists()
