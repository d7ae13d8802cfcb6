"""`bridge.lora`, `merge_lora`, `save_peft`/`load_peft` without PyTorch: adapters'
shapes and orientation in each framework, the training step against a hand-written
JAX LoRA step, stacks, dropout, and every error. (Against PEFT itself:
`tests/test_lora_peft.py`.)"""

import json
import os

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import bridge

from .helpers import requires, skip_unless
from .lora_models import LENGTH, OUT, VOCAB, WIDTH, models, nonzero, run


KEY = jax.random.key(7)
IDS = jnp.array([[1, 2, 3, 4, 5], [9, 0, 8, 7, 1]])
assert IDS.shape[1] == LENGTH
TARGETS = ["emb", "q", "conv", "head"]


SHAPES = {  # (lora_a, lora_b) per layer at rank 2, in each framework's orientation
    "nnx": {"emb": ((VOCAB, 2), (2, WIDTH)), "q": ((WIDTH, 2), (2, WIDTH)),
            "conv": ((3, WIDTH, 2), (2, WIDTH)), "head": ((WIDTH, 2), (2, OUT))},
    "equinox": {"emb": ((2, VOCAB), (WIDTH, 2)), "q": ((2, WIDTH), (WIDTH, 2)),
                "conv": ((2, WIDTH, 3), (WIDTH, 2)), "head": ((2, WIDTH), (OUT, 2))},
}  # fmt: skip
SHAPES["linen"] = SHAPES["nnx"]


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
def test_adapters_shapes_init_and_unchanged_output(framework):
    model = models()[framework]
    tree = bridge.lora(bridge.to_neutral(model), TARGETS, rank=2, key=KEY)
    for name, (a, b) in SHAPES[framework].items():
        layer = tree[name]
        assert (layer.lora_a.shape, layer.lora_b.shape) == (a, b), name
    # PEFT's init: lora_B zero (an embedding's lora_embedding_A zero)
    assert not np.any(tree.q.lora_b) and np.any(tree.q.lora_a)
    assert not np.any(tree.emb.lora_a) and np.any(tree.emb.lora_b)
    # the model's output is unchanged, and the given model is untouched
    native = bridge.to_native(tree)
    assert np.array_equal(run(native, IDS), run(model, IDS))
    assert "lora_a" not in str(bridge.to_neutral(model))


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
def test_merge_equals_the_adapted_forward(framework):
    model = models()[framework]
    tree = nonzero(bridge.lora(bridge.to_neutral(model), TARGETS, rank=2, key=KEY))
    merged = bridge.merge_lora(tree)
    assert "lora" not in str(merged)
    adapted, plain = (
        run(bridge.to_native(tree), IDS),
        run(bridge.to_native(merged), IDS),
    )
    np.testing.assert_allclose(plain, adapted, atol=1e-5, rtol=0)
    assert np.abs(np.asarray(adapted) - np.asarray(run(model, IDS))).max() > 1e-2
    # the merged model is the original kind of model again
    assert jax.tree_util.tree_structure(merged) == jax.tree_util.tree_structure(
        bridge.to_neutral(model)
    )


def test_trainable_lora_selects_exactly_the_adapters():
    tree = bridge.lora(bridge.to_neutral(models()["nnx"]), TARGETS, rank=2, key=KEY)
    spec = bridge.trainable(tree, "lora")
    paths = [
        jax.tree_util.keystr(p)
        for p, flag in jax.tree_util.tree_leaves_with_path(spec)
        if flag
    ]
    assert paths == [f".{n}.lora_{ab}" for n in sorted(TARGETS) for ab in "ab"]


def _loss(model, ids, y):
    return jnp.mean((model(ids) - y) ** 2)


def test_step_equals_a_hand_written_lora_step():
    """make_step with the adapter spec vs the same LoRA written by hand in JAX (an
    NNX model's layers as plain arrays): 10 Adam steps, and the base weights stay
    bit-identical."""
    model = models()["nnx"]
    tree = bridge.lora(bridge.from_nnx(model), ["q", "head"], rank=2, alpha=4, key=KEY)
    tree = nonzero(tree)
    y = jax.random.normal(jax.random.key(3), IDS.shape + (OUT,))
    opt = optax.adam(1e-2)
    step = bridge.make_step(_loss, opt, bridge.trainable(tree, "lora"), donate=False)
    state = step.init(tree)

    base = jax.tree_util.tree_map(jnp.copy, tree)  # plain arrays, by hand
    s = 4 / 2

    def forward(ad, ids):
        x = base.emb.embedding[ids]
        q = x @ base.q.kernel + base.q.bias[None, None] + s * (x @ ad["qa"]) @ ad["qb"]
        h = jax.nn.relu(q)
        h = (
            jax.lax.conv_general_dilated(
                h,
                base.conv.kernel,
                (1,),
                [(1, 1)],
                dimension_numbers=("NWC", "WIO", "NWC"),
            )
            + base.conv.bias[None, None]
        )
        return h @ base.head.kernel + s * (h @ ad["ha"]) @ ad["hb"]

    @jax.jit
    def hand_step(ad, opt_state, ids, y):
        loss, g = jax.value_and_grad(lambda a: jnp.mean((forward(a, ids) - y) ** 2))(ad)
        updates, opt_state = opt.update(g, opt_state, ad)
        return optax.apply_updates(ad, updates), opt_state, loss

    ad = {"qa": tree.q.lora_a, "qb": tree.q.lora_b,
          "ha": tree.head.lora_a, "hb": tree.head.lora_b}  # fmt: skip
    hand_state = opt.init(ad)
    for _ in range(10):
        tree, state, loss = step(tree, state, IDS, y)
        ad, hand_state, hand_loss = hand_step(ad, hand_state, IDS, y)
        np.testing.assert_allclose(loss, hand_loss, atol=1e-6, rtol=0)
    for name, leaf in (("qa", tree.q.lora_a), ("qb", tree.q.lora_b),
                       ("ha", tree.head.lora_a), ("hb", tree.head.lora_b)):  # fmt: skip
        np.testing.assert_allclose(leaf, ad[name], atol=1e-6, rtol=0, err_msg=name)
    # the base weights: bit-identical
    assert np.array_equal(tree.q.kernel, base.q.kernel)
    assert np.array_equal(tree.head.kernel, base.head.kernel)
    assert np.array_equal(tree.conv.kernel, base.conv.kernel)
    assert np.array_equal(tree.emb.embedding, base.emb.embedding)
    # optimizer state for the adapters alone
    sizes = sum(x.size for x in jax.tree_util.tree_leaves(state) if x.ndim)
    assert sizes == 2 * sum(x.size for x in ad.values())


def test_where_matching_nothing_lists_the_layers():
    with pytest.raises(ValueError, match=r"selects no layer(.|\n)*\.q \(Linear\)"):
        bridge.lora(models()["nnx"], r"k_proj", rank=2, key=KEY)


def test_rank_that_does_not_fit_names_the_layer():
    with pytest.raises(ValueError, match=r"\.q \(Linear\): rank 9 does not fit"):
        bridge.lora(models()["nnx"], ["q"], rank=9, key=KEY)


@pytest.mark.parametrize("rank", [0, -1])
def test_rank_below_one_is_refused_by_name(rank):
    with pytest.raises(ValueError, match=rf"`rank` must be at least 1, got {rank}"):
        bridge.lora(models()["nnx"], ["q"], rank=rank, key=KEY)


@requires("NNX")
def test_unsupported_layer_kind_is_named():
    model = nnx.Sequential(
        nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0))
    )
    with pytest.raises(ValueError, match=r"\.layers\[1\] \(LayerNorm\): this kind"):
        bridge.lora(model, r"layers\[1\]", rank=2, key=KEY)


def test_the_model_given_is_not_changed_and_nothing_half_applied():
    model = models()["nnx"]
    with pytest.raises(ValueError):
        bridge.lora(model, ["q", "emb"], rank=9, key=KEY)  # q fits, emb does not
    assert not hasattr(model.q, "lora_a") and type(model.q) is nnx.Linear


def _saved(tmp_path, framework="nnx", rank=2):
    tree = bridge.lora(models()[framework], TARGETS, rank=rank, alpha=4, key=KEY)
    tree = nonzero(bridge.to_neutral(tree))
    bridge.save_peft(tmp_path / "adapter", tree)
    return tree, tmp_path / "adapter"


@pytest.mark.parametrize("framework", ["linen", "equinox"])
def test_save_then_load_peft_across_frameworks(tmp_path, framework):
    """Adapters written from an NNX model, read into another framework's model:
    orientation converted, the same forward pass."""
    tree, directory = _saved(tmp_path)
    config = json.loads((directory / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
        2, 4.0, sorted(TARGETS),
    )  # fmt: skip
    base = bridge.port(
        bridge.merge_lora(tree) if False else _base_of(tree), models()[framework]
    )
    loaded = bridge.load_peft(directory, base)
    np.testing.assert_allclose(
        run(loaded, IDS), run(bridge.to_native(tree), IDS), atol=1e-5, rtol=0
    )


def _base_of(tree):
    """The base model of an adapted NNX Tree (adapters removed, weights as they are)."""
    from bridge._lora._nnx import strip

    return strip(tree, {})


def test_load_peft_refuses_unknown_keys_and_misfits(tmp_path):
    tree, directory = _saved(tmp_path)
    config = json.loads((directory / "adapter_config.json").read_text())
    config["target_modules"] = ["q", "k_proj"]
    config["use_dora"] = True
    config["surprise"] = 1
    (directory / "adapter_config.json").write_text(json.dumps(config))
    base = models()["equinox"]
    with pytest.raises(ValueError) as info:
        bridge.load_peft(directory, base)
    message = str(info.value)
    assert "unknown key(s) ['surprise']" in message
    assert "use_dora=True is not supported" in message
    assert "target module 'k_proj': no layer of the model matches it" in message
    # a PEFT dir whose shapes do not fit: a narrower model
    small = bridge.lora(
        nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0))), r".", rank=1, key=KEY
    )
    bridge.save_peft(tmp_path / "small", small)
    wide = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"layers\.0 \(\.layers\[0\], Linear\): the"):
        bridge.load_peft(tmp_path / "small", wide)
    assert not hasattr(wide.layers[0], "lora_a")


@requires("NNX")
def test_stacked_layers_take_one_adapter_per_layer(tmp_path):
    """A stack of NNX layers (nnx.vmap), Linen layers (nn.scan) and Equinox layers
    (eqx.filter_vmap): one adapter per layer on the stack's axis, written per layer
    for PEFT, read back into the stack."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return nnx.Linear(4, 4, rngs=nnx.Rngs(key))

    class Stack(nnx.Module):
        def __init__(self):
            self.layers = make(jax.random.split(jax.random.key(0), 3))

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def body(layer, x):
                return layer(x)

            return body(self.layers, x)

    model = Stack()
    tree = nonzero(bridge.lora(bridge.from_nnx(model), ["layers"], rank=2, key=KEY))
    assert tree.layers.lora_a.shape == (3, 4, 2)
    x = jnp.ones((2, 4))
    y = bridge.to_native(tree)(x)
    h = x
    for i in range(3):
        k, a, b = tree.layers.kernel[i], tree.layers.lora_a[i], tree.layers.lora_b[i]
        h = h @ k + tree.layers.bias[i][None] + (h @ a) @ b
    np.testing.assert_allclose(y, h, atol=1e-5, rtol=0)
    bridge.save_peft(tmp_path / "stack", tree)
    from safetensors.numpy import load_file

    keys = sorted(load_file(tmp_path / "stack" / "adapter_model.safetensors"))
    assert keys[:2] == [
        "base_model.model.layers.0.lora_A.weight",
        "base_model.model.layers.0.lora_B.weight",
    ]
    assert len(keys) == 6
    back = bridge.load_peft(tmp_path / "stack", Stack(), rules=None)
    np.testing.assert_allclose(
        bridge.to_neutral(back).layers.lora_b, tree.layers.lora_b, atol=0, rtol=0
    )


@pytest.mark.parametrize("framework", ["linen", "equinox"])
def test_port_carries_the_adapters(framework):
    """An NNX model with adapters ported into a plain model of another framework:
    the adapters follow their layers, orientation converted; same outputs."""
    tree = nonzero(bridge.lora(models()["nnx"], TARGETS, rank=2, key=KEY))
    tree = bridge.to_neutral(tree)
    ported = bridge.port(tree, models()[framework])
    np.testing.assert_allclose(
        run(ported, IDS), run(bridge.to_native(tree), IDS), atol=1e-5, rtol=0
    )


def test_port_into_pytorch_layout_refuses_to_drop_adapters():
    tree = bridge.lora(models()["nnx"], ["q"], rank=2, key=KEY)
    target = {  # the PyTorch model's state dict (tests/test_lora_peft.py)
        "emb.weight": np.zeros((VOCAB, WIDTH), np.float32),
        "q.weight": np.zeros((WIDTH, WIDTH), np.float32),
        "q.bias": np.zeros((WIDTH,), np.float32),
        "conv.weight": np.zeros((WIDTH, WIDTH, 3), np.float32),
        "conv.bias": np.zeros((WIDTH,), np.float32),
        "head.weight": np.zeros((OUT, WIDTH), np.float32),
    }
    with pytest.raises(ValueError, match=r"LoRA adapters \(\.q\)(.|\n)*merge_lora"):
        bridge.port(tree, target)


def test_save_and_load_a_model_with_adapters(tmp_path):
    tree = nonzero(
        bridge.to_neutral(bridge.lora(models()["nnx"], ["q"], rank=2, key=KEY))
    )
    bridge.save(tmp_path / "m.safetensors", tree)
    back = bridge.load(tmp_path / "m.safetensors", like=tree)
    assert np.array_equal(back.q.lora_b, tree.q.lora_b)
    np.testing.assert_allclose(
        run(bridge.to_native(back), IDS), run(bridge.to_native(tree), IDS), atol=0
    )


def test_a_model_without_adapters_ports_from_linen_variables_alone(tmp_path):
    """Looking for adapters never asks a model that has none for its Linen module:
    a Linen file (variables, no module) loads into NNX and Equinox models."""

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.Dense(4)(x))

    variables = Two().init(jax.random.key(0), jnp.ones((1, 2)))
    path = tmp_path / "two.safetensors"
    bridge.save(path, bridge.from_linen(variables))
    mlp = eqx.nn.MLP(2, 3, 4, 1, key=jax.random.key(1))
    loaded = bridge.load(path, like=mlp)
    # Linen names by construction: Dense_0 is the outer Dense(3), applied second
    inner, outer = variables["params"]["Dense_1"], variables["params"]["Dense_0"]
    assert (loaded.layers[0].weight == inner["kernel"].T).all()
    assert (loaded.layers[1].weight == outer["kernel"].T).all()


def _in_thread(fn, seconds=60):
    """`fn()`'s error, from a thread given `seconds` (a read that blocks fails the
    test instead of hanging the session)."""
    import threading

    out = {}

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  (the error is the result)
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the read blocked"
    return out.get("error")


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_load_peft_refuses_a_fifo_without_waiting(tmp_path, name):
    """A FIFO in place of either file is refused by name at once (read with
    `read_text` or safetensors' own loader it blocked until a writer came)."""
    _, directory = _saved(tmp_path)
    (directory / name).unlink()
    os.mkfifo(directory / name)
    error = _in_thread(lambda: bridge.load_peft(directory, models()["nnx"]))
    assert isinstance(error, ValueError), error
    assert f"{name} is not a readable PEFT adapter" in str(error) or (
        f"{name} is not a readable safetensors" in str(error)
    )
    assert "a FIFO (named pipe), not a regular file" in str(error)


def test_load_peft_refuses_a_huge_or_malformed_config(tmp_path):
    _, directory = _saved(tmp_path)
    config_file = directory / "adapter_config.json"
    good = config_file.read_text()
    with open(config_file, "a") as f:  # sparse: 11 MB of nothing, no disk used
        f.truncate(11_000_000)
    with pytest.raises(ValueError, match=r"it is 11000000 bytes, more than the 1000"):
        bridge.load_peft(directory, models()["nnx"])
    for text, reason in [
        ("[1, 2]", "it holds a JSON list, not an object"),
        ('{"r": 2, "r": 4}', r"it is not JSON \(it names \['r'\] more than once"),
        ("{" * 100_000, "it is not JSON"),
        ("\xff", "it is not JSON"),
    ]:
        config_file.write_bytes(text.encode("latin-1"))
        with pytest.raises(ValueError, match=reason):
            bridge.load_peft(directory, models()["nnx"])
    (directory / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        bridge.load_peft(directory, models()["nnx"])
    config = json.loads(good)
    config.update(r="8", lora_dropout=2, target_modules=[1], rank_pattern={"(": 2})
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        bridge.load_peft(directory, models()["nnx"])
    message = str(info.value)
    for line in [
        "r is '8', not a positive integer",
        "lora_dropout is 2, not a number from 0 to 1",
        "target_modules is [1], not a regular expression or a list of names",
    ]:
        assert line in message
    config = json.loads(good)
    config["rank_pattern"] = {"q(": 2}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"rank_pattern 'q\(' is no regular express"):
        bridge.load_peft(directory, models()["nnx"])


class WithFlaxLoRA(nnx.Module):
    """Flax's own LoRA modules: an nnx.LoRALinear, and an nnx.LoRA around an
    nnx.Linear inside an nnx.List."""

    def __init__(self, rngs):
        self.up = nnx.LoRALinear(4, 6, lora_rank=2, rngs=rngs)
        self.blocks = nnx.List(
            [nnx.LoRA(6, 3, 2, base_module=nnx.Linear(6, 2, rngs=rngs), rngs=rngs)]
        )

    def __call__(self, x):
        return self.blocks[0](jax.nn.relu(self.up(x)))


@requires("NNX")
def test_from_nnx_lora_reads_flax_lora_modules(tmp_path):
    """nnx.LoRALinear and nnx.LoRA(base_module=Linear) become bridge adapters (scaling
    1): the model's own forward pass, bit for bit; then written for PEFT and read
    into an Equinox model, and merged, with the same output."""
    model = WithFlaxLoRA(nnx.Rngs(0))
    model.up.lora.lora_b[...] = jax.random.normal(jax.random.key(1), (2, 6))
    model.blocks[0].lora_b[...] = jax.random.normal(jax.random.key(2), (3, 2))
    x = jax.random.normal(jax.random.key(3), (5, 4))
    want = model(x)
    read = bridge.from_nnx_lora(model)
    assert type(model.up) is nnx.LoRALinear  # the model given is unchanged
    assert type(model.blocks[0]) is nnx.LoRA
    assert (
        not hasattr(read.up, "lora")
        and read.up.lora_a[...] is model.up.lora.lora_a[...]
    )
    assert (read.up.lora_settings.rank, read.up.lora_settings.scaling) == (2, 1.0)
    assert read.blocks[0].lora_b.shape == (3, 2)
    assert bridge.trainable(bridge.from_nnx(read), "lora").blocks[0].lora_b is True
    np.testing.assert_array_equal(read(x), want)
    bridge.save_peft(tmp_path / "adapter", read)
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    ranks = {"up": 2, "blocks.0": 3}  # the most common rank is `r`, the other a pattern
    assert {**dict.fromkeys(ranks, config["r"]), **config["rank_pattern"]} == ranks
    assert {
        **dict.fromkeys(ranks, config["lora_alpha"]),
        **config["alpha_pattern"],
    } == ranks
    plain = bridge.merge_lora(read)
    np.testing.assert_allclose(plain(x), want, atol=1e-5, rtol=0)

    class Eqx(eqx.Module):
        up: eqx.nn.Linear
        blocks: list

        def __call__(self, x):
            return self.blocks[0](jax.nn.relu(self.up(x)))

    k = jax.random.split(jax.random.key(4), 2)
    target = Eqx(eqx.nn.Linear(4, 6, key=k[0]), [eqx.nn.Linear(6, 2, key=k[1])])
    base = bridge.port(_base_of(bridge.from_nnx(read)), target)
    loaded = bridge.load_peft(tmp_path / "adapter", base)
    np.testing.assert_allclose(jax.vmap(loaded)(x), want, atol=1e-5, rtol=0)


@requires("NNX")
def test_from_nnx_lora_refuses_what_it_cannot_read():
    class Odd(nnx.Module):
        def __init__(self, rngs):
            self.alone = nnx.LoRA(4, 2, 4, rngs=rngs)
            self.conv = nnx.LoRA(
                4, 2, 4, base_module=nnx.Conv(4, 4, (3,), rngs=rngs), rngs=rngs
            )
            self.half = nnx.LoRA(
                4, 2, 4, base_module=nnx.Linear(4, 4, rngs=rngs), dtype=jnp.bfloat16,
                rngs=rngs,
            )  # fmt: skip

    with pytest.raises(ValueError) as info:
        bridge.from_nnx_lora(Odd(nnx.Rngs(0)))
    message = str(info.value)
    assert "3 problem(s), nothing was changed" in message
    assert "alone: an nnx.LoRA without base_module" in message
    assert "conv: nnx.LoRA around a Conv" in message
    assert "half: the nnx.LoRA computes in <class 'jax.numpy.bfloat16'>" in message
    with pytest.raises(ValueError, match="holds no nnx.LoRA or nnx.LoRALinear"):
        bridge.from_nnx_lora(models()["nnx"])
    with pytest.raises(TypeError, match="reads Flax NNX models"):
        bridge.from_nnx_lora(models()["equinox"])


def test_port_opt_state_of_a_lora_step_continues_training():
    """Adam's state of an NNX LoRA step, ported with the model to Equinox (adapters
    transposed, their moments too): two more steps there equal two more steps in NNX
    then a port, and the moments are the NNX ones transposed, bit for bit."""
    ms = models()
    tree = bridge.to_neutral(bridge.lora(ms["nnx"], ["q", "head"], rank=2, key=KEY))
    y = jax.random.normal(jax.random.key(5), IDS.shape + (OUT,))
    tx = optax.adam(1e-2)
    step = bridge.make_step(_loss, tx, bridge.trainable(tree, "lora"), donate=False)
    state = step.init(tree)
    for _ in range(3):
        tree, state, _ = step(tree, state, IDS, y)
    target = bridge.to_neutral(bridge.port(tree, ms["equinox"]))
    eqx_step = bridge.make_step(
        _loss, tx, bridge.trainable(target, "lora"), donate=False
    )
    ported = bridge.port_opt_state(state, tree, target, like=eqx_step.init(target))
    mu, eqx_mu = state[0].mu, ported[0].mu
    np.testing.assert_array_equal(eqx_mu[".q.lora_a"], mu[".q.lora_a"].T)
    np.testing.assert_array_equal(eqx_mu[".head.lora_b"], mu[".head.lora_b"].T)
    for _ in range(2):
        tree, state, _ = step(tree, state, IDS, y)
        target, ported, _ = eqx_step(target, ported, IDS, y)
    want = bridge.to_neutral(bridge.port(tree, ms["equinox"]))
    for layer in ("q", "head"):
        for name in ("lora_a", "lora_b"):
            np.testing.assert_allclose(
                target[layer][name], want[layer][name], atol=1e-6, rtol=0
            )


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
def test_dropout_is_peft_lora_dropout(framework):
    """PEFT's `lora_dropout` is `nn.Dropout(p)` on the adapter's input in training
    (dropped elements 0, kept ones scaled by 1/(1-p)) and nothing in eval mode. With
    identity adapters the adapter's output is its dropped input: every element is 0
    or 2x at p=0.5, about half of each; at inference it is the input itself."""
    x = jax.random.normal(jax.random.key(0), (64, 8)) + 4.0  # no element near 0
    if framework == "nnx":
        skip_unless("NNX")
        layer = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        base = layer(x)
    elif framework == "linen":
        layer = (nn.Dense(8), nn.Dense(8).init(jax.random.key(0), x))
        base = layer[0].apply(layer[1], x)
    else:
        layer = eqx.nn.Linear(8, 8, key=jax.random.key(0))
        base = jax.vmap(layer)(x)
    tree = bridge.to_neutral(
        bridge.lora(layer, lambda t: t, rank=8, key=KEY, dropout=0.5)
    )
    tree = eqx.tree_at(lambda t: (t.lora_a, t.lora_b), tree, (jnp.eye(8), jnp.eye(8)))
    native = bridge.to_native(tree)
    keys = jax.random.split(jax.random.key(9), x.shape[0])
    if framework == "nnx":
        train = native(x)
        native.eval()
        infer = native(x)
    elif framework == "linen":
        module, variables = native.unbind()
        train = module.apply(variables, x, rngs={"dropout": jax.random.key(9)})
        infer = module.apply(variables, x)
    else:
        train = jax.vmap(lambda row, k: native(row, key=k))(x, keys)
        infer = jax.vmap(native)(x)
    np.testing.assert_allclose(infer - base, x, atol=1e-5, rtol=0)
    ratio = np.asarray((train - base) / x)
    dropped = np.isclose(ratio, 0.0, atol=1e-4)
    assert np.all(dropped | np.isclose(ratio, 2.0, atol=1e-4))
    assert 0.4 < dropped.mean() < 0.6


@pytest.mark.parametrize("framework", ["nnx", "equinox"])
def test_inspect_shows_the_adapters(tmp_path, capsys, framework):
    """`bridge inspect` on a model saved with its adapters (rank from either
    orientation, parameter share) and on a PEFT adapter file (alpha from its config,
    ranks that differ)."""
    from bridge._cli import main

    tree = bridge.lora(models()[framework], ["q", "head"], rank=2, alpha=4, key=KEY)
    tree = bridge.lora(tree, ["conv"], rank=3, alpha=5, key=KEY)
    bridge.save(tmp_path / "m.safetensors", tree)
    assert main(["inspect", str(tmp_path / "m.safetensors"), "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["lora"]
    adapters = (8 * 2 + 2 * 8) + (8 * 2 + 2 * 4) + (3 * 8 * 3 + 3 * 8)  # q, head, conv
    base = VOCAB * WIDTH + (WIDTH + 1) * WIDTH + (3 * WIDTH + 1) * WIDTH + WIDTH * OUT
    total = adapters + base
    assert lora == [
        "LoRA adapters on 3 layer(s), targets conv, head, q",
        "ranks 2 to 3",
        f"{adapters} adapter parameters, {adapters / total:.2%} of the {total} in "
        "this file",
    ]
    bridge.save_peft(tmp_path / "adapter", tree)
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    assert main(["inspect", str(weights)]) == 0
    out = capsys.readouterr().out
    assert "LoRA adapters on 3 layer(s), targets conv, head, q" in out
    assert "ranks 2 to 3, alpha 4, 5 (config r 2)" in out
    assert "(the base model is not in this file)" in out
    assert main(["inspect", str(tmp_path / "adapter" / "x.safetensors")]) != 0
    capsys.readouterr()


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("lora_alpha", [1, 2], "lora_alpha is [1, 2], not a finite number"),
        ("r", "2\x1b[31mred", "r is '2\\x1b[31mred', not a positive integer"),
        ("use_rslora", "yes", "use_rslora is 'yes', not true or false"),
        ("alpha_pattern", {"q": "\x1b[2J"}, "alpha_pattern is {'q': '\\x1b[2J'}"),
    ],
)
def test_inspect_names_a_config_field_of_another_type(
    tmp_path, capsys, field, value, said
):
    """`bridge inspect` of a PEFT adapter whose `adapter_config.json` holds a field
    of another type than PEFT's: the header is shown, with one line naming the
    field and its value escaped; no terminal escape is printed. Was: Python's
    `float() argument must be a string or a real number, not 'list'`, and the
    raw escape in `(config r 2<ESC>[31mred)`."""
    from bridge._cli import main

    tree = bridge.lora(models()["nnx"], ["q", "head"], rank=2, alpha=4, key=KEY)
    bridge.save_peft(tmp_path / "adapter", tree)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config[field] = value
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    assert main(["inspect", str(weights)]) == 0
    out = capsys.readouterr().out
    assert f"adapter_config.json: {said}" in out
    assert "its rank and alpha are not read" in out and "\x1b" not in out
    assert "LoRA adapters on 2 layer(s), targets head, q" in out
