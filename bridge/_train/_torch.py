"""PyTorch optimizer states for `bridge.port_opt_state`: `torch.optim` state dicts
read as the optax state of the same update, and written back.

A `torch.optim` state dict indexes its entries by integer: entry `k` is the `k`-th
parameter of the optimizer's `param_groups`, in order. With the optimizer object
those are tensors, found by identity among `model.named_parameters()`; with its
state dict alone they are taken to be `model.parameters()` in order, as
`torch.optim.AdamW(model.parameters())` makes them (shapes checked).

Each supported optimizer is the optax chain that updates as it does:

- `AdamW(lr, betas, eps, weight_decay)`: `optax.adamw(lr, b1, b2, eps,
  weight_decay=...)`; `exp_avg`, `exp_avg_sq`, `step` are `mu`, `nu`, `count`;
- `Adam(lr, betas, eps)`: `optax.adam(lr, b1, b2, eps)`, the same entries;
- `SGD(lr, momentum, nesterov)`: `optax.sgd(lr, momentum, nesterov)`;
  `momentum_buffer` is `trace`;
- a coupled `weight_decay=w` (Adam, SGD): `optax.chain(optax.add_decayed_weights(w),
  ...)` before the optimizer.

PyTorch's Adam divides by `sqrt(exp_avg_sq / (1 - b2**step)) + eps`, as optax's
`scale_by_adam` (eps outside the root, `eps_root=0`); AdamW's decay `p * (1 - lr *
wd)` before the Adam step equals optax's `add_decayed_weights` then the learning rate
(both decay the parameters the step starts from). SGD's first momentum buffer is the
gradient, as optax's `trace` from zeros. Not supported (refused with the reason):
`amsgrad`, `maximize`, SGD `dampening`, several parameter groups with different
settings, other optimizers.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import optax

from .._paths import Path, parse, path_str


_NOT_A_MODULE = """\
A PyTorch optimizer state indexes the parameters of a torch.nn.Module by number, \
so `{argument}` must be that torch.nn.Module (the model the optimizer was made \
for), got {what}."""

_UNSUPPORTED = """\
This PyTorch optimizer state cannot be ported: {problems}
bridge ports torch.optim.AdamW, Adam and SGD (with momentum) states, which optax's \
adamw, adam and sgd keep the same way. Start the optimizer fresh on the other side \
(`tx.init(...)`)."""

_INDEXES = """\
The PyTorch optimizer's parameters do not match `{argument}`'s parameters: \
{problems}
A state dict indexes `model.parameters()` in order, as \
`torch.optim.AdamW(model.parameters())` makes it. Pass the optimizer itself (not its \
state_dict()) when its parameter groups list them in another order or hold only some \
of them: its tensors are found in the model by identity."""

_STEPS = """\
The PyTorch optimizer's parameters are at different steps ({steps}): an optax state \
has one count for all parameters. Take the state after a step that updated every \
parameter."""

_HYPER = """\
`tx` does not update the parameters as PyTorch's {optimizer} does: on a probe of \
{n} steps the parameters differ by up to {diff:.3g} of the update's size. The \
training continues with another learning rate, betas, eps or weight decay than it \
had. For the same updates use {fix}, or pass tx=None to skip this check."""


def _torch() -> Any:
    return sys.modules.get("torch")


def _is_optimizer(obj: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.optim.Optimizer)


def is_torch_state(obj: Any) -> bool:
    """A `torch.optim.Optimizer` or its `state_dict()`."""
    if _is_optimizer(obj):
        return True
    return (
        isinstance(obj, Mapping)
        and set(obj) == {"state", "param_groups"}
        and isinstance(obj["param_groups"], list)
        and all(isinstance(g, Mapping) and "params" in g for g in obj["param_groups"])
    )


def is_torch_module(obj: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.nn.Module)


# --- the update an optimizer makes ----------------------------------------------------


class Update(NamedTuple):
    """The update of a PyTorch optimizer, as settings: `kind` `"adam"` or `"sgd"`."""

    kind: str
    lr: float
    b1: float = 0.0
    b2: float = 0.0
    eps: float = 0.0
    weight_decay: float = 0.0
    decoupled: bool = False
    momentum: float = 0.0
    nesterov: bool = False

    def name(self) -> str:
        if self.kind == "adam":
            cls = "AdamW" if self.decoupled else "Adam"
            return (
                f"{cls}(lr={self.lr}, betas=({self.b1}, {self.b2}), eps={self.eps}, "
                f"weight_decay={self.weight_decay})"
            )
        return (
            f"SGD(lr={self.lr}, momentum={self.momentum}, nesterov={self.nesterov}, "
            f"weight_decay={self.weight_decay})"
        )

    def optax_call(self) -> str:
        """The optax optimizer making the same updates, as code."""
        if self.kind == "adam":
            if self.decoupled:
                return (
                    f"optax.adamw({self.lr}, b1={self.b1}, b2={self.b2}, "
                    f"eps={self.eps}, weight_decay={self.weight_decay})"
                )
            inner = f"optax.adam({self.lr}, b1={self.b1}, b2={self.b2}, eps={self.eps})"
        else:
            momentum = self.momentum or None
            inner = (
                f"optax.sgd({self.lr}, momentum={momentum}, nesterov={self.nesterov})"
            )
        if self.weight_decay:
            decay = f"optax.add_decayed_weights({self.weight_decay})"
            return f"optax.chain({decay}, {inner})"
        return inner

    def tx(self) -> optax.GradientTransformation:
        """The optax optimizer making the same updates."""
        if self.kind == "adam" and self.decoupled:
            return optax.adamw(
                self.lr, self.b1, self.b2, self.eps, weight_decay=self.weight_decay
            )
        if self.kind == "adam":
            inner = optax.adam(self.lr, self.b1, self.b2, self.eps)
        else:
            inner = optax.sgd(self.lr, self.momentum or None, self.nesterov)
        if self.weight_decay:
            return optax.chain(optax.add_decayed_weights(self.weight_decay), inner)
        return inner

    def moments(self) -> type | None:
        """The optax state node holding the per-parameter state."""
        if self.kind == "adam":
            return optax.ScaleByAdamState
        return optax.TraceState if self.momentum else None

    def reference(self, ps: list[np.ndarray], grads: list[np.ndarray]) -> list[Any]:
        """The update of each step by PyTorch's rule (float64), step `t` starting
        from the parameters `ps[t]`."""
        out = []
        m = np.zeros_like(ps[0])
        v = np.zeros_like(ps[0])
        for t, (p, g) in enumerate(zip(ps, grads), 1):
            if self.kind == "adam":
                decay = self.lr * self.weight_decay * p if self.decoupled else 0.0
                if not self.decoupled and self.weight_decay:
                    g = g + self.weight_decay * p
                m = self.b1 * m + (1 - self.b1) * g
                v = self.b2 * v + (1 - self.b2) * g * g
                denom = np.sqrt(v / (1 - self.b2**t)) + self.eps
                out.append(-decay - self.lr / (1 - self.b1**t) * m / denom)
            else:
                if self.weight_decay:
                    g = g + self.weight_decay * p
                if self.momentum:
                    m = g if t == 1 else self.momentum * m + g
                    g = g + self.momentum * m if self.nesterov else m
                out.append(-self.lr * g)
        return out


_SETTINGS = {
    "adam": {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"},
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"},
}


def _update_of(group: Mapping[str, Any], where: str, problems: list[str]) -> Any:
    if "betas" in group:
        kind = "adam"
    elif "momentum" in group and "dampening" in group:
        kind = "sgd"
    else:
        keys = sorted(k for k in group if k != "params")
        problems.append(f"{where} has settings {keys}: not Adam, AdamW or SGD")
        return None
    missing = sorted(_SETTINGS[kind] - set(group))
    if missing:
        problems.append(f"{where} lacks {missing}")
        return None
    if group.get("amsgrad"):
        problems.append(f"{where} has amsgrad=True (optax's amsgrad keeps another max)")
    if group["maximize"]:
        problems.append(f"{where} has maximize=True")
    if kind == "sgd" and group["dampening"]:
        problems.append(f"{where} has dampening={group['dampening']} (optax: none)")
    for key in ("amsgrad", "maximize", "nesterov", "decoupled_weight_decay"):
        if key in group and not isinstance(group[key], bool):
            problems.append(f"{where} {key} is {_shown(group[key])}, not True or False")
    number = lambda key: _number(group[key], f"{where} {key}", problems)  # noqa: E731
    if kind == "adam":
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            problems.append(f"{where} betas is {_shown(betas)}, not two numbers")
            betas = (0.0, 0.0)
        b1, b2 = (_number(b, f"{where} betas", problems) for b in betas)
        return Update(
            "adam",
            number("lr"),
            b1,
            b2,
            number("eps"),
            number("weight_decay"),
            decoupled=bool(group.get("decoupled_weight_decay", False)),
        )
    return Update(
        "sgd",
        number("lr"),
        weight_decay=number("weight_decay"),
        momentum=number("momentum"),
        nesterov=bool(group["nesterov"]),
    )


def _shown(value: Any) -> str:
    """`repr(value)`, at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(value: Any, what: str, problems: list[str]) -> float:
    """`value` as a float (a Python number or a 0-d tensor, as torch keeps `lr`), or
    0.0 with the problem added."""
    try:
        if isinstance(value, (bool, str, bytes)) or np.ndim(value) != 0:
            raise TypeError
        number = float(value)
    except (TypeError, ValueError, RuntimeError):
        problems.append(f"{what} is {_shown(value)}, not a number")
        return 0.0
    if not math.isfinite(number):
        problems.append(f"{what} is {number}")
    return number


# --- reading a PyTorch optimizer state ------------------------------------------------


@dataclass(frozen=True)
class TorchState:
    """A PyTorch optimizer state dict, read: the update, each entry's parameter name
    (`names[k]` for entry `k`), the state dict itself."""

    update: Update
    names: tuple[str, ...]
    state_dict: Mapping[str, Any]


def read(obj: Any, model: Any, argument: str) -> TorchState:
    """The update of a PyTorch optimizer (or its state dict) and the names in `model`
    of the parameters its entries index. Raises `TypeError` or `ValueError` listing
    every problem."""
    if not is_torch_module(model):
        what = type(model).__name__
        raise TypeError(_NOT_A_MODULE.format(argument=argument, what=f"a {what}"))
    sd = obj.state_dict() if _is_optimizer(obj) else obj
    problems: list[str] = []
    updates = [
        _update_of(g, f"param_groups[{i}]", problems)
        for i, g in enumerate(sd["param_groups"])
    ]
    if not problems and len(set(updates)) > 1:
        shown = "; ".join(f"[{i}] {u.name()}" for i, u in enumerate(updates))
        problems.append(
            f"its {len(updates)} parameter groups update differently ({shown}): one "
            "optax optimizer per group (optax.multi_transform) is not read yet"
        )
    if problems:
        raise ValueError(_UNSUPPORTED.format(problems="; ".join(problems)))
    _check_indexes(sd)
    named = list(model.named_parameters())
    index = [k for g in sd["param_groups"] for k in g["params"]]
    bad: list[str] = []
    if _is_optimizer(obj):
        by_id = {id(t): n for n, t in named}
        tensors = [t for g in obj.param_groups for t in g["params"]]
        names = []
        for k, t in zip(index, tensors):
            if id(t) not in by_id:
                bad.append(f"entry {k} (shape {tuple(t.shape)}) is no parameter of it")
            names.append(by_id.get(id(t), ""))
    else:
        if len(index) != len(named):
            bad.append(
                f"the state dict indexes {len(index)} parameters, the model has "
                f"{len(named)}"
            )
        names = [n for n, _ in named[: len(index)]]
        tensors = [t for _, t in named[: len(index)]]
        for k, (name, tensor) in zip(index, named):
            entry = sd["state"].get(k, {})
            for key, value in entry.items():
                shape = tuple(getattr(value, "shape", ()))
                if key != "step" and shape != tuple(tensor.shape):
                    bad.append(
                        f"entry {k} {key} has shape {shape}, parameter {name!r} "
                        f"{tuple(tensor.shape)}"
                    )
    if bad:
        raise ValueError(_INDEXES.format(argument=argument, problems="; ".join(bad)))
    _check_entries(sd, updates[0], index, names, tensors)
    return TorchState(updates[0], tuple(names), sd)


_DAMAGED = """\
This PyTorch optimizer state is damaged, so it was not ported ({n} problem(s)): \
{problems}
torch.optim's state_dict() indexes its entries by int, lists each parameter in one \
group once, and keeps for every parameter it stepped {keys}. Port the state as the \
optimizer saved it, or start the optimizer fresh on the other side (`tx.init(...)`)."""


def _damaged(problems: list[str], keys: str) -> ValueError:
    shown = "; ".join(problems[:8])
    if len(problems) > 8:
        shown += f"; and {len(problems) - 8} more"
    return ValueError(_DAMAGED.format(n=len(problems), problems=shown, keys=keys))


_KEYS = "its step, exp_avg and exp_avg_sq (Adam, AdamW) or momentum_buffer (SGD)"


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_indexes(sd: Mapping[str, Any]) -> None:
    """The state's keys and the groups' `params`: ints, each listed once, each
    state entry in a group."""
    problems: list[str] = []
    state = sd["state"]
    if not isinstance(state, Mapping):
        raise _damaged([f"its state is a {type(state).__name__}, not a dict"], _KEYS)
    listed: dict[int, int] = {}
    for i, group in enumerate(sd["param_groups"]):
        params = group["params"]
        if not isinstance(params, (list, tuple)):
            problems.append(f"param_groups[{i}] params is {_shown(params)}, not a list")
            continue
        for k in params:
            if not _integer(k):
                problems.append(f"param_groups[{i}] lists {_shown(k)}, not an int")
            elif k in listed:
                problems.append(
                    f"param_groups[{i}] lists entry {k}, which param_groups"
                    f"[{listed[k]}] lists too (one entry's moments would update two "
                    "parameters)"
                )
            else:
                listed[k] = i
    for k in state:
        if not _integer(k):
            problems.append(
                f"state key {_shown(k)} is a {type(k).__name__}, not an int (did the "
                "state dict go through JSON? its keys must be int(key))"
            )
        elif k not in listed:
            problems.append(f"state entry {k} is in no parameter group")
    if problems:
        raise _damaged(problems, _KEYS)


def _check_entries(
    sd: Mapping[str, Any],
    update: Update,
    index: list[int],
    names: list[str],
    tensors: list[Any],
) -> None:
    """Every entry with state holds what `update` keeps, as tensors of its
    parameter's shape, and an Adam step a whole number from 0 to 2**31 - 1."""
    torch = _torch()
    required = {"adam": ("step", "exp_avg", "exp_avg_sq"), "sgd": ()}[update.kind]
    problems: list[str] = []
    for k, name, tensor in zip(index, names, tensors):
        entry = sd["state"].get(k)
        if not entry:
            continue  # never stepped: fresh
        where = f"entry {k} ({name or 'a parameter'})"
        if not isinstance(entry, Mapping):
            problems.append(f"{where} is {_shown(entry)}, not a dict")
            continue
        missing = [key for key in required if key not in entry]
        if missing:
            problems.append(f"{where} lacks {', '.join(missing)}")
        for key, value in entry.items():
            value: Any
            if key == "step":
                problems.extend(_step_problem(value, f"{where} step"))
            elif key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if key == "momentum_buffer" and value is None:
                    continue  # SGD without momentum
                if torch is None or not torch.is_tensor(value):
                    problems.append(f"{where} {key} is a {type(value).__name__}")
                elif not value.is_floating_point():
                    problems.append(f"{where} {key} is {value.dtype}, not floating")
                elif tuple(value.shape) != tuple(tensor.shape):
                    problems.append(
                        f"{where} {key} has shape {tuple(value.shape)}, its "
                        f"parameter {tuple(tensor.shape)}"
                    )
    if problems:
        raise _damaged(problems, _KEYS)


def _step_problem(value: Any, what: str) -> list[str]:
    """Why `value` (`what`: a torch `step`, an optax `count`) is no whole number of
    steps from 0 to 2**31 - 1 (none: `[]`)."""
    torch = _torch()
    is_bool = isinstance(value, bool) or (
        torch is not None and torch.is_tensor(value) and value.dtype == torch.bool
    )
    problems: list[str] = []
    number = 0.0 if is_bool else _number(value, what, problems)
    if is_bool or (
        not problems and not (0 <= number < 2**31 and number == int(number))
    ):
        problems.append(
            f"{what} is {_shown(value)}: not a whole number of steps from 0 to "
            "2**31 - 1"
        )
    return problems


def check_count(count: Any, what: str) -> None:
    """`ValueError` unless an optax `count` (a scalar) is a whole number of steps
    from 0 to 2**31 - 1, as PyTorch's `step` must be (a negative or fractional one
    makes its bias correction wrong or NaN)."""
    problems = _step_problem(count, what)
    if problems:
        raise ValueError(
            f"{problems[0]}, which PyTorch's optimizer takes as its `step`. Port the "
            "state the training made, or pass step=."
        )


def _numpy(tensor: Any) -> np.ndarray:
    torch = _torch()
    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return t.numpy().copy()


def _path_of_name(name: str) -> Path:
    """A dotted torch name as the path `bridge.from_torch` gives it."""
    return parse(name)


def to_optax(read: TorchState) -> tuple[Any, int | None]:
    """`(optax state, step)`: the state of `read.update.tx()` whose per-parameter
    parts are dicts keyed by the `keystr` path of each parameter with a state entry
    (the form `bridge.make_step` keeps; Tree paths as `bridge.from_torch` makes them).
    """
    update, state = read.update, read.state_dict["state"]
    index = [k for g in read.state_dict["param_groups"] for k in g["params"]]
    entries = {
        path_str(_path_of_name(name)): state[k]
        for k, name in zip(index, read.names)
        if state.get(k)
    }
    steps: dict[float, list[str]] = {}
    for key, entry in entries.items():
        if "step" in entry:
            steps.setdefault(float(entry["step"]), []).append(key)
    if len(steps) > 1:
        shown = ", ".join(f"{s:g}: {', '.join(k[:3])}" for s, k in steps.items())
        raise ValueError(_STEPS.format(steps=shown))
    step = int(next(iter(steps))) if steps else None
    fields = {
        "adam": {"mu": "exp_avg", "nu": "exp_avg_sq"},
        "sgd": {"trace": "momentum_buffer"},
    }[update.kind]
    arrays = {
        field: {
            key: jnp.asarray(_numpy(entry[name]))
            for key, entry in entries.items()
            if entry.get(name) is not None
        }
        for field, name in fields.items()
    }
    params = next(iter(arrays.values()))
    fresh = update.tx().init(params)
    moments = update.moments()
    if moments is None:
        return fresh, step
    values: dict[str, Any] = {f: arrays[f] for f in fields}
    if moments is optax.ScaleByAdamState:
        values["count"] = jnp.asarray(step or 0, jnp.int32)
    record = records(fresh, moments)[0]._replace(**values)
    return replace_record(fresh, moments, record, None), step


def replace_record(node: Any, cls: Any, record: Any, step: Any) -> Any:
    """`node` with its optax state record of type `cls` replaced by `record`, and
    the `count` of its other records set to `step` (unless None)."""
    if cls is not None and isinstance(node, cls):
        return record
    names: Any = getattr(node, "_fields", None)
    if isinstance(node, tuple) and names is not None:
        named: Any = node
        fields = {
            f: replace_record(getattr(named, f), cls, record, step) for f in names
        }
        count = fields.get("count")
        if count is not None and step is not None and np.ndim(count) == 0:
            fields["count"] = jnp.asarray(step, jnp.result_type(count))
        return named._replace(**fields)
    if isinstance(node, (tuple, list)):
        return type(node)(replace_record(x, cls, record, step) for x in node)
    if type(node) is dict:
        return {k: replace_record(x, cls, record, step) for k, x in node.items()}
    return node


def records(state: Any, cls: type) -> list[Any]:
    """The optax state records of type `cls` in `state` (through tuples, named
    tuples and dicts, as optax nests them)."""
    if isinstance(state, cls):
        return [state]
    if isinstance(state, (tuple, list)):
        return [r for x in state for r in records(x, cls)]
    if isinstance(state, dict):  # multi_transform's inner states
        return [r for x in state.values() for r in records(x, cls)]
    return []


# --- writing a PyTorch optimizer state ------------------------------------------------


def params_of(read: TorchState, model: Any) -> dict[str, Any]:
    """The parameters the optimizer updates, as a dict keyed by `keystr` path."""
    tensors = dict(model.named_parameters())
    return {
        path_str(_path_of_name(n)): jnp.zeros(tuple(tensors[n].shape), jnp.float32)
        for n in read.names
    }


def from_optax(read: TorchState, state: Any, kept: set[str]) -> dict[str, Any]:
    """A state dict for `optimizer.load_state_dict`: `read`'s parameter groups (their
    settings and indices) and, for each parameter whose key is in `kept`, the entries
    of the optax `state` (of `read.update.tx()`'s structure, keyed as `to_optax`)."""
    torch = _torch()
    moments = read.update.moments()
    found = [] if moments is None else records(state, moments)
    index = [k for g in read.state_dict["param_groups"] for k in g["params"]]
    out: dict[Any, Any] = {}
    tensor = lambda x: torch.from_numpy(np.array(x))  # noqa: E731
    if found:
        node = found[0]
        for k, name in zip(index, read.names):
            key = path_str(_path_of_name(name))
            if key not in kept:
                continue
            if read.update.kind == "adam":
                out[k] = {
                    "step": torch.tensor(float(node.count), dtype=torch.float32),
                    "exp_avg": tensor(node.mu[key]),
                    "exp_avg_sq": tensor(node.nu[key]),
                }
            else:
                out[k] = {"momentum_buffer": tensor(node.trace[key])}
    return {
        "state": out,
        "param_groups": copy.deepcopy(list(read.state_dict["param_groups"])),
    }


# --- the hyperparameters --------------------------------------------------------------

_PROBE_P = np.array([50.0, -100.0, 200.0, 0.0, 150.0])
_PROBE_G = np.array(
    [
        [1e-7, -0.3, 2.0, 1.0, 0.02],
        [2e-7, 3.0, -1.5, 1e-6, -0.04],
        [-1e-7, -0.01, 1.0, 0.5, 2.0],
        [3e-7, 0.5, -0.02, -1.0, -0.3],
        [-2e-7, -2.0, 0.7, 1e-3, 0.05],
    ]
)


def hyperparameter_problem(tx: Any, update: Update) -> str | None:
    """Why `tx` does not update parameters as PyTorch's `update` does, or None when it
    does: a probe of a few steps on a few numbers chosen so that the learning rate,
    betas, eps and weight decay each change the updates (compared within 1e-4 of the
    largest update)."""
    p = jnp.asarray(_PROBE_P, jnp.float32)
    state = tx.init(p)
    ps, got = [], []
    for g in _PROBE_G:
        ps.append(np.asarray(p, np.float64))
        updates, state = tx.update(jnp.asarray(g, jnp.float32), state, p)
        got.append(np.asarray(updates, np.float64))
        p = optax.apply_updates(p, updates)
    want = update.reference(ps, list(_PROBE_G))
    diff = max(
        float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30))
        for g, w in zip(got, want)
    )
    if diff <= 1e-4:
        return None
    return _HYPER.format(
        optimizer=update.name(), n=len(_PROBE_G), diff=diff, fix=update.optax_call()
    )
