"""equimo (`pip install equimo`, modern vision models in Equinox) against
transformers' PyTorch twins.

DINOv2 (`equimo.models.VisionTransformer` with its DINOv2 settings, against
transformers' `Dinov2Model`): a fused `qkv` Linear `(3D, D)` where transformers
has three Linears; a class token stored `(1, D)` and a position table `(N, D)`
where transformers stores `(1, 1, D)` and `(1, N, D)`; layer-scale vectors used
elementwise; both sides' `mask_token` unused by a forward pass without a mask.
Images are channels-first on both sides (equimo takes one `(C, H, W)` image)."""

from __future__ import annotations

import numpy as np

from .code_bases import Case, hf_folder, to_numpy, torch_tensors


BATCH, SIZE, PATCH, DIM, HEADS, DEPTH = 2, 8, 4, 16, 2, 2


def _images() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.normal(size=(BATCH, 3, SIZE, SIZE)).astype(np.float32)


def _hf_config():
    import transformers

    return transformers.Dinov2Config(
        hidden_size=DIM,
        num_hidden_layers=DEPTH,
        num_attention_heads=HEADS,
        mlp_ratio=4,
        image_size=SIZE,
        patch_size=PATCH,
        layer_norm_eps=1e-6,
        hidden_act="gelu",
        layerscale_value=1.0,
    )


def _equimo():
    import jax
    from equimo.models import VisionTransformer

    return VisionTransformer(
        img_size=SIZE,
        in_channels=3,
        dim=DIM,
        patch_size=PATCH,
        num_heads=HEADS,
        depths=[DEPTH],
        key=jax.random.key(0),
        use_mask_token=True,
        reg_tokens=0,
        init_values=1.0,
        eps=1e-6,
        act_layer="exactgelu",
        num_classes=0,
        global_pool="",  # every token, as transformers' last_hidden_state
    )


def _kwargs() -> dict:
    import jax

    return {"key": jax.random.key(0), "inference": True}


def _equimo_call(model) -> np.ndarray:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    model = eqx.nn.inference_mode(model)
    kwargs = _kwargs()
    return to_numpy(jax.vmap(lambda x: model(x, **kwargs))(jnp.asarray(_images())))


def _hf():
    import transformers

    return transformers.Dinov2Model(_hf_config()).eval()


def _hf_call(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(**torch_tensors(pixel_values=_images()))
    return to_numpy(out.last_hidden_state)


def dinov2() -> Case:
    import transformers

    def read(folder):
        return transformers.Dinov2Model.from_pretrained(folder).eval()

    return Case(
        "equimo-dinov2",
        "equimo",
        "equinox",
        _equimo,
        _hf,
        _equimo_call,
        _hf_call,
        (_images(),),
        _kwargs(),
        {},
        hf_folder,
        read,
        save_kwargs={"config": _hf_config()},
    )


def by_hand(torch_model):
    """transformers' `Dinov2Model` state as equimo's `VisionTransformer`, mapped by
    hand from the two codes, no bridge: the oracle that the twins compute alike.
    `q_proj`, `k_proj`, `v_proj` concatenated into `qkv` (rows `(3, heads,
    head_dim)`); the class token and position table without their leading 1; the
    patch bias `(D, 1, 1)` as Equinox's Conv2d holds it; `layer_scale{1,2}.lambda1`
    as `ls{1,2}.gamma`, `norm1`/`norm2` as `prenorm`/`norm`."""
    import equinox as eqx
    import jax.numpy as jnp

    state = {
        k: jnp.asarray(v.detach().numpy()) for k, v in torch_model.state_dict().items()
    }
    pairs = {
        "patch_embed.proj.weight": state[
            "embeddings.patch_embeddings.projection.weight"
        ],
        "patch_embed.proj.bias": state["embeddings.patch_embeddings.projection.bias"][
            :, None, None
        ],
        "global_pos_embed.weight": state["embeddings.position_embeddings"][0],
        "cls_token": state["embeddings.cls_token"][0],
        "mask_token": state["embeddings.mask_token"],
        "norm.weight": state["layernorm.weight"],
        "norm.bias": state["layernorm.bias"],
    }
    for i in range(DEPTH):
        theirs = f"encoder.layer.{i}."
        ours = f"blocks.0.blocks.{i}."
        for a, b in (
            ("prenorm", "norm1"),
            ("norm", "norm2"),
            ("attn.proj", "attention.o_proj"),
            ("mlp.fc1", "mlp.fc1"),
            ("mlp.fc2", "mlp.fc2"),
        ):
            pairs[ours + a + ".weight"] = state[theirs + b + ".weight"]
            pairs[ours + a + ".bias"] = state[theirs + b + ".bias"]
        for part in ("weight", "bias"):
            pairs[ours + "attn.qkv." + part] = jnp.concatenate(
                [state[f"{theirs}attention.{p}_proj.{part}"] for p in "qkv"]
            )
        pairs[ours + "ls1.gamma"] = state[theirs + "layer_scale1.lambda1"]
        pairs[ours + "ls2.gamma"] = state[theirs + "layer_scale2.lambda1"]

    def get(m, dotted):
        for part in dotted.split("."):
            m = m[int(part)] if part.isdigit() else getattr(m, part)
        return m

    model = _equimo()
    for dotted, value in pairs.items():
        model = eqx.tree_at(lambda m, d=dotted: get(m, d), model, value)
    return model


PACKAGE = "equimo"
CASES = {"equimo-dinov2": dinov2}
