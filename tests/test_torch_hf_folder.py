"""Hugging Face folders out: a tiny Llama (transformers, random weights, no download)
ported into the same model written in NNX and in Equinox, then saved with
`bridge.save_pretrained(folder, model, max_shard_size=..., config=...)`:
`AutoModelForCausalLM.from_pretrained(folder)` opens it with no other step and gives
transformers' logits bit for bit; the folder's files, index and shard names are
those `save_pretrained` writes for the same model. Skipped without torch and
transformers (`nox -s tests_torch`)."""

import json
import os

import equinox as eqx
import jax.numpy as jnp
import pytest
from flax import nnx
from safetensors import safe_open

import bridge

from .helpers import requires
from .hf_common import eqx_node, node, perturb


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, requires("NNX")]

D, FF, VOCAB, LAYERS, HEADS, KV = 16, 32, 64, 2, 4, 2
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 40]])
SHARD = "12KB"  # several shards


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=FF,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return perturb(transformers.LlamaForCausalLM(config), torch)


def _frameworks():
    rngs = nnx.Rngs(0)
    keys = iter(jnp.arange(1000))
    nnx_fw = dict(
        node=node,
        seq=nnx.List,
        linear=lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs),
        norm=lambda: nnx.RMSNorm(D, epsilon=1e-6, rngs=rngs),
        embed=lambda: nnx.Embed(VOCAB, D, rngs=rngs),
    )

    def key():
        import jax

        return jax.random.key(int(next(keys)))

    eqx_fw = dict(
        node=eqx_node,
        seq=list,
        linear=lambda i, o: eqx.nn.Linear(i, o, use_bias=False, key=key()),
        norm=lambda: eqx.nn.RMSNorm(D, eps=1e-6, use_bias=False),
        embed=lambda: eqx.nn.Embedding(VOCAB, D, key=key()),
    )
    return {"nnx": nnx_fw, "equinox": eqx_fw}


def llama_in(fw):
    """transformers' `LlamaForCausalLM` module tree, in NNX or Equinox layers."""
    f = _frameworks()[fw]
    lin, norm = f["linear"], f["norm"]

    def layer():
        attn = f["node"](
            q_proj=lin(D, D),
            k_proj=lin(D, D // HEADS * KV),
            v_proj=lin(D, D // HEADS * KV),
            o_proj=lin(D, D),
        )
        mlp = f["node"](gate_proj=lin(D, FF), up_proj=lin(D, FF), down_proj=lin(FF, D))
        return f["node"](
            self_attn=attn,
            mlp=mlp,
            input_layernorm=norm(),
            post_attention_layernorm=norm(),
        )

    body = f["node"](
        embed_tokens=f["embed"](),
        layers=f["seq"]([layer() for _ in range(LAYERS)]),
        norm=norm(),
    )
    return f["node"](model=body, lm_head=lin(D, VOCAB))


def ported(hf, fw):
    """`hf`'s weights in the NNX or Equinox Llama (its `LlamaRMSNorm`s are RMSNorms)."""
    return bridge.port(hf, llama_in(fw))


@pytest.mark.parametrize("fw", ["nnx", "equinox"])
def test_llama_folder_opens_with_from_pretrained(tmp_path, fw):
    hf = _llama()
    model = ported(hf, fw)
    out = tmp_path / "out"
    bridge.save_pretrained(
        out,
        model,
        max_shard_size=SHARD,
        config=hf.config,
        generation_config=hf.generation_config,
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, hf(IDS).logits)
    reference = tmp_path / "reference"
    hf.save_pretrained(reference, max_shard_size=SHARD)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in reference.iterdir())
    assert len([n for n in names if n.startswith("model-")]) >= 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    expected = json.loads((reference / "model.safetensors.index.json").read_text())
    assert index == expected  # the same shards, names and sizes
    for name in names:
        if name.endswith(".safetensors"):
            assert _shard(out / name) == _shard(reference / name), name


def _shard(file):
    """A shard's metadata and arrays (as bytes): safetensors' own writer orders the
    data differently, the contents are the same."""
    with safe_open(file, "np") as f:
        return f.metadata(), {k: f.get_tensor(k).tobytes() for k in f.keys()}


def test_config_from_the_source_folder(tmp_path):
    hf = _llama()
    source = tmp_path / "source"
    hf.save_pretrained(source)
    out = tmp_path / "out"
    bridge.save_pretrained(out, ported(hf, "nnx"), config=source)
    assert (out / "generation_config.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, hf(IDS).logits)


# --- no atomic exchange: the folder replaced in place, whole at every instant ---------


def _version_saver(hf):
    """`save(path, version, max_shard_size)`: `hf`'s Llama with every array `version`,
    saved as a Hugging Face folder (the same config.json each time)."""
    import jax

    tree = bridge.from_torch(hf)

    def save(path, version, max_shard_size):
        arrays = jax.tree.map(lambda x: jnp.full(x.shape, version, x.dtype), tree)
        bridge.save_pretrained(
            path, arrays, max_shard_size=max_shard_size, config=hf.config
        )

    return save


def _versions(folder):
    """The version transformers' `from_pretrained` reads in `folder`, and bridge's
    `load`: one value each (a mix of versions fails)."""
    import jax

    from .corpus.writes import one_value

    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ours = bridge.load(folder)
    return (
        one_value(p.detach().numpy() for p in theirs.parameters()),
        one_value(jax.tree.leaves(ours)),
    )


def test_without_an_atomic_exchange_every_instant_of_a_save_is_a_whole_folder(
    tmp_path, monkeypatch
):
    """Where the filesystem cannot exchange two directories (NFS, some FUSE, the
    accelerator's gVisor), a save of a Hugging Face folder over one of the same
    config.json moves its files into the folder itself. The directory is copied
    before every change the save makes (each copy is what a `kill -9` then
    leaves): `AutoModelForCausalLM.from_pretrained` opens every copy, as the old or
    the new model, and bridge reads the same version; from one file to shards,
    shards to shards (other counts, then the same names), shards to one file. The
    next save over a copy leaves the folder clean. Was: the old folder renamed
    aside, then the new one in: killed between, no folder at the path
    (`from_pretrained` fails; only bridge read the one aside)."""
    from bridge._io import _atomic

    from .corpus import writes

    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    save = _version_saver(_llama())
    root = tmp_path / "root"
    root.mkdir()
    path = root / "hf"
    save(path, 1.0, "50GB")
    sizes = [(2.0, "12KB"), (3.0, "8KB"), (4.0, "8KB"), (5.0, "50GB")]
    for n, (version, size) in enumerate(sizes):
        store = tmp_path / f"copies{n}"
        store.mkdir()
        with writes.recorded(root, store) as steps:
            save(path, version, size)
        assert _versions(path) == (version, version)
        seen = []
        for copy, call in zip(steps.copies, steps.names, strict=True):
            theirs, ours = _versions(copy / "hf")
            assert theirs == ours, f"killed before {call}: {theirs} != {ours}"
            seen.append(theirs)
        assert seen[0] == version - 1 and seen[-1] == version
        assert set(seen) == {version - 1, version}
        last = steps.copies[len(steps.copies) // 2] / "hf"
        save(last, 9.0, size)  # the next save clears what the killed one left
        assert _versions(last) == (9.0, 9.0)
        assert sorted(os.listdir(last)) == sorted(os.listdir(path)), call
        assert not [p for p in os.listdir(last.parent) if "bridge" in p]
