"""`bridge.port_opt_state` of damaged PyTorch optimizer states: each was ported
without a word (an entry without `step` counted from 0; one without `exp_avg_sq`
filled with zeros, its next update ~1e8 too large; steps of -5 or 2.5; one entry in
two groups; string state keys dropping every moment) or raised a raw exception.
Each is refused with one `ValueError` naming the entry, parameter or setting."""

import copy

import jax
import pytest


torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

import equinox as eqx  # noqa: E402

import bridge  # noqa: E402

from .test_opt_state_torch import (  # noqa: E402
    BATCHES,
    EqxMLP,
    TorchMLP,
    adamw,
    sgd,
    torch_steps,
)


@pytest.fixture(scope="module")
def trained():
    """`(model, AdamW state dict, SGD state dict)` after one step each."""
    torch.manual_seed(0)
    model = TorchMLP()
    states = []
    for make in (adamw, sgd):
        optimizer = make(model)
        torch_steps(model, optimizer, BATCHES[:1])
        states.append(copy.deepcopy(optimizer.state_dict()))
    return model, *states


def _entry(k, change):
    def apply(sd):
        change(sd["state"][k])

    return apply


def _set(k, key, value):
    return _entry(k, lambda e: e.__setitem__(key, value))


def _drop(k, key):
    return _entry(k, lambda e: e.pop(key))


def _group(key, value):
    def apply(sd):
        sd["param_groups"][0][key] = value

    return apply


def _second_group(sd):
    sd["param_groups"].append({**sd["param_groups"][0], "params": [0]})


def _string_keys(sd):
    sd["state"] = {str(k): v for k, v in sd["state"].items()}


def _extra_entry(sd):
    sd["state"][9] = copy.deepcopy(sd["state"][0])


ADAM_CASES = [
    ("no step", _drop(0, "step"), r"entry 0 \(fc1.weight\) lacks step"),
    (
        "no exp_avg_sq",
        _drop(2, "exp_avg_sq"),
        r"entry 2 \(norm.weight\) lacks exp_avg_sq",
    ),
    ("step -5", _set(1, "step", torch.tensor(-5.0)), r"entry 1 \(fc1.bias\) step is"),
    ("step 2.5", _set(1, "step", torch.tensor(2.5)), r"step is tensor\(2.5000\)"),
    ("step 2**80", _set(1, "step", torch.tensor(2.0**80)), "from 0 to 2\\*\\*31 - 1"),
    ("step True", _set(1, "step", True), "step is True"),
    ("step a string", _set(1, "step", "3"), "step is '3', not a number"),
    (
        "exp_avg a list",
        _set(0, "exp_avg", [0.0]),
        r"entry 0 exp_avg has shape \(\), parameter 'fc1.weight'",
    ),
    (
        "exp_avg int",
        _entry(0, lambda e: e.update(exp_avg=e["exp_avg"].long())),
        "torch.int64, not floating",
    ),
    (
        "one entry in two groups",
        _second_group,
        r"param_groups\[1\] lists entry 0, which param_groups\[0\]",
    ),
    ("string state keys", _string_keys, "state key '0' is a str, not an int"),
    ("an entry in no group", _extra_entry, "state entry 9 is in no parameter group"),
    ("a group's params an int", _group("params", 3), r"param_groups\[0\] params is 3"),
    (
        "lr a string",
        _group("lr", "fast"),
        r"param_groups\[0\] lr is 'fast', not a number",
    ),
    ("lr None", _group("lr", None), "lr is None, not a number"),
    ("lr NaN", _group("lr", float("nan")), "lr is nan"),
    ("eps a list", _group("eps", [1e-8]), "eps is \\[1e-08\\], not a number"),
    (
        "betas one number",
        _group("betas", (0.9,)),
        "betas is \\(0.9,\\), not two numbers",
    ),
    ("betas strings", _group("betas", ("a", "b")), "betas is 'a', not a number"),
    ("amsgrad a string", _group("amsgrad", "no"), "amsgrad is 'no', not True or False"),
]
SGD_CASES = [
    ("nesterov a string", _group("nesterov", "yes"), "nesterov is 'yes'"),
    ("momentum a dict", _group("momentum", {}), "momentum is {}, not a number"),
    (
        "momentum_buffer a shape off",
        _set(0, "momentum_buffer", torch.zeros(2)),
        r"entry 0 momentum_buffer has shape \(2,\), parameter 'fc1.weight'",
    ),
]


@pytest.mark.parametrize(
    "which, change, match",
    [pytest.param("adam", c, m, id=n) for n, c, m in ADAM_CASES]
    + [pytest.param("sgd", c, m, id=n) for n, c, m in SGD_CASES],
)
def test_damaged_states_are_refused_naming_the_entry(trained, which, change, match):
    model, adam_state, sgd_state = trained
    sd = copy.deepcopy(adam_state if which == "adam" else sgd_state)
    change(sd)
    target = EqxMLP(jax.random.key(1))
    with pytest.raises(ValueError, match=match) as info:
        bridge.port_opt_state(sd, model, target)
    assert len(str(info.value)) < 2_000
    assert type(info.value) is ValueError


def test_every_problem_is_counted(trained):
    model, adam_state, _ = trained
    sd = copy.deepcopy(adam_state)
    for k in range(6):
        sd["state"][k].pop("step")
    with pytest.raises(ValueError, match=r"\(6 problem\(s\)\).* lacks step") as info:
        bridge.port_opt_state(sd, model, EqxMLP(jax.random.key(1)))
    assert "entry 5 (fc2.bias) lacks step" in str(info.value)


def test_a_valid_state_still_ports(trained):
    model, adam_state, sgd_state = trained
    target = EqxMLP(jax.random.key(1))
    for sd in (adam_state, sgd_state):
        state = bridge.port_opt_state(copy.deepcopy(sd), model, target)
        assert jax.tree.leaves(eqx.filter(state, eqx.is_array))


@pytest.mark.parametrize("count", [-3, 2**31])
def test_an_optax_count_that_is_no_step_is_refused(trained, count):
    """An optax state whose `count` is negative (or past int32) was ported into
    PyTorch as `step` -3.0; refused, naming the count."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    from .test_opt_state_torch import adamw

    model, _, _ = trained
    source = EqxMLP(jax.random.key(1))
    tx = optax.adamw(1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)
    state = tx.init(eqx.filter(source, eqx.is_array))
    state = jax.tree.map(
        lambda x: np.asarray(count, np.int64) if x.dtype == jnp.int32 else x, state
    )
    with pytest.raises(
        ValueError,
        match=rf"opt_state's ScaleByAdamState\.count is .*{count}.*: not a whole "
        r"number of steps from 0 to 2\*\*31 - 1, which PyTorch's optimizer takes",
    ):
        bridge.port_opt_state(state, source, model, like=adamw(model), tx=tx)
