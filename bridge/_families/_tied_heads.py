"""A Hugging Face folder's tied LM head, told by its `config.json` and its files.

transformers ties a model's `lm_head.weight` to its input embedding when the config's
`tie_word_embeddings` is true, and `save_pretrained` then stores the tensor once,
under the embedding's name: the folder holds no `lm_head.weight`. Where the key is
absent the value is `PretrainedConfig`'s default, `True` (transformers 4.x, whose
`config.json` lists only the values that differ from it; 5.x writes each config
class's own value, so the key is there).

The embedding is the one 2-D tensor of the folder whose first axis is the config's
`vocab_size` (its text config's, for a model of several): where none or several
are, nothing is decided here (with `example=`, the model built from the config
shows the tie). Where the config says the head is not tied and the files hold none,
the folder has no head to give (a model's body, or a checkpoint missing a tensor).
"""

from __future__ import annotations

from collections.abc import Mapping


HEAD = "lm_head.weight"
"""The name transformers' causal and sequence-to-sequence LMs give their head."""

DEFAULT = True
"""`PretrainedConfig(tie_word_embeddings=True)`: transformers 4.x's default."""


def folder_head(
    config: Mapping[str, object], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[str, str, str] | None:
    """`(HEAD, the embedding's name, why)` where the folder's `config` ties its
    head and its files (`shapes`, `{name: shape}`) hold no `HEAD` and one table of
    the vocabulary's rows; `(HEAD, "", why)` where the head is absent and cannot be
    the embedding (the config says untied, or no single table fits); None where
    the files hold the head, or hold `lm_head` as a module of its own (RoBERTa's
    `lm_head.dense`, `lm_head.bias`: its decoder is another name).

    **Example:**

    ```python
    >>> folder_head({"vocab_size": 32}, {"model.embed_tokens.weight": (32, 16)})[:2]
    ('lm_head.weight', 'model.embed_tokens.weight')
    >>> folder_head({"vocab_size": 32, "tie_word_embeddings": False}, {})[1]
    ''
    >>> folder_head({"vocab_size": 32}, {"lm_head.bias": (32,)}) is None
    True
    >>> folder_head({"vocab_size": 32, "architectures": ["BertModel"]}, {}) is None
    True

    ```
    """
    module = HEAD.removesuffix("weight")
    if HEAD in shapes or any(name.startswith(module) for name in shapes):
        return None  # the head is there, or `lm_head` is a module (RoBERTa's)
    if not _with_head(config.get("architectures")):
        return None  # a model's body (`BertModel`): no head to tie
    said = config.get("tie_word_embeddings")
    tied = DEFAULT if said is None else said
    setting = (
        "tie_word_embeddings not set (transformers' default: true)"
        if said is None
        else f"tie_word_embeddings {str(said).lower()}"
    )
    if tied is not True:
        return HEAD, "", f"config.json: {setting}, and no {HEAD} in the files"
    vocab = _vocabulary(config)
    tables = sorted(
        name
        for name, shape in shapes.items()
        if len(shape) == 2 and vocab is not None and shape[0] == vocab
    )
    if len(tables) != 1:
        return (
            HEAD,
            "",
            f"config.json: {setting}, but the files hold {len(tables)} tables of "
            f"vocab_size={vocab} rows ({', '.join(tables[:4]) or 'none'}): which "
            "one is the input embedding is not told (example= builds the model "
            "from config.json, which shows it)",
        )
    return HEAD, tables[0], f"config.json: {setting}, and no {HEAD} in the files"


def _vocabulary(config: Mapping[str, object]) -> int | None:
    for where in (config, config.get("text_config")):
        if isinstance(where, Mapping):
            vocab = where.get("vocab_size")
            if isinstance(vocab, int) and not isinstance(vocab, bool):
                return vocab
    return None


def _with_head(architectures: object) -> bool:
    """Whether the classes a config names (`architectures`) have an LM head
    (`...ForCausalLM`, `...LMHeadModel`, `...ForConditionalGeneration`); True where
    it names none (a config without them says nothing)."""
    if not isinstance(architectures, list) or not architectures:
        return True
    return any(
        isinstance(name, str) and ("LM" in name or "ConditionalGeneration" in name)
        for name in architectures
    )
