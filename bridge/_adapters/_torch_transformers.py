"""A transformers folder's model, for `_torch_folder.folder_module`: its
`config.json` names a `model_type` (and `architectures`); the class is one of
transformers' own model classes, built with `attn_implementation="eager"`,
`use_cache=False`, float32 parameters and no initialisation (`no_init_weights()`),
then `tie_weights()` (skipping the initialisation also skips the tying).

The same four functions as `_torch_diffusers` (one module per library):
`claims(raw)`, `prepare(transformers, raw, bounds)` -> the class and a function
building the model,
`context(transformers)` around the build, `renamed(module, transformers, names,
keys)`: the folder's keys as transformers renames them on load.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from .._shown import shown
from ._torch_bounds import Bounds


PACKAGE = "transformers"
_UNKNOWN_CLASS = (
    "transformers {version} has no model class for {what}: the PyTorch side "
    "cannot be built from config.json"
)


def claims(raw: Mapping) -> bool:
    """Every config no other library claims is transformers'."""
    return True


def prepare(
    transformers: Any, raw: Mapping, bounds: Bounds, narrow: bool = False
) -> tuple[str, Callable[[Any], Any]]:
    """The class name and `build(torch)` of the model `raw` names:
    `architectures[0]` if it is one of transformers' model classes, else the class
    `transformers.AutoModel` maps the config to (never an auto class, which may
    import code a config names), imported now; `narrow`: its twin of small widths
    (`narrowed`). Raises `ValueError` naming what has no class; the config's own
    errors (made within `bounds`)."""
    rest = {k: v for k, v in raw.items() if k != "model_type"}
    with bounds.stopping():
        config = transformers.AutoConfig.for_model(raw.get("model_type", ""), **rest)
    if narrow:
        config = narrowed(config)
    cls = _model_class(transformers, raw.get("architectures"))
    if cls is None:  # the base model of its model_type: transformers' own class
        cls = _base_class(transformers, config)
    if cls is None:
        names = raw.get("architectures") or []
        what = (
            shown(names[0])
            if isinstance(names, list) and names
            else f"model_type {shown(raw.get('model_type'))}"
        )
        version = transformers.__version__
        raise ValueError(_UNKNOWN_CLASS.format(version=version, what=what))
    config.use_cache = False

    def build(torch: Any) -> Any:
        module = _construct(cls, config, torch)
        module.tie_weights()
        return module

    return cls.__name__, build


WIDTH = 4
"""A twin's width per attention head (its `head_dim`)."""
_WIDTHS = (
    *("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"),
    *("d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner"),
)
"""Fields of a feed-forward width: set to twice the twin's hidden size."""


def narrowed(config: Any) -> Any:
    """A copy of `config` of small widths, for a twin of its model whose forward
    pass computes as the model's does (the same layers, names, heads, vocabulary
    and every other field): in it and each sub-config (`text_config`, ...) with
    `num_attention_heads`, `hidden_size` is `WIDTH` a head, `head_dim` (where it
    is set) `WIDTH`, and the feed-forward widths (`_WIDTHS`) twice the hidden size.
    A width under another name stays as it is (the twin is then larger: its size
    is checked by its builder)."""
    twin = copy.deepcopy(config)
    todo = [twin]
    while todo:
        c = todo.pop()
        heads = getattr(c, "num_attention_heads", None)
        if isinstance(heads, int) and heads > 0 and hasattr(c, "hidden_size"):
            c.hidden_size = heads * WIDTH
            if isinstance(getattr(c, "head_dim", None), int):
                c.head_dim = WIDTH
            for field in _WIDTHS:
                if isinstance(getattr(c, field, None), int):
                    setattr(c, field, 2 * c.hidden_size)
        for key in getattr(c, "sub_configs", {}) or {}:
            sub = getattr(c, key, None)
            if sub is not None and hasattr(sub, "to_dict"):
                todo.append(sub)
    return twin


def context(transformers: Any) -> Any:
    """transformers' context that skips weight initialisation (private: its module
    moved between 4.x and 5.x)."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        module = _import(where)
        found = getattr(module, "no_init_weights", None)
        if found is not None:
            return found()
    raise ImportError("transformers has no no_init_weights")


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _model_class(transformers: Any, architectures: Any) -> Any:
    """The model class `config["architectures"][0]` names, if it is one of
    transformers' own model classes (a `PreTrainedModel` subclass it exports; never
    an auto class, which may import code a config names); else None."""
    if not isinstance(architectures, list) or not architectures:
        return None
    name = architectures[0]
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("Auto"):
        return None
    try:
        cls = getattr(transformers, name, None)
    except Exception:  # transformers' lazy module failing to import one of its own
        return None
    base = transformers.PreTrainedModel
    return cls if isinstance(cls, type) and issubclass(cls, base) else None


def _base_class(transformers: Any, config: Any) -> Any:
    """The class `transformers.AutoModel` builds from `config`, imported now (never
    code a config names: only the classes transformers maps its configs to)."""
    mapping = getattr(transformers.AutoModel, "_model_mapping", {})
    try:
        return mapping[type(config)]
    except Exception:  # not mapped, or transformers failing to import its own
        return None


def _construct(cls: Any, config: Any, torch: Any) -> Any:
    """`cls` (one of transformers' model classes) built from `config`."""
    for dtype in ("dtype", "torch_dtype"):  # transformers 5.x, 4.x
        try:
            return cls._from_config(
                config, attn_implementation="eager", **{dtype: torch.float32}
            )
        except TypeError as e:
            if dtype not in str(e):
                raise
    return cls._from_config(config, attn_implementation="eager")


def renamed(
    module: Any, transformers: Any, names: list[str], keys: list[str]
) -> dict[str, str]:
    """`{file key: its name in module}`, as transformers renames keys on load: 5.x
    its conversion mapping, 4.x `_get_key_renaming_mapping` (legacy names such as
    `weight_g`, `gamma`, and the `base_model_prefix`)."""
    prefix = getattr(module, "base_model_prefix", "") or ""
    known = set(names)

    def with_prefix(key: str) -> str:
        if key in known or not prefix:
            return key
        if f"{prefix}.{key}" in known:
            return f"{prefix}.{key}"
        if key.startswith(prefix + ".") and key[len(prefix) + 1 :] in known:
            return key[len(prefix) + 1 :]
        return key

    loading = _import("transformers.core_model_loading")
    mapping = _import("transformers.conversion_mapping")
    if (
        loading is not None
        and mapping is not None
        and hasattr(loading, "rename_source_key")
    ):
        transforms = mapping.get_model_conversion_mapping(module)
        renamings = [t for t in transforms if isinstance(t, loading.WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, loading.WeightConverter)]
        return {
            k: with_prefix(loading.rename_source_key(k, renamings, converters)[0])
            for k in keys
        }
    rename = getattr(module, "_get_key_renaming_mapping", None)
    if rename is not None:  # transformers 4.x, as its from_pretrained calls it
        has_prefix = bool(prefix) and any(k.startswith(prefix + ".") for k in keys)
        expects = bool(prefix) and hasattr(module, prefix)
        try:
            got = rename(
                keys,
                getattr(module, "_checkpoint_conversion_mapping", None) or None,
                loading_base_model_from_task_state_dict=has_prefix and not expects,
                loading_task_model_from_base_state_dict=expects and not has_prefix,
            )
        except TypeError:  # another signature: names and prefix only
            got = {}
        return {k: with_prefix(got.get(k, k)) for k in keys}
    return {k: with_prefix(k) for k in keys}
