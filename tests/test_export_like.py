"""A JAX rewrite of a Hugging Face model, with names and an attribute order of its
own, exported for the PyTorch model it rewrites (issue 37):
`bridge.save_state_dict(path, model, like=torch_model, example=(ids,))` pairs the
rewrite's layers with the torch model's by both forward passes (as `bridge.port`
does), never by how alike the names look, and writes the torch model's names. The
oracle: the torch model's own forward pass after `load_state_dict(strict=True)` or
`from_pretrained`. Without `example`, names that differ where shapes could pair them
are refused, saying so."""

import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import bridge

from . import llamas
from .helpers import requires
from .hf_common import eqx_node, node, over_leading
from .llamas import attend, llama_config, rotary, rotate, tokens
from .test_port_tables import TABLE, X, _computed, _run_torch, _torch_model
from .test_torch_side_by_side import TorchGated, X as X_MLP, _torch_out


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.torch, requires("NNX")]

D, F, V, H, KV = llamas.DIM, llamas.HIDDEN, llamas.VOCAB, llamas.HEADS, llamas.KV_HEADS
EPS, LAYERS, HD = llamas.EPS, llamas.LAYERS, D // H


def _forward(model, ids, call):
    """Llama's computation over a rewrite's own names: `ffn.up` is the branch
    under SiLU (Llama's `gate_proj`), `ffn.gate` the linear one (its `up_proj`):
    names that suggest the swapped pairing. `call(layer, x)` applies one layer."""
    cos, sin = rotary(ids.shape[1], HD)
    x = call(model.tokens, ids)
    b, t = ids.shape
    for block in model.blocks:
        h = call(block.norm_attn, x)
        a = block.attn
        q = rotate(call(a.query, h).reshape(b, t, H, HD), cos, sin)
        k = rotate(call(a.key, h).reshape(b, t, KV, HD), cos, sin)
        v = call(a.value, h).reshape(b, t, KV, HD)
        x = x + call(a.out, attend(q, k, v).reshape(b, t, D))
        h = call(block.norm_ffn, x)
        f = block.ffn
        x = x + call(f.down, jax.nn.silu(call(f.up, h)) * call(f.gate, h))
    return call(model.head, call(model.final_norm, x))


def _parts(linear, norm, make):
    """A rewrite's layers, created in an order of its own (the head first, the
    norms last); `make(**children)` a module holding children."""

    def block():
        return make(
            ffn=make(down=linear(F, D), gate=linear(D, F), up=linear(D, F)),
            attn=make(out=linear(D, D), value=linear(D, KV * HD),
                      key=linear(D, KV * HD), query=linear(D, D)),
            norm_ffn=norm(),
            norm_attn=norm(),
        )  # fmt: skip

    return dict(head=linear(D, V), blocks=[block() for _ in range(LAYERS)])


class NnxRewrite(nnx.Module):
    def __init__(self, rngs):
        parts = _parts(
            lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs),
            lambda: nnx.RMSNorm(D, epsilon=EPS, rngs=rngs),
            node,
        )
        self.head = parts["head"]
        self.blocks = nnx.List(parts["blocks"])
        self.tokens = nnx.Embed(V, D, rngs=rngs)
        self.final_norm = nnx.RMSNorm(D, epsilon=EPS, rngs=rngs)

    def __call__(self, ids):
        return _forward(self, ids, lambda layer, x: layer(x))


class EqxRewrite(eqx.Module):
    head: eqx.nn.Linear
    blocks: list
    tokens: eqx.nn.Embedding
    final_norm: eqx.nn.RMSNorm

    def __init__(self, seed):
        keys = iter(jax.random.split(jax.random.key(seed), 64))
        parts = _parts(
            lambda i, o: eqx.nn.Linear(i, o, use_bias=False, key=next(keys)),
            lambda: eqx.nn.RMSNorm(D, eps=EPS, use_bias=False),
            eqx_node,
        )
        self.head = parts["head"]
        self.blocks = parts["blocks"]
        self.tokens = eqx.nn.Embedding(V, D, key=next(keys))
        self.final_norm = eqx.nn.RMSNorm(D, eps=EPS, use_bias=False)

    def __call__(self, ids):
        """One sequence `(T,)`, as Equinox models take one example."""
        return _forward(self, ids[None], over_leading)[0]


def _rewrite(fw):
    """The rewrite, its weights ported from a transformers Llama (so the test
    holds whatever the initialisation), and that Llama."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(llama_config()).eval()
    empty = NnxRewrite(nnx.Rngs(0)) if fw == "nnx" else EqxRewrite(0)
    return bridge.port(hf, empty, example=(tokens(),)), hf


@pytest.fixture(scope="module", params=["nnx", "equinox"])
def rewrite(request):
    return _rewrite(request.param)


def _run(model, ids) -> np.ndarray:
    """The rewrite's logits (an Equinox model over the batch, as bridge runs it)."""
    if isinstance(model, eqx.Module):
        return np.asarray(jax.vmap(model)(ids))
    return np.asarray(model(ids))


def _logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids))).logits.numpy()


def _other_llama(seed=5):
    """The torch model the export is for, with weights of its own (the export's
    must replace every one of them)."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config()).eval()


def _up(model) -> np.ndarray:
    """The first block's `ffn.up` as a `(out, in)` weight: the SiLU branch."""
    up = model.blocks[0].ffn.up
    return np.asarray(up.weight if isinstance(up, eqx.nn.Linear) else up.kernel[...].T)


def test_a_rewrite_saved_like_its_torch_model_loads_strictly(tmp_path, rewrite):
    """One safetensors file, the torch module as the reference: every layer takes
    the name of the one it computes as (`ffn.up`, under SiLU, is `gate_proj`,
    whatever its name suggests); torch's logits are the rewrite's."""
    model, _ = rewrite
    ids = tokens()
    path = tmp_path / "model.safetensors"
    bridge.save_state_dict(path, model, like=_other_llama(), example=(ids,))
    state = safetensors.numpy.load_file(str(path))
    np.testing.assert_array_equal(
        state["model.layers.0.mlp.gate_proj.weight"], _up(model)
    )
    hf = _other_llama(seed=6)
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    np.testing.assert_allclose(_logits(hf, ids), _run(model, ids), rtol=1e-5, atol=1e-6)


def test_a_rewrite_saved_as_a_folder_for_a_meta_model_opens_with_from_pretrained(
    tmp_path, rewrite
):
    """A Hugging Face folder, the reference built from its config on the `meta`
    device (no memory): `from_pretrained` gives the rewrite's logits."""
    model, _ = rewrite
    ids = tokens()
    with torch.device("meta"):
        like = transformers.LlamaForCausalLM(llama_config())
    out = tmp_path / "out"
    bridge.save_pretrained(out, model, like=like, example=(ids,), config=llama_config())
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(_logits(hf, ids), _run(model, ids), rtol=1e-5, atol=1e-6)


def test_a_rewrite_saved_like_a_hugging_face_folder(tmp_path, rewrite):
    """The reference a folder (`save_pretrained`'s): its model is built from its
    `config.json` to trace, and the names written are the folder's keys."""
    model, _ = rewrite
    ids = tokens()
    _other_llama().save_pretrained(tmp_path / "reference")
    path = tmp_path / "model.safetensors"
    bridge.save_state_dict(path, model, like=tmp_path / "reference", example=(ids,))
    hf = _other_llama(seed=6)
    state = safetensors.numpy.load_file(str(path))
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    np.testing.assert_allclose(_logits(hf, ids), _run(model, ids), rtol=1e-5, atol=1e-6)


def test_without_example_the_refusal_says_to_pass_it(tmp_path, rewrite):
    """No example inputs: the rewrite's names are not the reference's, and shapes
    alone cannot tell `ffn.up` from `ffn.gate`: refused, saying what pairs them;
    nothing written."""
    model, hf = rewrite
    path = tmp_path / "model.safetensors"
    with pytest.raises(ValueError) as refused:
        bridge.save_state_dict(path, model, like=hf)
    text = str(refused.value)
    assert "none of the 21 name(s) the export would write is\none of" in text
    assert "The export's are head.weight, blocks.0.ffn.down.weight" in text
    assert "the reference's model.embed_tokens.weight" in text
    assert "Pass example= inputs" in text
    with pytest.raises(ValueError, match="has no forward pass to pair the layers by"):
        bridge.save_state_dict(path, model, like=hf.state_dict(), example=(tokens(),))
    assert list(tmp_path.iterdir()) == []


def test_a_tied_head_is_written_once_as_save_pretrained_writes_it(tmp_path):
    """A reference that ties `lm_head` to the embeddings, built on `meta` (no
    storage tells the tie: the one parameter under two names does): the rewrite's
    head and embedding, equal, go to that one array, written once."""
    config = llama_config()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    ids = tokens()
    model = bridge.port(hf, NnxRewrite(nnx.Rngs(0)), example=(ids,))
    with torch.device("meta"):
        like = transformers.LlamaForCausalLM(config)
    out = tmp_path / "out"
    bridge.save_pretrained(out, model, like=like, example=(ids,), config=config)
    written = safetensors.numpy.load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(
        _logits(back, ids), _run(model, ids), rtol=1e-5, atol=1e-6
    )


def test_the_model_s_dtypes_are_written(tmp_path, rewrite):
    """A bfloat16 rewrite against a float32 reference: written bfloat16, its own
    arrays bit for bit (not cast to the reference's dtype, not refused)."""
    model, hf = rewrite
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), bridge.to_neutral(model))
    path = tmp_path / "model.safetensors"
    bridge.save_state_dict(path, half, like=hf, example=(tokens(),))
    written = safetensors.numpy.load_file(str(path))
    assert {str(v.dtype) for v in written.values()} == {"bfloat16"}
    np.testing.assert_array_equal(
        written["model.layers.0.mlp.gate_proj.weight"],
        _up(model).astype(jnp.bfloat16),
    )


def test_rules_pair_first_and_a_prefix_is_refused(tmp_path, rewrite):
    """`rules` (import rules, read backwards) pair what they name, the forward
    passes the rest; a `prefix` would rename `like`'s names: refused."""
    model, hf = rewrite
    ids = tokens()
    path = tmp_path / "model.safetensors"
    rules = {r"model\.layers\.(\d+)\.mlp\.gate_proj": r".blocks[\1].ffn.up"}
    bridge.save_state_dict(path, model, like=hf, example=(ids,), rules=rules)
    state = safetensors.numpy.load_file(str(path))
    hf = _other_llama(seed=6)
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    np.testing.assert_allclose(_logits(hf, ids), _run(model, ids), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"`prefix` \('model\.'\) with `like` and"):
        bridge.save_state_dict(
            tmp_path / "p.safetensors", model, like=hf, example=(ids,), prefix="model."
        )
    assert not (tmp_path / "p.safetensors").exists()


def test_strict_false_still_writes_the_reference_s_stored_table(tmp_path):
    """`strict=False` with `example`: a stored sinusoidal table the model computes
    is written from the reference, as without `example`; refused with
    `strict=True`."""
    path = tmp_path / "model.safetensors"
    like = _torch_model(TABLE)
    with pytest.raises(ValueError, match=r"computed by the model: embed_positions"):
        bridge.save_state_dict(path, _computed(), like=like, example=(X,))
    assert not path.exists()
    bridge.save_state_dict(path, _computed(), like=like, example=(X,), strict=False)
    restored = _torch_model(np.zeros_like(TABLE))
    written = safetensors.numpy.load_file(str(path))
    restored.load_state_dict({k: torch.tensor(v) for k, v in written.items()})
    module, variables = _computed()
    np.testing.assert_allclose(
        _run_torch(restored), module.apply(variables, X), atol=1e-6
    )


class _ConvNet(torch.nn.Module):
    """A convolution, a BatchNorm and a head, taking images channel-last."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x.permute(0, 3, 1, 2))).mean((2, 3)))


class _ConvRewrite(nnx.Module):
    def __init__(self, rngs):
        self.head = nnx.Linear(4, 2, rngs=rngs)
        self.norm = nnx.BatchNorm(4, use_running_average=True, rngs=rngs)
        self.features = nnx.Conv(3, 4, (3, 3), padding="VALID", rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(self.features(x)).mean((1, 2)))


def test_a_conv_net_with_batch_norm_takes_its_layouts_and_a_fresh_counter(tmp_path):
    """OIHW convolution, running statistics, `num_batches_tracked` written fresh
    (0, as a new module holds it: never ported); a setting that differs between
    paired layers is warned of, as `bridge.port` warns."""
    model = _ConvRewrite(nnx.Rngs(0))
    model.norm.mean[...] = jnp.arange(4.0)
    model.norm.var[...] = jnp.arange(1.0, 5.0)
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)
    path = tmp_path / "model.safetensors"
    with pytest.warns(bridge.PortWarning, match=r"momentum is 0\.99 in the source"):
        bridge.save_state_dict(path, model, like=_ConvNet(), example=(x,))
    written = safetensors.numpy.load_file(str(path))
    assert written["bn.num_batches_tracked"] == 0
    back = _ConvNet().eval()
    back.load_state_dict({k: torch.tensor(v) for k, v in written.items()}, strict=True)
    with torch.no_grad():
        out = back(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, model(x), rtol=1e-5, atol=1e-6)


class _SameNamesSwapped(nnx.Module):
    """Llama's MLP with Llama's names, but `up_proj` under SiLU: the names say
    the opposite of the computation."""

    def __init__(self, rngs):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.gate_proj, self.up_proj, self.down_proj = (
            linear(4, 8),
            linear(4, 8),
            linear(8, 4),
        )

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.up_proj(x)) * self.gate_proj(x))


def test_identical_names_that_the_computation_contradicts_are_refused(tmp_path):
    """Names equal on both sides but the roles swapped: refused, naming the
    pairing the computation shows; with the rules it offers, exact."""
    model, target = _SameNamesSwapped(nnx.Rngs(0)), TorchGated().eval()
    path = tmp_path / "model.safetensors"
    with pytest.raises(bridge.PortError, match="side by side") as refused:
        bridge.save_state_dict(path, model, like=target, example=(X_MLP,))
    assert not path.exists()
    message = str(refused.value)
    assert ".up_proj -> .gate_proj" in message and ".gate_proj -> .up_proj" in message
    with pytest.raises(bridge.PortError, match="side by side"):  # and into JAX
        bridge.port(target, _SameNamesSwapped(nnx.Rngs(1)), example=(X_MLP,))
    rules = {r"\.up_proj": ".gate_proj", r"\.gate_proj": ".up_proj"}
    bridge.save_state_dict(path, model, like=target, example=(X_MLP,), rules=rules)
    state = safetensors.numpy.load_file(str(path))
    target.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    np.testing.assert_allclose(_torch_out(target), model(X_MLP), rtol=1e-5, atol=1e-6)


def test_the_export_guide_s_block_runs(tmp_path, monkeypatch):
    """The export guide's PyTorch block (a fragment there: the guides' blocks run
    without torch), run as written."""
    page = Path(__file__).parent.parent / "docs" / "guides" / "export.md"
    code = re.findall(r'```py title="Fragment: needs torch and transformers[^"]*"\n'
                      r"(.*?)```", page.read_text(), re.S)  # fmt: skip
    code = [c for c in code if "save_state_dict" in c]  # the rewrite's block
    assert len(code) == 1 and "example=" in code[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code[0], str(page), "exec"), {"__name__": "page"})
