"""flaxmodels (`pip install flaxmodels`, Matthias Wright's collection of Flax Linen
ports) against transformers' PyTorch twins.

GPT-2 (`flaxmodels.gpt2.GPT2Model`, against transformers' `GPT2Model`): written
with compact `nn.Dense` layers where transformers has GPT-2's `Conv1D` (`(in,
out)` weights): the fused query/key/value Dense 16 -> 48 is named `c_proj` and
the output Dense `out_proj` (transformers: `c_attn` and `c_proj`), so a name
pairs the wrong layers; the causal mask is computed on the JAX side. (flaxmodels'
`GPT2LMHeadModel` cannot be built without a pretrained checkpoint: its `setup`
sets `param_dict` only when `pretrained` is given.)

ResNet-18 (`flaxmodels.ResNet18`, against transformers'
`ResNetForImageClassification` with basic layers): flaxmodels' own Linen
`BatchNorm` (`ops.BatchNorm`: `scale`, `bias`, `batch_stats` `mean`/`var`, written
by hand), NHWC images against NCHW, explicit paddings, max pooling, the mean over
space and the classifier. ResNet-18's widths are fixed (64 to 512 channels, 11.2M
parameters)."""

from __future__ import annotations

import contextlib
import types

import numpy as np

from .code_bases import Case, hf_folder, to_numpy, torch_tensors


BATCH, SEQ = 2, 7


@contextlib.contextmanager
def old_reshape():
    """`jnp.reshape(a, newshape=...)` as flaxmodels calls it (jax 0.10 takes only
    `shape`): the one change to its code, for the duration of a route."""
    import jax.numpy as jnp

    reshape = jnp.reshape

    def reshape_newshape(a, shape=None, *args, newshape=None, **kwargs):
        return reshape(a, newshape if shape is None else shape, *args, **kwargs)

    jnp.reshape = reshape_newshape
    try:
        yield
    finally:
        jnp.reshape = reshape


def _hf_config():
    import transformers

    return transformers.GPT2Config(
        vocab_size=99,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )


def _ids() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 99, (BATCH, SEQ)).astype(np.int32)


def _gpt2():
    import jax
    import jax.numpy as jnp
    from flaxmodels.gpt2 import gpt2

    config = types.SimpleNamespace(**_hf_config().to_dict())
    module = gpt2.GPT2Model(config=config)
    variables = module.init(jax.random.key(0), input_ids=jnp.asarray(_ids()))
    return module, variables


def _gpt2_call(model) -> np.ndarray:
    import jax.numpy as jnp

    module, variables = model
    out = module.apply(variables, input_ids=jnp.asarray(_ids()))
    return to_numpy(out["last_hidden_state"])


def _hf():
    import transformers

    return transformers.GPT2Model(_hf_config()).eval()


def _hf_call(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return to_numpy(model(**torch_tensors(input_ids=_ids())).last_hidden_state)


def gpt2() -> Case:
    import transformers

    def read(folder):
        return transformers.GPT2Model.from_pretrained(folder).eval()

    return Case(
        "flaxmodels-gpt2",
        "flaxmodels",
        "linen",
        _gpt2,
        _hf,
        _gpt2_call,
        _hf_call,
        (_ids(),),
        {},
        {},
        hf_folder,
        read,
        save_kwargs={"config": _hf_config()},
        context=old_reshape,
    )


def _images() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.normal(size=(BATCH, 3, 32, 32)).astype(np.float32)


def _resnet_config():
    import transformers

    return transformers.ResNetConfig(
        embedding_size=64,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        num_labels=3,
    )


def _resnet():
    import flaxmodels
    import jax
    import jax.numpy as jnp

    module = flaxmodels.ResNet18(
        output="logits", pretrained=None, normalize=False, num_classes=3
    )
    nhwc = jnp.asarray(_images().transpose(0, 2, 3, 1))
    return module, module.init(jax.random.key(0), nhwc, train=False)


def _resnet_call(model) -> np.ndarray:
    import jax.numpy as jnp

    module, variables = model
    nhwc = jnp.asarray(_images().transpose(0, 2, 3, 1))
    return to_numpy(module.apply(variables, nhwc, train=False))


def _hf_resnet():
    import transformers

    return transformers.ResNetForImageClassification(_resnet_config()).eval()


def _hf_resnet_call(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return to_numpy(model(**torch_tensors(pixel_values=_images())).logits)


def resnet18() -> Case:
    import transformers

    def read(folder):
        return transformers.ResNetForImageClassification.from_pretrained(folder).eval()

    return Case(
        "flaxmodels-resnet18",
        "flaxmodels",
        "linen",
        _resnet,
        _hf_resnet,
        _resnet_call,
        _hf_resnet_call,
        (_images().transpose(0, 2, 3, 1),),
        {"train": False},
        torch_tensors(pixel_values=_images()),
        hf_folder,
        read,
        save_kwargs={"config": _resnet_config()},
        context=old_reshape,
    )


PACKAGE = "flaxmodels"
CASES = {"flaxmodels-gpt2": gpt2, "flaxmodels-resnet18": resnet18}
