"""Harness A: Hugging Face transformers' own Flax (Linen) model classes against their
PyTorch twins, ported by bridge with no rules, four routes each.

transformers 4.x (the last releases with Flax classes: 4.57) is needed; the classes
are the library's own, nothing here is rewritten. Each architecture is built tiny
with random weights (every parameter perturbed, so that a norm's scale of ones or a
bias of zeros cannot hide a misplaced array), and each route's outputs are compared
with the reference framework's:

- `torch->flax`: `bridge.port(torch_model, (flax_module, variables), example=...)`;
- `folder->flax`: `save_pretrained(folder)`, then
  `bridge.load(folder, like=(flax_module, variables), example=...)`;
- `flax->torch`: `bridge.port((flax_module, variables), torch_model, example=...)`,
  then `torch_model.load_state_dict(..., strict=True)`;
- `flax->folder`: `bridge.save_pretrained(folder, (flax_module, variables),
  config=config, like=torch_model, example=...)`, then
  `TorchClass.from_pretrained(folder)` (both forward passes pair the layers, as in
  `flax->torch`, and `torch_model`'s names are written).

The example inputs are the arrays transformers' own wrapper passes to
`module.apply` (recorded on one call), split into the leading positional arrays
both frameworks' calls take alike (`input_ids`, ...) and keyword arguments per side
(an image is NCHW for PyTorch, NHWC for the Flax module).

Outcome of a route: `exact` (every output both frameworks name within 1e-4 of the
reference, relative to its largest magnitude when above 1), `refused` (a
`PortError` or `CheckpointError`: its first line is kept), `wrong` (no error, the
outputs differ: silently wrong), `crash` (any other exception).
`python -m tests.public.hf_flax` prints the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import tempfile
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


ROUTES = ("torch->flax", "folder->flax", "flax->torch", "flax->folder")
TOLERANCE = 1e-4
BATCH, SEQ, DEC_SEQ, VOCAB = 2, 7, 5, 99

_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=32,
)
_SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    max_position_embeddings=32,
)
T5 = dict(
    vocab_size=VOCAB,
    d_model=16,
    d_kv=8,
    d_ff=32,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=2,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    decoder_start_token_id=0,
)
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)
WHISPER = dict(
    vocab_size=VOCAB,
    num_mel_bins=8,
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    max_source_positions=8,
    max_target_positions=32,
    decoder_start_token_id=1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    suppress_tokens=None,
    begin_suppress_tokens=None,
)
_VISION = dict(
    image_size=8,
    patch_size=4,
    num_channels=3,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
)


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture: its family, transformers' model type and tiny config, and
    the inputs of the Flax wrapper's call (numpy; the PyTorch call takes the same
    names, as tensors, except where `torch_inputs` says otherwise)."""

    family: str
    model_type: str
    config: dict
    inputs: str  # "text", "seq2seq", "image", "image16", "clip", "audio", "speech"
    variant: str = ""  # what sets a second case of one model type apart
    head: str = ""  # "": the base model; "mlm": its masked-LM head (ForMaskedLM)

    @property
    def id(self) -> str:
        return self.model_type + (f"-{self.variant}" if self.variant else "")


ARCHS = (
    Arch("BERT", "bert", _TEXT, "text"),
    Arch("BERT", "roberta", _TEXT, "text"),
    Arch("BERT", "roberta-prelayernorm", _TEXT, "text"),
    Arch("BERT", "xlm-roberta", _TEXT, "text"),
    Arch("BERT", "electra", dict(_TEXT, embedding_size=8), "text"),
    # masked-LM heads: a loose `bias` added after the product with the tied
    # embedding (transformers' `FlaxBertLMPredictionHead`, PyTorch's tied
    # `decoder.bias`)
    Arch("BERT", "bert", _TEXT, "text", "mlm", "mlm"),
    Arch("BERT", "roberta", _TEXT, "text", "mlm", "mlm"),
    Arch("BERT", "electra", dict(_TEXT, embedding_size=8), "text", "mlm", "mlm"),
    Arch("BERT", "albert", dict(_TEXT, embedding_size=8), "text"),
    Arch(
        "BERT",
        "distilbert",
        dict(
            vocab_size=VOCAB,
            dim=16,
            n_layers=2,
            n_heads=2,
            hidden_dim=32,
            max_position_embeddings=32,
        ),
        "text",
    ),
    Arch("BERT", "roformer", _TEXT, "text"),
    Arch("BERT", "big_bird", dict(_TEXT, attention_type="original_full"), "text"),
    Arch(
        "GPT",
        "gpt2",
        dict(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32),
        "text",
    ),
    Arch(
        "GPT",
        "gpt_neo",
        dict(
            vocab_size=VOCAB,
            hidden_size=16,
            num_layers=2,
            num_heads=2,
            max_position_embeddings=32,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
        ),
        "text",
    ),
    # intermediate_size == hidden_size: square `c_fc`/`c_proj` nn.Linear layers,
    # named as GPT-2's Conv1D ones
    Arch(
        "GPT",
        "gpt_neo",
        dict(
            vocab_size=VOCAB,
            hidden_size=16,
            num_layers=2,
            num_heads=2,
            max_position_embeddings=32,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            intermediate_size=16,
        ),
        "text",
        "square",
    ),
    Arch(
        "GPT",
        "gptj",
        dict(
            vocab_size=VOCAB,
            n_embd=16,
            n_layer=2,
            n_head=2,
            rotary_dim=4,
            n_positions=32,
        ),
        "text",
    ),
    Arch(
        "GPT",
        "opt",
        dict(
            vocab_size=VOCAB,
            hidden_size=16,
            ffn_dim=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            word_embed_proj_dim=16,
            max_position_embeddings=32,
        ),
        "text",
    ),
    Arch(
        "GPT",
        "bloom",
        dict(vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=2),
        "text",
    ),
    Arch(
        "GPT",
        "xglm",
        dict(
            vocab_size=VOCAB,
            d_model=16,
            num_layers=2,
            attention_heads=2,
            ffn_dim=32,
            max_position_embeddings=32,
        ),
        "text",
    ),
    Arch("Llama", "llama", _DECODER, "text"),
    Arch("Llama", "mistral", _DECODER, "text"),
    Arch("Llama", "gemma", dict(_DECODER, head_dim=8), "text"),
    Arch("T5", "t5", T5, "seq2seq"),
    Arch("T5", "mt5", T5, "seq2seq"),
    Arch("T5", "longt5", dict(T5, local_radius=2, global_block_size=2), "seq2seq"),
    Arch("BART", "bart", _SEQ2SEQ, "seq2seq"),
    Arch("BART", "mbart", _SEQ2SEQ, "seq2seq"),
    Arch("BART", "blenderbot", _SEQ2SEQ, "seq2seq"),
    Arch("BART", "blenderbot-small", _SEQ2SEQ, "seq2seq"),
    Arch(
        "BART",
        "marian",
        dict(_SEQ2SEQ, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0),
        "seq2seq",
    ),
    Arch("BART", "pegasus", _SEQ2SEQ, "seq2seq"),
    Arch("Vision", "vit", _VISION, "image"),
    Arch("Vision", "beit", _VISION, "image"),
    Arch("Vision", "dinov2", dict(_VISION, mlp_ratio=2), "image"),
    Arch(
        "Vision",
        "resnet",
        dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"),
        "image16",
    ),
    Arch(
        "Vision",
        "regnet",
        dict(
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            groups_width=4,
            layer_type="y",
        ),
        "image16",
    ),
    Arch(
        "Vision",
        "clip",
        dict(
            text_config=dict(
                vocab_size=VOCAB,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=32,
            ),
            vision_config=dict(_VISION),
            projection_dim=8,
        ),
        "clip",
    ),
    Arch(
        "Audio",
        "whisper",
        WHISPER,
        "speech",
    ),
    Arch(
        "Audio",
        "wav2vec2",
        dict(
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            conv_dim=(8, 8),
            conv_kernel=(4, 3),
            conv_stride=(2, 2),
            num_conv_pos_embeddings=4,
            do_stable_layer_norm=True,
            feat_extract_norm="layer",
            num_conv_pos_embedding_groups=2,
        ),
        "audio",
    ),
)


def _inputs(kind: str, config: Any) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, (BATCH, SEQ)).astype(np.int32)
    mask = np.ones((BATCH, SEQ), np.int32)
    if kind == "text":
        return {"input_ids": ids, "attention_mask": mask}
    if kind == "seq2seq":
        dec = rng.integers(3, VOCAB, (BATCH, DEC_SEQ)).astype(np.int32)
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}
    if kind in ("image", "image16"):
        size = 8 if kind == "image" else 16
        return {
            "pixel_values": rng.normal(size=(BATCH, 3, size, size)).astype(np.float32)
        }
    if kind == "clip":
        return {
            "input_ids": ids,
            "pixel_values": rng.normal(size=(BATCH, 3, 8, 8)).astype(np.float32),
            "attention_mask": mask,
        }
    if kind == "speech":
        frames = 2 * config.max_source_positions
        dec = rng.integers(3, VOCAB, (BATCH, DEC_SEQ)).astype(np.int32)
        return {
            "input_features": rng.normal(size=(BATCH, 8, frames)).astype(np.float32),
            "decoder_input_ids": dec,
        }
    if kind == "audio":
        return {"input_values": rng.normal(size=(BATCH, 64)).astype(np.float32)}
    raise ValueError(kind)


def perturb_torch(model, seed: int):
    """`model` in eval mode, every trainable parameter and BatchNorm statistic
    perturbed (noise 0.1; variances upwards), in place. Parameters that do not
    require gradients are left as they are: the sinusoidal position tables Marian,
    Pegasus and RoFormer store (`embed_positions.weight`, `requires_grad=False`) are
    fixed tables in real checkpoints too, and a perturbed one is no longer the table
    the Flax twin computes (nor recognised as one: bridge tells them by value)."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.add_(0.1 * torch.randn_like(b))
            elif name.endswith("running_var"):
                b.add_(0.1 * torch.rand_like(b))
    return model.eval()


def perturbed(tree, seed: int):
    """`tree` (JAX arrays, any pytree) with noise 0.1 added to every floating-point
    leaf, drawn in float32; a BatchNorm variance (a path ending in `var`) only
    upwards. Integer leaves as they are."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = jax.random.split(jax.random.key(seed), max(len(paths), 1))
    leaves = []
    for (path, x), k in zip(paths, keys):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            leaves.append(x)
            continue
        noise = 0.1 * jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)
        if jax.tree_util.keystr(path).endswith("var']"):
            noise = jnp.abs(noise)
        leaves.append(x + noise)
    return jax.tree.unflatten(treedef, leaves)


# --- building -------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    arch: Arch
    config: Any
    torch_class: type
    flax_model: Any  # the transformers Flax wrapper (holds .module, .params)
    inputs: dict[str, np.ndarray]
    example: tuple  # leading positional arrays both calls take alike
    flax_kwargs: dict  # the rest of the Flax module's call
    torch_kwargs: dict  # the rest of the PyTorch model's call (tensors)

    @property
    def module(self):
        return self.flax_model.module

    def variables(self, params) -> dict:
        """The Linen variables of the wrapper's `params` (which hold `params` and
        `batch_stats` for a model with BatchNorm)."""
        return params if "batch_stats" in params else {"params": params}

    def params(self, variables) -> dict:
        """The wrapper's `params` of Linen variables."""
        return variables if "batch_stats" in variables else variables["params"]

    def torch_model(self, seed: int):
        return perturb_torch(self.torch_class(self.config), seed)

    def flax_params(self, seed: int):
        """The wrapper's params, each perturbed (BatchNorm variances upwards)."""
        return perturbed(self.flax_model.params, seed)

    def run_torch(self, model) -> dict[str, np.ndarray]:
        import torch

        with torch.no_grad():
            out = model(
                **{
                    k: torch.from_numpy(v).long()
                    if v.dtype == np.int32
                    else torch.from_numpy(v)
                    for k, v in self.inputs.items()
                }
            )
        return _arrays(out, lambda t: t.detach().numpy())

    def run_flax(self, params) -> dict[str, np.ndarray]:
        out = self.flax_model(**self.inputs, params=params)
        return _arrays(out, np.asarray)


def _arrays(out, to_numpy) -> dict[str, np.ndarray]:
    result = {}
    for key, value in out.items():
        if hasattr(value, "shape") and not isinstance(value, (tuple, list)):
            result[key] = np.asarray(to_numpy(value), np.float64)
    return result


def build(arch: Arch) -> Built:
    import transformers
    from transformers.models.auto import configuration_auto, modeling_flax_auto

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config_class = configuration_auto.CONFIG_MAPPING[arch.model_type]
        config = config_class(**arch.config)
        mapping = (
            modeling_flax_auto.FLAX_MODEL_FOR_MASKED_LM_MAPPING_NAMES
            if arch.head == "mlm"
            else modeling_flax_auto.FLAX_MODEL_MAPPING_NAMES
        )
        flax_name = mapping[arch.model_type]
        flax_class = getattr(transformers, flax_name)
        torch_class = getattr(transformers, flax_name[len("Flax") :])
        flax_model = flax_class(config, seed=0)
    inputs = _inputs(arch.inputs, config)
    args, kwargs = _recorded_apply(flax_model, inputs)
    example, flax_kwargs, torch_kwargs = _split(
        flax_model.module, torch_class, args, kwargs, inputs
    )
    return Built(
        arch,
        config,
        torch_class,
        flax_model,
        inputs,
        example,
        flax_kwargs,
        torch_kwargs,
    )


_APPLY = ("rngs", "mutable", "method", "capture_intermediates")


def _recorded_apply(flax_model, inputs) -> tuple[tuple, dict]:
    """The positional and keyword arguments transformers' wrapper passes to
    `module.apply` (after the variables; `apply`'s own, `rngs`, `mutable`, left
    out)."""
    calls = []
    cls = type(flax_model.module)
    original = cls.apply

    def recording(self, variables, *args, **kwargs):
        calls.append((args, {k: v for k, v in kwargs.items() if k not in _APPLY}))
        return original(self, variables, *args, **kwargs)

    cls.apply = recording
    try:
        flax_model(**inputs)
    finally:
        cls.apply = original
    return calls[-1]


def _split(module, torch_class, args, kwargs, inputs):
    """`(example, flax kwargs, torch kwargs)`: the leading positional arrays that
    the two calls take under the same name and with the same values, then the rest
    by name per side."""
    import torch

    names = [n for n in inspect.signature(type(module).__call__).parameters][1:]
    bound = dict(zip(names, args)) | kwargs
    torch_names = list(inspect.signature(torch_class.forward).parameters)[1:]
    example = []
    for i, name in enumerate(names):
        value = bound.get(name)
        if (
            i < len(torch_names)
            and torch_names[i] == name
            and name in inputs
            and value is not None
            and np.array_equal(np.asarray(value), inputs[name])
        ):
            example.append(jnp.asarray(value))
        else:
            break
    flax_kwargs = {
        k: v
        for k, v in bound.items()
        if k not in names[: len(example)] and v is not None
    }
    torch_kwargs = {
        k: torch.from_numpy(v).long() if v.dtype == np.int32 else torch.from_numpy(v)
        for k, v in inputs.items()
        if k not in names[: len(example)]
    }
    return tuple(example), flax_kwargs, torch_kwargs


# --- routes ---------------------------------------------------------------------


class NotYet(AssertionError):
    """A test's case refused (or crashed) where the computation decides: bridge
    should port it (the reason its `xfail` takes)."""


class SilentlyWrong(AssertionError):
    """A test's case ported with no error, and the outputs differ."""


@dataclasses.dataclass
class Outcome:
    outcome: str  # "exact", "refused", "wrong", "crash"
    detail: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)
    computed: list[str] = dataclasses.field(default_factory=list)
    """With `strict=False`: the layers the report lists as computed by the other
    side (stored sinusoidal tables), or the names a save wrote from `like`."""

    def __str__(self):
        return self.outcome + (f": {self.detail}" if self.detail else "")


def difference(got: dict, want: dict) -> float:
    common = sorted(set(got) & set(want))
    if not common:
        raise AssertionError(f"no common outputs: {sorted(got)} vs {sorted(want)}")
    worst = 0.0
    for key in common:
        a, b = got[key], want[key]
        if a.shape != b.shape:
            return float("inf")
        scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
        worst = max(worst, float(np.max(np.abs(a - b))) / scale if a.size else 0.0)
    return worst


def _computed(report) -> list[str]:
    """What a non-strict port's report lists as computed by the other side; raises
    `_Incomplete` when it left anything else out."""
    if not report.complete:
        raise _Incomplete(f"strict=False left more out: {report}")
    return [*report.computed_by_target, *report.computed_by_source]


def _torch_to_flax(built: Built, strict: bool = True):
    import bridge

    source = built.torch_model(1)
    want = built.run_torch(source)
    target = (built.module, built.variables(built.flax_model.params))
    (_, variables), report = bridge.port(
        source,
        target,
        example=built.example,
        example_kwargs=(built.torch_kwargs, built.flax_kwargs),
        strict=strict,
        report=True,
    )
    return built.run_flax(built.params(variables)), want, _computed(report)


def _folder_to_flax(built: Built, strict: bool = True):
    import bridge

    source = built.torch_model(2)
    want = built.run_torch(source)
    with tempfile.TemporaryDirectory() as folder:
        source.save_pretrained(folder)
        target = (built.module, built.variables(built.flax_model.params))
        (_, variables), report = bridge.load(
            folder,
            like=target,
            example=built.example,
            example_kwargs=built.flax_kwargs,
            strict=strict,
            report=True,
        )
    return built.run_flax(built.params(variables)), want, _computed(report)


def _flax_to_torch(built: Built, strict: bool = True):
    import bridge

    params = built.flax_params(3)
    want = built.run_flax(params)
    target = built.torch_model(4)
    state, report = bridge.port(
        (built.module, built.variables(params)),
        target,
        example=built.example,
        example_kwargs=(built.flax_kwargs, built.torch_kwargs),
        strict=strict,
        report=True,
    )
    target.load_state_dict(state, strict=True)
    return built.run_torch(target), want, _computed(report)


def _flax_to_folder(built: Built, strict: bool = True):
    import bridge

    params = built.flax_params(5)
    want = built.run_flax(params)
    like = built.torch_model(6)
    with tempfile.TemporaryDirectory() as folder, _logged() as records:
        bridge.save_pretrained(
            folder,
            (built.module, built.variables(params)),
            config=built.config,
            like=like,
            strict=strict,
            example=built.example,
            example_kwargs=built.flax_kwargs,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded, info = built.torch_class.from_pretrained(
                folder, output_loading_info=True
            )
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        raise _Incomplete(f"from_pretrained: {info}")
    return built.run_torch(loaded.eval()), want, _written_from_like(records)


def _written_from_like(records) -> list[str]:
    """The names a non-strict `bridge.save` wrote from `like` (its log line, INFO),
    from the records `_logged` kept."""
    return [
        name
        for r in records
        if r.getMessage().startswith("Written from the reference")
        for name in r.args[0]  # pyright: ignore[reportOptionalSubscript]
    ]


@contextlib.contextmanager
def _logged():
    """The records logger `"bridge"` emits inside the block, INFO and above."""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger, handler = logging.getLogger("bridge"), Keep(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _Incomplete(Exception):
    """`from_pretrained` filled some weights from its own initialisation, or a
    non-strict port left more out than the tables the other side computes."""


RUNNERS: dict[str, Callable[..., tuple[dict, dict, list[str]]]] = {
    "torch->flax": _torch_to_flax,
    "folder->flax": _folder_to_flax,
    "flax->torch": _flax_to_torch,
    "flax->folder": _flax_to_folder,
}


def first_line(error: BaseException) -> str:
    """The error's first line, and its first problem when it lists them."""
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0] if text else ''}"
    if len(text) > 1 and text[1].lstrip().startswith("- "):
        line += " " + text[1].strip()
    return line[:400]


def problems(error: BaseException) -> list[str]:
    """Every problem an error lists (`PortError.problems`, or its `  - ` lines)."""
    if hasattr(error, "problems"):
        return list(error.problems)
    return [
        line.strip()[2:]
        for line in str(error).splitlines()
        if line.lstrip().startswith("- ")
    ]


def _refusal(error: BaseException) -> bool:
    """A clear refusal: bridge's `PortError`/`CheckpointError`, or a `ValueError`
    bridge raised saying nothing was written."""
    import bridge

    if isinstance(error, (bridge.PortError, bridge.CheckpointError)):
        return True
    return isinstance(error, ValueError) and "nothing was written" in str(error)


def run_route(built: Built, route: str, strict: bool = True) -> Outcome:
    """One route's outcome; with `strict=False`, the port, load or save leaves out
    (or keeps) the stored tables one side computes (`Outcome.computed`)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, want, computed = RUNNERS[route](built, strict)
    except Exception as error:  # noqa: BLE001 - a crash is an outcome here
        if _refusal(error):
            return Outcome("refused", first_line(error), problems(error))
        detail = first_line(error)
        tb = traceback.extract_tb(error.__traceback__)
        if tb:
            detail += f" [{tb[-1].filename.split('/')[-1]}:{tb[-1].lineno}]"
        return Outcome("crash", detail)
    worst = difference(got, want)
    if worst <= TOLERANCE:
        return Outcome("exact", f"{worst:.1e}", computed=computed)
    return Outcome("wrong", f"max difference {worst:.3g}", computed=computed)


def reference(built: Built) -> Outcome:
    """transformers' own converter (`convert_pytorch_state_dict_to_flax`) on the
    same pair: the yardstick (and a check of the harness's inputs)."""
    from transformers.modeling_flax_pytorch_utils import (
        convert_pytorch_state_dict_to_flax,
    )

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            source = built.torch_model(7)
            want = built.run_torch(source)
            state = {k: v for k, v in source.state_dict().items()}
            params = convert_pytorch_state_dict_to_flax(state, built.flax_model)
            if "batch_stats" in built.flax_model.params:
                params = {
                    "params": params["params"],
                    "batch_stats": params["batch_stats"],
                }
            got = built.run_flax(params)
    except Exception as error:  # noqa: BLE001
        return Outcome("crash", first_line(error))
    worst = difference(got, want)
    return Outcome("exact" if worst <= TOLERANCE else "wrong", f"{worst:.1e}")


@contextlib.contextmanager
def _quiet():
    """No warnings, implicit rank promotion (transformers' Flax code relies on it;
    the test suite raises on it), and `jnp.clip(a_min=, a_max=)` as transformers
    4.57's T5 family calls it (jax 0.10 takes only `min=`, `max=`): the one change
    to its code."""
    clip = jnp.clip

    def old_clip(x, min=None, max=None, *, a_min=None, a_max=None, **kwargs):
        return clip(
            x,
            min if a_min is None else a_min,
            max if a_max is None else a_max,
            **kwargs,
        )

    jnp.clip = old_clip
    try:
        with warnings.catch_warnings(), jax.numpy_rank_promotion("allow"):
            warnings.simplefilter("ignore")
            yield
    finally:
        jnp.clip = clip


def main(names: list[str] | None = None) -> dict:
    import time

    results = {}
    for arch in ARCHS:
        if names and arch.id not in names:
            continue
        start = time.perf_counter()
        try:
            with _quiet():
                built = build(arch)
        except Exception as error:  # noqa: BLE001
            results[arch.id] = {
                r: Outcome("crash", "build: " + first_line(error))
                for r in ("hf",) + ROUTES
            }
            print(arch.id, results[arch.id], flush=True)
            continue
        with _quiet():
            row = {"hf": reference(built)}
            for route in ROUTES:
                row[route] = run_route(built, route)
                if any("computed by" in p for p in row[route].problems):
                    row[f"{route} strict=False"] = run_route(built, route, False)
        results[arch.id] = row
        print(f"{arch.id} ({time.perf_counter() - start:.1f}s)", flush=True)
        for route, outcome in row.items():
            told = f" (computed: {outcome.computed})" if outcome.computed else ""
            print(f"    {route:13s} {outcome}{told}", flush=True)
    return results


def command_line(main: Callable[[list[str] | None], dict]) -> None:
    """A harness's command line, `python -m tests.public.<harness> [--json=PATH]
    [names]`: `main(names)` prints its table, and with `--json=` its outcomes
    are written to PATH."""
    import json
    import sys

    args = sys.argv[1:]
    out = None
    if args and args[0].startswith("--json="):
        out, args = args[0][len("--json=") :], args[1:]
    found = main(args or None)
    if out:
        with open(out, "w") as f:
            json.dump(
                {
                    a: {r: dataclasses.asdict(o) for r, o in row.items()}
                    for a, row in found.items()
                },
                f,
                indent=1,
            )


def judge(outcome: Outcome, label: str, refusal: str | None = None) -> str:
    """A test's verdict on one route, its outcome (`"exact"`, `"refused"`): with
    `refusal` (a fragment of the problem the two models cannot settle) it must be
    refused naming it; otherwise exact, a `SilentlyWrong` when the outputs differ
    with no error, a `NotYet` when it was refused or crashed (what an `xfail` of
    the case expects)."""
    if refusal is not None:
        assert outcome.outcome == "refused", outcome
        assert any(refusal in p for p in outcome.problems), outcome.problems
        return outcome.outcome
    if outcome.outcome == "wrong":
        raise SilentlyWrong(f"{label}: {outcome}")
    if outcome.outcome != "exact":
        raise NotYet(f"{label}: {outcome}")
    return outcome.outcome


if __name__ == "__main__":
    command_line(main)
