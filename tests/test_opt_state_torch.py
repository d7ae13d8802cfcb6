"""`bridge.port_opt_state` with PyTorch optimizers: the oracle is PyTorch's own
`optimizer.step()`. Train 3 steps in PyTorch, carry the weights (`bridge.port`) and
the optimizer state into NNX, Equinox and Linen, train 3 more on each side: equal
parameters (within 1e-5). The reverse likewise: the state comes back as a state dict
that `optimizer.load_state_dict` takes. Skipped without torch."""

import copy
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import bridge


torch = pytest.importorskip("torch")

D_IN, HIDDEN, D_OUT, K, N = 4, 8, 3, 3, 3
R = np.random.default_rng(0)
BATCHES = [
    (R.normal(size=(5, D_IN)).astype("f4"), R.normal(size=(5, D_OUT)).astype("f4"))
    for _ in range(K + N)
]
# settings away from the defaults, so that a wrong one shows
ADAMW = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
SGD = dict(lr=5e-2, momentum=0.9, nesterov=True, weight_decay=1e-2)


class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        return self.fc2(self.norm(torch.tanh(self.fc1(x))))


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
        self.norm = nnx.LayerNorm(HIDDEN, epsilon=1e-5, rngs=rngs)
        self.fc2 = nnx.Linear(HIDDEN, D_OUT, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.norm(jnp.tanh(self.fc1(x))))


class EqxMLP(eqx.Module):
    fc1: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(D_IN, HIDDEN, key=k1)
        self.norm = eqx.nn.LayerNorm(HIDDEN, eps=1e-5)
        self.fc2 = eqx.nn.Linear(HIDDEN, D_OUT, key=k2)

    def __call__(self, x):
        return self.fc2(self.norm(jnp.tanh(self.fc1(x))))


class LinenMLP(nn.Module):
    def setup(self):
        self.fc1 = nn.Dense(HIDDEN)
        self.norm = nn.LayerNorm(epsilon=1e-5)
        self.fc2 = nn.Dense(D_OUT)

    def __call__(self, x):
        return self.fc2(self.norm(jnp.tanh(self.fc1(x))))


def mse(pred, y):
    return jnp.mean((pred - y) ** 2)


# --- each side's own training loop ----------------------------------------------------


def torch_steps(model, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        loss = ((model(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).mean()
        loss.backward()
        optimizer.step()


def torch_run(make_optimizer):
    """A torch model and optimizer after K steps, and a copy trained N more."""
    torch.manual_seed(0)
    model = TorchMLP()
    optimizer = make_optimizer(model)
    torch_steps(model, optimizer, BATCHES[:K])
    on = copy.deepcopy(model)
    on_optimizer = make_optimizer(on)
    # a state dict shares its tensors: load a copy, or stepping `on` moves `optimizer`
    on_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    torch_steps(on, on_optimizer, BATCHES[K:])
    return model, optimizer, on


def adamw(model):
    return torch.optim.AdamW(model.parameters(), **ADAMW)


def sgd(model):
    return torch.optim.SGD(model.parameters(), **SGD)


def optax_adamw():
    return optax.adamw(1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)


def optax_sgd():
    return optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(5e-2, 0.9, True))


@nnx.jit
def _nnx_step(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(lambda m: mse(m(x), y))(model))


def nnx_steps(model, optimizer, batches):
    for x, y in batches:
        _nnx_step(model, optimizer, x, y)
    return model


def equinox_steps(model, state, tx, batches):
    @eqx.filter_jit
    def step(model, state, x, y):
        grads = eqx.filter_grad(lambda m: mse(jax.vmap(m)(x), y))(model)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    for x, y in batches:
        model, state = step(model, state, x, y)
    return model, state


def linen_steps(params, state, tx, batches):
    module = LinenMLP()

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(lambda p: mse(module.apply({"params": p}, x), y))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for x, y in batches:
        params, state = step(params, state, x, y)
    return params, state


def torch_weights(model):
    """`{name: array}` of a torch model's parameters."""
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def jax_weights(model):
    """The parameters of a JAX model, in PyTorch's names and layouts."""
    out = bridge.port(model, TorchMLP())
    return {n: np.asarray(v) for n, v in out.items()}


def assert_close(a, b, atol=1e-5):
    assert sorted(a) == sorted(b)
    worst = max(float(np.max(np.abs(a[n] - b[n]))) for n in a)
    assert worst <= atol, worst
    return worst


# --- PyTorch -> JAX -------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("framework", ["nnx", "equinox", "linen"])
def test_torch_then_jax_equals_torch_on(framework, optimizer):
    make, tx = {"adamw": (adamw, optax_adamw), "sgd": (sgd, optax_sgd)}[optimizer]
    model, torch_opt, on = torch_run(make)
    tx = tx()
    before = copy.deepcopy(torch_opt.state_dict())
    if framework == "nnx":
        target = bridge.port(model, NnxMLP(nnx.Rngs(1)))
        # no `like`: the NNX way, an nnx.Optimizer of the optax optimizer that
        # updates as torch's does
        state = bridge.port_opt_state(torch_opt, model, target, tx=tx)
        assert isinstance(state, nnx.Optimizer)
        # torch's SGD counts no steps
        assert int(state.step[...]) == (K if optimizer == "adamw" else 0)
        trained = nnx_steps(target, state, BATCHES[K:])
    elif framework == "equinox":
        target = bridge.port(model, EqxMLP(jax.random.key(1)))
        like = tx.init(eqx.filter(target, eqx.is_array))
        state = bridge.port_opt_state(torch_opt, model, target, like=like, tx=tx)
        trained, _ = equinox_steps(target, state, tx, BATCHES[K:])
    else:
        variables = LinenMLP().init(jax.random.key(1), BATCHES[0][0])
        target = bridge.port(model, variables)
        state = bridge.port_opt_state(torch_opt, model, target, tx=tx)
        params, _ = linen_steps(target["params"], state, tx, BATCHES[K:])
        trained = {"params": params}
    assert_close(jax_weights(trained), torch_weights(on))
    # the caller's optimizer is unchanged
    after = torch_opt.state_dict()
    for k, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["state"][k][key], value)


def test_moments_follow_the_layout():
    model, torch_opt, _ = torch_run(adamw)
    target = bridge.port(model, EqxMLP(jax.random.key(1)))
    state = bridge.port_opt_state(torch_opt, model, target)
    adam = state[0]
    entry = torch_opt.state_dict()["state"][0]  # fc1.weight, (out, in) in both
    assert np.array_equal(np.asarray(adam.mu.fc1.weight), entry["exp_avg"].numpy())
    assert np.array_equal(np.asarray(adam.nu.fc1.weight), entry["exp_avg_sq"].numpy())
    assert int(adam.count) == K
    nnx_state = bridge.port_opt_state(torch_opt, model, NnxMLP(nnx.Rngs(1)))
    kernel = nnx_state.opt_state[0].mu["fc1"]["kernel"][...]  # (in, out)
    assert np.array_equal(np.asarray(kernel), entry["exp_avg"].numpy().T)


def test_linen_without_like_is_the_state_of_optax_adamw():
    model, torch_opt, _ = torch_run(adamw)
    variables = LinenMLP().init(jax.random.key(1), BATCHES[0][0])
    state = bridge.port_opt_state(torch_opt, model, variables)
    fresh = optax_adamw().init(variables["params"])
    assert jax.tree.structure(state) == jax.tree.structure(fresh)


# --- JAX -> PyTorch -------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("framework", ["nnx", "equinox"])
def test_jax_then_torch_equals_jax_on(framework, optimizer):
    make, make_tx = {"adamw": (adamw, optax_adamw), "sgd": (sgd, optax_sgd)}[optimizer]
    tx = make_tx()
    if framework == "nnx":
        model = NnxMLP(nnx.Rngs(0))
        state = nnx.Optimizer(model, tx, wrt=nnx.Param)
        nnx_steps(model, state, BATCHES[:K])
        source, opt_state = model, state
        on = nnx_steps(nnx.clone(model), nnx.clone(state), BATCHES[K:])
    else:
        model = EqxMLP(jax.random.key(0))
        state = tx.init(eqx.filter(model, eqx.is_array))
        model, state = equinox_steps(model, state, tx, BATCHES[:K])
        source, opt_state = model, state
        on, _ = equinox_steps(model, state, tx, BATCHES[K:])
    target = TorchMLP()
    target.load_state_dict(
        {k: torch.from_numpy(v) for k, v in jax_weights(source).items()}
    )
    torch_opt = make(target)
    sd = bridge.port_opt_state(opt_state, source, target, like=torch_opt)
    torch_opt.load_state_dict(sd)
    if optimizer == "adamw":
        assert float(torch_opt.state_dict()["state"][0]["step"]) == K
    torch_steps(target, torch_opt, BATCHES[K:])
    assert_close(torch_weights(target), jax_weights(on))


# --- hyperparameters and refusals ---------------------------------------------------


@pytest.mark.parametrize(
    "tx",
    [
        optax.adamw(1e-2, b1=0.9, b2=0.99, eps=1e-6, weight_decay=0.1),  # b1
        optax.adamw(1e-2, b1=0.8, b2=0.999, eps=1e-6, weight_decay=0.1),  # b2
        optax.adamw(1e-2, b1=0.8, b2=0.99, eps=1e-8, weight_decay=0.1),  # eps
        optax.adamw(1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=1e-4),  # decay
        optax.adamw(2e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1),  # lr
        optax.adam(1e-2, b1=0.8, b2=0.99, eps=1e-6),  # no decay
    ],
)
def test_different_hyperparameters_are_reported(tx):
    model, torch_opt, _ = torch_run(adamw)
    target = EqxMLP(jax.random.key(1))
    fix = r"optax\.adamw\(0\.01, b1=0\.8, b2=0\.99, eps=1e-06, weight_decay=0\.1\)"
    with pytest.warns(bridge.PortWarning, match=f"AdamW.*probe.*{fix}"):
        bridge.port_opt_state(torch_opt, model, target, tx=tx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bridge.port_opt_state(torch_opt, model, target, tx=optax_adamw())
    # and back: the optax run's tx against the torch optimizer's settings
    state = tx.init(eqx.filter(target, eqx.is_array))
    with pytest.warns(bridge.PortWarning, match=f"AdamW.*probe.*{fix}"):
        bridge.port_opt_state(state, target, model, like=adamw(model), tx=tx)


def test_state_dict_alone_indexes_the_parameters_in_order():
    model, torch_opt, _ = torch_run(adamw)
    target = EqxMLP(jax.random.key(1))
    from_dict = bridge.port_opt_state(torch_opt.state_dict(), model, target)
    from_optimizer = bridge.port_opt_state(torch_opt, model, target)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, from_dict, from_optimizer))
    # an optimizer over some parameters only, in another order: found by identity
    part = torch.optim.AdamW([model.fc2.weight, model.fc1.weight], **ADAMW)
    torch_steps(model, part, BATCHES[:1])
    with pytest.warns(bridge.PortWarning, match="start fresh"):
        state = bridge.port_opt_state(part, model, target)
    mu = state[0].mu
    fc2 = part.state_dict()["state"][0]["exp_avg"].numpy()
    assert np.array_equal(np.asarray(mu.fc2.weight), fc2)
    assert not np.any(np.asarray(mu.fc1.bias))  # fresh
    with pytest.raises(ValueError, match="indexes 2 parameters, the model has 6"):
        bridge.port_opt_state(part.state_dict(), model, target)


def test_refused():
    model, torch_opt, _ = torch_run(adamw)
    target = EqxMLP(jax.random.key(1))
    amsgrad = torch.optim.Adam(model.parameters(), amsgrad=True)
    rms = torch.optim.RMSprop(model.parameters())
    damp = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    groups = torch.optim.AdamW(
        [
            {"params": [model.fc1.weight], "weight_decay": 0.1},
            {"params": [model.fc2.weight], "weight_decay": 0.0},
        ]
    )
    for optimizer, match in [
        (amsgrad, "amsgrad=True"),
        (rms, r"not Adam, AdamW or SGD"),
        (damp, "dampening=0.5"),
        (groups, "2 parameter groups update differently"),
    ]:
        with pytest.raises(ValueError, match=match):
            bridge.port_opt_state(optimizer, model, target)
    with pytest.raises(TypeError, match="must be that torch.nn.Module"):
        bridge.port_opt_state(torch_opt, bridge.from_torch(model), target)
    for like in (torch_opt, None):
        with pytest.raises(ValueError, match="PyTorch optimizer state for a PyTorch"):
            bridge.port_opt_state(torch_opt, model, TorchMLP(), like=like)
    state = optax_adamw().init(eqx.filter(target, eqx.is_array))
    with pytest.raises(ValueError, match="`target` is a torch.nn.Module: pass `like`"):
        bridge.port_opt_state(state, target, TorchMLP())
    with pytest.raises(TypeError, match="`tx` must be an optax optimizer"):
        bridge.port_opt_state(torch_opt, model, target, tx="adamw")
    # a like with two Adam states: which one the torch state fills is not known
    two = optax.multi_transform(
        {"a": optax_adamw(), "b": optax_adamw()},
        lambda p: jax.tree.map(lambda _: "a", p),
    ).init(eqx.filter(target, eqx.is_array))
    with pytest.raises(ValueError, match="holds 2 `optax.ScaleByAdamState`"):
        bridge.port_opt_state(torch_opt, model, target, like=two)
