"""The layer codec protocol and its registry.

A codec says how one layer kind (`"Dense"`, `"Conv"`, `"BatchNorm"`, ...) looks in one
framework, as a few pure functions, like optax's `GradientTransformation(init,
update)`. The canonical layout of every kind is Flax's (Linen and NNX agree on names
and shapes), so the Flax codecs are the identity and the Equinox codecs say how
Equinox differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, overload

import jax.numpy as jnp

from .._adapters._registry import adapter_of_class, names
from .._arguments import check_str, type_error


Leaves = dict[str, Any]
"""A layer's arrays by relative path, `"/"`-joined: `"kernel"`, `"query/kernel"`,
`"batch_state_index/0"`."""


class Codec(NamedTuple):
    """How one layer kind is stored in one framework.

    **Fields:**

    - `kind`: the layer family, shared by the codecs of every framework (`"Dense"`).
      Layers pair only with layers of the same kind.
    - `framework`: the name of a registered framework: `"linen"`, `"nnx"` or
      `"equinox"`.
    - `recognise`: `recognise(cls, leaves) -> bool`. `cls` is the native class of the
      module (`None` for Linen submodules, whose classes are not recorded), `leaves`
      its arrays by relative path. NNX and Equinox codecs check the class; Linen
      codecs check the names and shapes of the arrays.
    - `decode`: `decode(leaves, hyper) -> canonical`: the arrays in Flax's names and
      layouts. `hyper` is what `hyperparameters` returned for this layer.
    - `encode`: `encode(canonical, like, hyper) -> leaves`: the inverse. `like` are the
      target layer's arrays (or `jax.ShapeDtypeStruct`s): the result must have exactly
      their paths, shapes and dtypes.
    - `hyperparameters`: `hyperparameters(module) -> dict` of the settings that change
      the layer's function (`"epsilon"`, `"momentum"`, `"use_bias"`, `"heads"`), read
      from the native module; compared between source and target where both have a
      value. Linen submodules are not available: Linen codecs receive `None`.
    - `layout`: a few words for the plan: how the native layout differs from the
      canonical one (`"transpose"`, `"OIHW, bias (O,1,1)"`); `""` for the canonical one.
    - `names`: Linen only: class names whose auto-names (`Dense_0`) identify the kind.
    - `defaults`: canonical entries that may be absent on one side, with the value that
      means "absent" (`{"bias": 0.0, "scale": 1.0}`): a missing entry is filled with it,
      a dropped entry must hold only it.
    - `build`: optional, `build(canonical, options) -> native layer`: a new layer of
      this kind whose arrays fit the canonical ones given (`jax.ShapeDtypeStruct`s by
      canonical name; settings the arrays do not show take Flax's defaults), or
      `(layer, state)` for a layer with an `eqx.nn.State`. It runs under
      `jax.eval_shape`, so it costs no memory. `bridge convert --to-layout` uses it
      to store a checkpoint in this framework's layout without the model; `options`
      holds the command's settings (`{"batch_norm_mode": "batch"}`).
    """

    kind: str
    framework: str
    recognise: Callable[[Any, Leaves], bool]
    decode: Callable[[Leaves, dict[str, Any]], Leaves]
    encode: Callable[[Leaves, Leaves, dict[str, Any]], Leaves]
    hyperparameters: Callable[[Any], dict[str, Any]] = lambda module: {}
    layout: str = ""
    names: tuple[str, ...] = ()
    defaults: Mapping[str, float] = {}
    build: Callable[[Leaves, Mapping[str, Any]], Any] | None = None

    @staticmethod
    def same_layout(kind: str, classes: Sequence[type]) -> tuple[Codec, ...]:
        """Codecs for a layer whose arrays keep their names and layout in every
        framework: one per class, for NNX and Equinox classes.

        The layer claims its own arrays (those not in a sublayer: its sublayers are
        recognised on their own), and pairs only with layers of the same `kind`.
        Linen variables record no classes: a Linen module's arrays no codec claims
        are ported as they are already (kind `"Array"`, paired by name).

        **Arguments:**

        - `kind`: the layer family, e.g. `"GemmaRMSNorm"`.
        - `classes`: the `nnx.Module` and `eqx.Module` classes of the layer.

        **Returns:**

        A tuple of `bridge.Codec`s, to give to `bridge.register_codec`.

        **Example:**

        ```python
        >>> import jax.numpy as jnp, equinox as eqx, bridge
        >>> from flax import nnx
        >>> class Norm(nnx.Module):  # x * (1 + scale): not Flax's RMSNorm
        ...     def __init__(self, n):
        ...         self.scale = nnx.Param(jnp.zeros(n))
        >>> class EqxNorm(eqx.Module):
        ...     scale: jnp.ndarray
        >>> codecs = bridge.Codec.same_layout("Norm", [Norm, EqxNorm])
        >>> _ = bridge.register_codec(*codecs)
        >>> bridge.port(Norm(3), EqxNorm(jnp.ones(3))).scale
        Array([0., 0., 0.], dtype=float32)
        >>> _ = bridge.unregister_codec("Norm")

        ```
        """
        out = []
        for cls in classes:
            fw = _framework_of(cls)
            out.append(Codec(kind, fw, _own_arrays_of(cls), same, same_as_like))
        return tuple(out)


_REGISTRY: dict[tuple[str, str], Codec] = {}


class Wrapping(NamedTuple):
    """The class `recognise` receives for a module that wraps one layer (a class of
    `WRAPPERS`: `nnx.WeightNorm`, `eqx.nn.WeightNorm`): what it computes depends on
    the layer it wraps (a `Linear`, a `Conv` or a `ConvTranspose`), which its
    arrays alone do not show.

    **Fields:**

    - `outer`: the wrapper's class.
    - `inner`: the wrapped layer's class (None where the Tree does not record it).
    """

    outer: type
    inner: Any


WRAPPERS: dict[type, str] = {}
"""`{wrapper class: the attribute holding the wrapped layer}` (filled by the codecs
that read such wrappers): a module of one of these classes is recognised as a
`Wrapping` of its class and its wrapped layer's."""


def outer_class(cls: Any) -> Any:
    """The class of a module as recognised (a `Wrapping`'s outer class)."""
    return cls.outer if isinstance(cls, Wrapping) else cls


WRITTEN = "weight (a module written by hand)"
"""The layout of a codec that reads only modules written by hand (the Flax codecs of
Gemma's norms): no Flax layer of its own, so its shapes judge no stack."""


@overload
def register_codec(codec: Codec, /) -> Codec: ...
@overload
def register_codec(*codecs: Codec) -> tuple[Codec, ...]: ...
def register_codec(*codecs: Codec) -> Codec | tuple[Codec, ...]:
    """Teach `bridge.port` a layer kind in one framework.

    Register one `bridge.Codec` per framework the kind exists in; layers pair with
    layers of the same `kind`. A codec registered again for the same `(kind,
    framework)` replaces the previous one; `bridge.unregister_codec` removes it.

    **Arguments:**

    - `*codecs`: one or more `bridge.Codec`s (e.g. `*bridge.Codec.same_layout(...)`).

    **Returns:**

    The codec (the codecs, for several), so registration can be an expression.

    **Example:**

    ```python
    >>> import jax.numpy as jnp, bridge
    >>> from flax import nnx
    >>> class Scale(nnx.Module):
    ...     def __init__(self, n):
    ...         self.gain = nnx.Param(jnp.ones(n))
    >>> codec = bridge.register_codec(bridge.Codec(
    ...     kind="Scale",
    ...     framework="nnx",
    ...     recognise=lambda cls, leaves: getattr(cls, "__name__", "") == "Scale",
    ...     decode=lambda leaves, hyper: {"scale": leaves["gain"]},
    ...     encode=lambda canonical, like, hyper: {"gain": canonical["scale"]},
    ... ))
    >>> ported = bridge.port(Scale(3), Scale(3))
    >>> ported.gain.shape
    (3,)

    ```
    """
    for codec in codecs:
        if not isinstance(codec, Codec):
            raise type_error("codecs", "bridge.Codec records", codec)
        if codec.framework not in names():
            raise ValueError(
                f"Codec {codec.kind!r}: framework must be one of {names()} (the "
                f"registered adapters), got {codec.framework!r}."
            )
        for field in ("recognise", "decode", "encode", "hyperparameters", "build"):
            value = getattr(codec, field)
            if not callable(value) and not (field == "build" and value is None):
                raise TypeError(
                    f"Codec {codec.kind!r} ({codec.framework}): `{field}` must be a "
                    f"function, got {type(value).__name__}."
                )
    for codec in codecs:
        _REGISTRY.pop((codec.kind, codec.framework), None)  # newest last
        _REGISTRY[(codec.kind, codec.framework)] = codec
    return codecs[0] if len(codecs) == 1 else codecs


def unregister_codec(kind: str, framework: str | None = None) -> tuple[Codec, ...]:
    """Remove the codecs of a layer kind (in one framework, or in all).

    **Arguments:**

    - `kind`: the kind the codecs were registered with (`"Dense"`, `"Scale"`).
    - `framework`: `"linen"`, `"nnx"` or `"equinox"`; all three when None.

    **Returns:**

    The removed codecs.

    **Raises:**

    `KeyError` when no codec of that kind (and framework) is registered.
    """
    check_str(kind, "kind")
    check_str(framework, "framework", optional=True)
    keys = [k for k in _REGISTRY if k[0] == kind and framework in (None, k[1])]
    if not keys:
        registered = sorted({k for k, _ in _REGISTRY})
        raise KeyError(
            f"No codec of kind {kind!r}"
            + (f" for {framework!r}" if framework else "")
            + f" is registered. Registered kinds: {registered}."
        )
    return tuple(_REGISTRY.pop(k) for k in keys)


def codecs(framework: str) -> list[Codec]:
    """The registered codecs of one framework, most recently registered first."""
    return [c for (_, fw), c in reversed(_REGISTRY.items()) if fw == framework]


def codec_of(kind: str, framework: str) -> Codec | None:
    return _REGISTRY.get((kind, framework))


# --- helpers for writing codecs ----------------------------------------------------


def of_class(*classes: type) -> Callable[[Any, Leaves], bool]:
    """`recognise` for NNX and Equinox codecs: the module is one of `classes`."""
    return lambda cls, leaves: isinstance(cls, type) and issubclass(cls, classes)


def same(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    """`decode` of a codec whose layout is the canonical one."""
    return dict(leaves)


def same_as_like(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    """`encode` of a codec whose layout is the canonical one."""
    return {name: canonical[name] for name in like}


def attributes(**names: str) -> Callable[[Any], dict[str, Any]]:
    """`hyperparameters` that read attributes: `attributes(epsilon="eps")` gives
    `{"epsilon": module.eps}`; attributes the module lacks are left out."""

    def read(module: Any) -> dict[str, Any]:
        out = {}
        for key, attr in names.items():
            if hasattr(module, attr):
                out[key] = getattr(module, attr)
        return out

    return read


def filled(
    canonical: Leaves, specs: Mapping[str, Any], defaults: Mapping[str, float]
) -> Leaves:
    """`canonical` with each entry of `defaults` that `specs` (shapes and dtypes by
    canonical name) has and `canonical` lacks, filled with its neutral value."""
    out = dict(canonical)
    for name, value in defaults.items():
        if name in specs and name not in out:
            out[name] = jnp.full(specs[name].shape, value, specs[name].dtype)
    return out


_NOT_A_LAYER_CLASS = (
    "Codec.same_layout: {cls!r} is not an nnx.Module or eqx.Module class. Linen "
    "variables record no classes: a Linen module's arrays that no codec claims are "
    "ported as they are already (kind 'Array', paired by name)."
)


def _framework_of(cls: Any) -> str:
    """The framework of a module class whose models record their classes."""
    adapter = adapter_of_class(cls) if isinstance(cls, type) else None
    if adapter is None or not adapter.records_classes:
        raise TypeError(_NOT_A_LAYER_CLASS.format(cls=cls))
    return adapter.name


def _own_arrays_of(cls: type) -> Callable[[Any, Leaves], bool]:
    """`recognise`: a module of class `cls`, claiming only its own arrays (asked
    with all the arrays under a module that has sublayers, it declines; asked with
    the module's own arrays next, it accepts)."""
    return lambda c, leaves: (
        isinstance(c, type) and issubclass(c, cls) and all("/" not in k for k in leaves)
    )


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)
