"""Tiny models for the embedding tests, and each framework's own training idiom.

Three kinds (an MLP, a CNN with BatchNorm, an attention block with dropout) in each
framework, all taking a batch. `train(fw, model, ...)` runs a few steps the way a
user of framework `fw` writes them, on a native model or on a wrapper (a wrapper is
a model of its outer framework), and returns the trained model as a `{path: array}`
dict of its wrapped Tree, comparable across frameworks.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training.train_state import TrainState

import bridge
from bridge._paths import path_of

from .models import D_IN, D_OUT, NNXCNN, EquinoxCNN, LinenCNN, cnn_input, mlp_input


KINDS = ("mlp", "cnn", "attn")
FRAMEWORKS = ("nnx", "linen", "equinox")
DIRECTIONS = [(i, o) for i in FRAMEWORKS for o in FRAMEWORKS if i != o]
SEQ, DIM, HEADS, RATE = 3, 4, 2, 0.5
LR = 0.1


# --- models --------------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D_OUT)(jax.nn.relu(nn.Dense(5)(x)))


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(D_IN, 5, rngs=rngs), nnx.Linear(5, 2, rngs=rngs)]
        )

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


class EquinoxMLP(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(D_IN, D_OUT, 5, depth=1, activation=jax.nn.relu, key=key)

    def __call__(self, x):
        return jax.vmap(self.mlp)(x)


class EquinoxBatchCNN(eqx.Module):
    """The per-example `EquinoxCNN`, on a batch (BatchNorm over the batch axis)."""

    cnn: EquinoxCNN

    def __call__(self, x, state):
        run = jax.vmap(
            self.cnn, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )
        return run(x, state)


class LinenAttn(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.MultiHeadDotProductAttention(num_heads=HEADS)(x, x)
        h = nn.Dropout(RATE, deterministic=not train)(h)
        return nn.Dense(D_OUT)(x + h).mean(axis=1)


class NNXAttn(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(HEADS, DIM, decode=False, rngs=rngs)
        self.drop = nnx.Dropout(RATE, rngs=rngs)
        self.head = nnx.Linear(DIM, D_OUT, rngs=rngs)

    def __call__(self, x):
        return self.head(x + self.drop(self.attn(x))).mean(axis=1)


class EquinoxAttn(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    drop: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.drop = eqx.nn.Dropout(RATE)
        self.head = eqx.nn.Linear(DIM, D_OUT, key=k2)

    def __call__(self, x, *, key=None):
        keys = None if key is None else jax.random.split(key, x.shape[0])

        def one(x, k):
            h = self.drop(self.attn(x, x, x), key=k)
            return jax.vmap(self.head)(x + h).mean(axis=0)

        return (
            jax.vmap(one)(x, keys)
            if keys is not None
            else jax.vmap(lambda x: one(x, None))(x)
        )


def attn_input(batch=2):
    return jax.random.normal(jax.random.key(4), (batch, SEQ, DIM))


def inputs(kind):
    """`(x, y)`: an input batch and a regression target."""
    x = {"mlp": mlp_input(), "cnn": cnn_input(), "attn": attn_input()}[kind]
    y = jax.random.normal(jax.random.key(9), (x.shape[0], D_OUT))
    return x, y


def native(fw, kind, seed=0):
    """The native model: NNX module; Linen `(module, variables)`; Equinox model or
    `(model, state)`."""
    key = jax.random.key(seed)
    x, _ = inputs(kind)
    if fw == "nnx":
        cls = {"mlp": NNXMLP, "cnn": NNXCNN, "attn": NNXAttn}[kind]
        rngs = nnx.Rngs(params=seed, dropout=seed + 100)
        return cls(rngs)
    if fw == "linen":
        module = {"mlp": LinenMLP(), "cnn": LinenCNN(), "attn": LinenAttn()}[kind]
        return module, module.init(key, x)
    if kind == "mlp":
        return EquinoxMLP(key)
    if kind == "cnn":
        cnn, state = eqx.nn.make_with_state(EquinoxCNN)(key)
        return EquinoxBatchCNN(cnn), state
    return EquinoxAttn(key)


def inner_kwargs(fw, kind):
    """Call arguments the wrapped model itself needs in training mode."""
    return {"train": True} if fw == "linen" and kind != "mlp" else {}


def step_keys(n, seed=7):
    """The dropout keys that `nnx.Rngs(dropout=seed)` draws, in order."""
    rngs = nnx.Rngs(dropout=seed)
    return [rngs.dropout() for _ in range(n)]


def wrap(inner, outer, model):
    """The wrapper of `model` in framework `outer`, as the tests use it: an NNX
    wrapper draws dropout keys from `nnx.Rngs(dropout=7)` (the `step_keys`)."""
    if outer == "nnx":
        return bridge.as_nnx(model, rngs=nnx.Rngs(dropout=7))
    if outer == "linen":
        return bridge.as_linen(model)
    return bridge.as_equinox(model)


# --- a model of any framework, called and trained in its own idiom ------------------


def loss_of(out, y):
    return jnp.mean((out - y) ** 2)


class Idiom:
    """How framework `fw` calls and trains `model` (native, or a wrapper of an
    `inner` model), with the dropout key of step `i` given the way that pairing
    takes it."""

    def __init__(self, fw, model, inner, kind):
        self.fw, self.inner, self.kind = fw, inner, kind
        self.kwargs = inner_kwargs(inner, kind)
        if fw == "linen":
            if isinstance(model, nn.Module):  # a wrapper: init gives its variables
                x, _ = inputs(kind)
                model = (model, model.init(jax.random.key(0), x, **self.kwargs))
            self.module, self.variables = model
        elif fw == "equinox":
            self.model, self.state = (
                model if isinstance(model, tuple) else (model, None)
            )
            if self.state is None and bridge_state(self.model):
                # as eqx.nn.make_with_state does
                self.state = eqx.nn.State(self.model)
                self.model = eqx.nn.delete_init_state(self.model)
        else:
            self.model = model
        self.wrapped = fw != inner

    def call_kwargs(self, key):
        """Random key arguments of one call."""
        kw = dict(self.kwargs)
        if self.kind != "attn":
            return kw, None
        if self.fw == "linen":
            if self.inner == "linen":
                return kw, {"dropout": key}
            if self.inner == "equinox":
                kw["key"] = key
            return kw, None  # an NNX model's own stream
        if self.fw == "equinox":
            if self.inner == "linen":
                kw["key"] = {"dropout": key}
            elif self.inner == "equinox":
                kw["key"] = key
        return kw, None  # NNX: the Rngs it holds

    def loss_and_grad(self, x, y, key):
        """`(loss, grads as {path: array}, new state)` of one forward pass; the model
        is not updated."""
        kw, rngs = self.call_kwargs(key)
        if self.fw == "nnx":
            model = nnx.clone(self.model)
            loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x, **kw), y))(model)
            return loss, flat(nnx.to_pure_dict(grads))
        if self.fw == "linen":
            params, extra = _split(self.variables)

            def f(p):
                out, upd = self.module.apply(
                    {"params": p, **extra}, x, mutable=list(extra), rngs=rngs, **kw
                )
                return loss_of(out, y)

            loss, grads = jax.value_and_grad(f)(params)
            return loss, flat(grads)
        loss, grads = eqx.filter_value_and_grad(self._eqx_loss, has_aux=True)(
            self.model, self.state, x, y, kw
        )
        return loss[0], flat(grads, drop=("model",))

    def _eqx_loss(self, model, state, x, y, kw):
        if state is None:
            return loss_of(model(x, **kw), y), None
        out, state = model(x, state, **kw)
        return loss_of(out, y), state

    def train(self, x, y, keys):
        """`len(keys)` SGD steps; the trained model as `{path: array}`."""
        if self.fw == "nnx":
            model = self.model
            opt = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
            for key in keys:
                kw, _ = self.call_kwargs(key)
                grads = nnx.grad(lambda m: loss_of(m(x, **kw), y))(model)
                opt.update(model, grads)
            out = flat(bridge.from_nnx(model))
            if self.wrapped:  # the wrapper's own nnx.Rngs: not the wrapped model's
                out = {p: v for p, v in out.items() if p[0] != "rngs"}
            return out
        if self.fw == "linen":
            params, extra = _split(self.variables)
            state = TrainState.create(
                apply_fn=self.module.apply, params=params, tx=optax.sgd(LR)
            )
            for key in keys:
                kw, rngs = self.call_kwargs(key)

                def f(p, extra=extra, kw=kw, rngs=rngs):
                    out, upd = state.apply_fn(
                        {"params": p, **extra}, x, mutable=list(extra), rngs=rngs, **kw
                    )
                    return loss_of(out, y), upd

                grads, upd = jax.grad(f, has_aux=True)(state.params)
                state = state.apply_gradients(grads=grads)
                extra = {**extra, **upd}
            return flat(bridge.from_linen({"params": state.params, **extra}))
        model, mstate = self.model, self.state
        opt = optax.sgd(LR)
        opt_state = opt.init(eqx.filter(model, eqx.is_array))
        for key in keys:
            kw, _ = self.call_kwargs(key)
            grads, mstate = eqx.filter_grad(self._eqx_loss, has_aux=True)(
                model, mstate, x, y, kw
            )
            updates, opt_state = opt.update(grads, opt_state)
            model = eqx.apply_updates(model, updates)
        tree = (
            bridge.from_equinox(model, mstate)
            if mstate is not None
            else (bridge.from_equinox(model))
        )
        return flat(tree, drop=("model",))


def bridge_state(model):
    return isinstance(model, eqx.Module) and any(
        isinstance(x, eqx.nn.StateIndex)
        for x in jax.tree.leaves(
            model, is_leaf=lambda x: isinstance(x, eqx.nn.StateIndex)
        )
    )


def _split(variables):
    return variables["params"], {k: v for k, v in variables.items() if k != "params"}


def flat(tree, drop=()):
    """`{path: array}` (paths as key tuples), a wrapper's first key in `drop`
    removed; typed keys as their data."""
    out = {}
    for keypath, leaf in jax.tree_util.tree_leaves_with_path(tree):
        path = path_of(keypath)
        if path and path[0] in drop:
            path = path[1:]
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[path] = leaf
    return out


def train_with_make_step(idiom, x, y, keys):
    """`len(keys)` SGD steps of `bridge.make_step` on the wrapper's Tree (all its
    parameters trainable); the trained model as `{path: array}`."""
    fw = idiom.fw
    if fw == "linen":
        tree = bridge.from_linen(idiom.variables, idiom.module)
    elif fw == "equinox":
        model, state = idiom.model, idiom.state
        tree = bridge.from_equinox(*((model,) if state is None else (model, state)))
    else:
        tree = bridge.from_nnx(idiom.model)
    spec = jax.tree.map(lambda r: r == "params", bridge.roles(tree))
    if fw == "equinox" and idiom.state is not None:

        def loss_fn(model, state, x, y, kw):
            out, state = model(x, state, **kw, **static)
            return loss_of(out, y), state

    else:

        def loss_fn(model, x, y, kw):
            return loss_of(model(x, **kw, **static), y)

    static = idiom.kwargs  # `train=True`: static, the keys are traced
    step = bridge.make_step(loss_fn, optax.sgd(LR), spec)
    opt_state = step.init(tree)
    for key in keys:
        kw, rngs = idiom.call_kwargs(key)
        kw = {k: v for k, v in kw.items() if k not in static}
        tree, opt_state, _ = step(tree, opt_state, x, y, kw, rngs=rngs)
    out = flat(tree, drop=("model",) if fw == "equinox" else ())
    if fw == "nnx":
        out = {p: v for p, v in out.items() if p[0] != "rngs"}
    return out
