"""ESM-2 in Equinox (`pip install esm2quinox`, Patrick Kidger's port of Meta's
protein language model) against transformers' `EsmForMaskedLM`.

What sets it apart: the transformer layers are built with `eqx.filter_vmap` and
run with `eqx.partition` + `lax.scan` (every layer's arrays stacked `(L, ...)`);
the embedding is the logit head's `linear2.weight` used a second time (a tie
inside the JAX model; transformers ties `lm_head.decoder.weight` to the word
embeddings and keeps a separate `lm_head.bias`); rotary embeddings (transformers
stores `inv_freq` as a buffer); transformers' `EsmModel` has a contact-prediction
head no forward pass of the masked LM uses."""

from __future__ import annotations

import numpy as np

from .code_bases import Case, hf_folder, to_numpy, torch_tensors


BATCH, SEQ, LAYERS, EMBED, HEADS = 2, 7, 2, 16, 2


def _tokens() -> np.ndarray:
    """`<cls>` residues `<eos>`, no padding and no mask token (ESM's alphabet: 4..28
    are residues)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 29, (BATCH, SEQ)).astype(np.int32)
    tokens[:, 0], tokens[:, -1] = 0, 2
    return tokens


def _hf_config():
    import transformers

    return transformers.EsmConfig(
        vocab_size=33,
        hidden_size=EMBED,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=4 * EMBED,
        max_position_embeddings=32,
        position_embedding_type="rotary",
        token_dropout=True,
        mask_token_id=32,
        pad_token_id=1,
        layer_norm_eps=1e-5,  # ESM-2's (and Equinox's LayerNorm default)
        emb_layer_norm_before=False,
    )


def _esm2():
    import esm2quinox
    import jax

    return esm2quinox.ESM2(LAYERS, EMBED, HEADS, True, key=jax.random.key(0))


def _esm2_call(model) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    return to_numpy(jax.vmap(model)(jnp.asarray(_tokens())).logits)


def _hf():
    import transformers

    return transformers.EsmForMaskedLM(_hf_config()).eval()


def _hf_call(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(**torch_tensors(input_ids=_tokens()))
    return to_numpy(out.logits)


def esm2() -> Case:
    import transformers

    def read(folder):
        return transformers.EsmForMaskedLM.from_pretrained(folder).eval()

    return Case(
        "esm2",
        "esm2quinox",
        "equinox",
        _esm2,
        _hf,
        _esm2_call,
        _hf_call,
        (_tokens(),),
        {},
        {},
        hf_folder,
        read,
        save_kwargs={"config": _hf_config()},
        # transformers' EsmModel holds a contact-prediction head whatever the task;
        # no forward pass of the masked LM runs it, and esm2quinox has none
        left_out=("contact_head", "inv_freq"),  # a head no pass runs; computed
    )


def by_hand(torch_model):
    """transformers' `EsmForMaskedLM` state as an esm2quinox `ESM2`, mapped by hand
    from the two codes, no bridge: the oracle that the twins compute alike. The
    layers' arrays stacked on a leading axis; the embedding is the logit head's
    `linear2.weight`, its bias transformers' `lm_head.bias`; the contact head and
    the rotary `inv_freq` (computed by Equinox) left out."""
    import equinox as eqx
    import jax.numpy as jnp

    state = {
        k: jnp.asarray(v.detach().numpy()) for k, v in torch_model.state_dict().items()
    }
    layer = "esm.encoder.layer.{}."

    def stacked(name):
        return jnp.stack([state[layer.format(i) + name] for i in range(LAYERS)])

    names = {
        "attn.query_proj": "attention.self.query",
        "attn.key_proj": "attention.self.key",
        "attn.value_proj": "attention.self.value",
        "attn.output_proj": "attention.output.dense",
        "layer_norm1": "attention.LayerNorm",
        "layer_norm2": "LayerNorm",
        "linear1": "intermediate.dense",
        "linear2": "output.dense",
    }
    model = _esm2()
    pairs = {}
    for ours, theirs in names.items():
        pairs[f"layers.{ours}.weight"] = stacked(theirs + ".weight")
        pairs[f"layers.{ours}.bias"] = stacked(theirs + ".bias")
    single = {
        "layer_norm": "esm.encoder.emb_layer_norm_after",
        "logit_head.layer_norm": "lm_head.layer_norm",
        "logit_head.linear1": "lm_head.dense",
    }
    for ours, theirs in single.items():
        pairs[f"{ours}.weight"] = state[theirs + ".weight"]
        pairs[f"{ours}.bias"] = state[theirs + ".bias"]
    pairs["logit_head.linear2.weight"] = state["esm.embeddings.word_embeddings.weight"]
    pairs["logit_head.linear2.bias"] = state["lm_head.bias"]

    def get(m, dotted):
        for part in dotted.split("."):
            m = getattr(m, part)
        return m

    for dotted, value in pairs.items():
        model = eqx.tree_at(lambda m, d=dotted: get(m, d), model, value)
    return model


PACKAGE = "esm2quinox"
CASES = {"esm2": esm2}
