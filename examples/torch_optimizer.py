"""Resume a PyTorch AdamW run in Equinox with its moments, and hand it back.

Three AdamW steps in PyTorch; the weights (`bridge.port`) and the optimizer state
(`bridge.port_opt_state`) move to an Equinox model, which trains three more steps
with `optax.adamw` of the same settings; the result is checked against PyTorch
training those three steps itself. Then the state goes back: `port_opt_state` gives
a state dict that `optimizer.load_state_dict` takes, and PyTorch trains on.

Needs `torch`; without it the example says so and stops.
"""

import copy
import importlib.util

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import bridge


D_IN, HIDDEN, D_OUT = 4, 8, 3
SETTINGS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
R = np.random.default_rng(0)
BATCHES = [
    (R.normal(size=(8, D_IN)).astype("f4"), R.normal(size=(8, D_OUT)).astype("f4"))
    for _ in range(9)
]


class MLP(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(D_IN, HIDDEN, key=k1)
        self.fc2 = eqx.nn.Linear(HIDDEN, D_OUT, key=k2)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def main() -> None:
    if importlib.util.find_spec("torch") is None:
        print("torch_optimizer.py needs torch: skipped")
        return
    import torch

    class TorchMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(D_IN, HIDDEN)
            self.fc2 = torch.nn.Linear(HIDDEN, D_OUT)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))

    def torch_steps(model, optimizer, batches):
        for x, y in batches:
            optimizer.zero_grad()
            loss = ((model(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).mean()
            loss.backward()
            optimizer.step()

    torch.manual_seed(0)
    model = TorchMLP()
    optimizer = torch.optim.AdamW(model.parameters(), **SETTINGS)
    torch_steps(model, optimizer, BATCHES[:3])

    # PyTorch on its own, for comparison (a state dict shares its tensors: copy it)
    alone = copy.deepcopy(model)
    alone_opt = torch.optim.AdamW(alone.parameters(), **SETTINGS)
    alone_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    torch_steps(alone, alone_opt, BATCHES[3:6])

    # into Equinox: weights, then moments (weight (out, in) in both)
    tx = optax.adamw(1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.05)
    eqx_model = bridge.port(model, MLP(jax.random.key(1)))
    state = bridge.port_opt_state(optimizer, model, eqx_model, tx=tx)
    print("count after PyTorch:", int(state[0].count))  # 3

    @eqx.filter_jit
    def step(model, state, x, y):
        loss = lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)  # noqa: E731
        grads = eqx.filter_grad(loss)(model)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    for x, y in BATCHES[3:6]:
        eqx_model, state = step(eqx_model, state, x, y)
    ported = bridge.port(eqx_model, TorchMLP())
    diff = max(
        float(np.max(np.abs(np.asarray(ported[n]) - p.detach().numpy())))
        for n, p in alone.named_parameters()
    )
    print(f"3 more steps in Equinox vs in PyTorch: largest difference {diff:.1e}")
    assert diff < 1e-5

    # and back into PyTorch, which trains on
    back = TorchMLP()
    back.load_state_dict({n: torch.as_tensor(np.asarray(a)) for n, a in ported.items()})
    back_opt = torch.optim.AdamW(back.parameters(), **SETTINGS)
    back_opt.load_state_dict(
        bridge.port_opt_state(state, eqx_model, back, like=back_opt)
    )
    print(
        "PyTorch step after Equinox:", float(back_opt.state_dict()["state"][0]["step"])
    )
    torch_steps(back, back_opt, BATCHES[6:])
    for x, y in BATCHES[6:]:
        eqx_model, state = step(eqx_model, state, x, y)
    ported = bridge.port(eqx_model, TorchMLP())
    diff = max(
        float(np.max(np.abs(np.asarray(ported[n]) - p.detach().numpy())))
        for n, p in back.named_parameters()
    )
    print(f"3 more steps in PyTorch vs in Equinox: largest difference {diff:.1e}")
    assert diff < 1e-5


if __name__ == "__main__":
    main()
