"""Where the forward pass first uses each parameter: an order no sorting destroys.

Given example inputs, a model's forward pass is traced abstractly (`jax.make_jaxpr`
of its adapter's `infer` on `jax.ShapeDtypeStruct`s: no FLOPs, no weights
materialised). Every array of the Tree gets the position of the first operation
that reads it, as a tuple of equation indices through nested computations (`pjit`,
`scan`, `cond`, `custom_jvp`, ...). Operations that only relayout an array
(`transpose`, `reshape`, `convert_element_type`, ...) or compute with it alone
(`1 + w`, `sigmoid(gate)`) are seen through: the position is that of the operation
that computes with it and an activation, as for a PyTorch module. An array that enters a
`scan` as a scanned-over input (a stack of layers) gets `ITER` where the iteration
is, which a stack's layer `i` replaces by `i`: layer `i`'s query comes after layer
`i - 1`'s output projection, as in a model of separate layers.

Pairing (`_pairing.Order`) uses these positions where names do not decide: optax,
`nnx.jit`, `eval_shape`, `nnx.clone` and files all change orders of keys, none
changes the computation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast
from warnings import warn

import jax

from .._adapters._registry import registered
from .._paths import Path
from .._tree import Tree, framework
from .._uses import (
    Contraction as Contraction,  # defined once, shared with torch
    Untraced,
    Uses,
)
from . import _errors
from ._jaxpr import ITER, NoModel, Position, Program, first_uses


ATTEND = "attend"
"""The last name of the layer that reads a looked-up table as a head's kernel
(`Trace.heads`): `.wte.attend` for `.wte.embedding`, as `nn.Embed.attend` does."""


class Example:
    """Example inputs of a port, per side: `(inputs, source's kwargs, target's kwargs)`
    with the batched inputs `compare` takes."""

    def __init__(
        self,
        inputs: Any,
        kwargs: Mapping[str, Any] | tuple[Mapping[str, Any], Mapping[str, Any]] | None,
    ):
        self.inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        self.paired = isinstance(kwargs, tuple)
        """Whether each side was given its own keyword arguments."""
        if isinstance(kwargs, tuple):
            self.kwargs = (dict(kwargs[0]), dict(kwargs[1]))
        else:
            self.kwargs = (dict(kwargs or {}), dict(kwargs or {}))


def layer_position(
    uses: Mapping[Path, Position], leaf_paths: list[Path], index: int | None
) -> Position | None:
    """A layer's position: its first-used array's, with a stack's iteration replaced
    by the layer's `index` (appended where its arrays are not scanned over); None
    when the forward pass uses none of its arrays."""
    positions = [uses[p] for p in leaf_paths if p in uses]
    if not positions:
        return None
    first = min(positions)
    if index is None:
        return first
    if ITER in first:
        return tuple(index if x == ITER else x for x in first)
    return first + (index,)


class Trace:
    """One side's forward pass on the example inputs, traced when pairing first
    needs it (`first_uses`); a pass that fails is a problem. Called, it gives the
    first use of each of the Tree's arrays (None: no trace); its methods give the
    other facts the same trace records."""

    def __init__(
        self,
        tree: Tree,
        example: Example,
        side: int,
        problems: list[str],
        recorded: Mapping[Path, Position] | None = None,
        adapter: Any = None,
    ):
        self.tree, self.example, self.side, self.problems = (
            tree,
            example,
            side,
            problems,
        )
        self.adapter = registered(framework(tree)) if adapter is None else adapter
        """The adapter that runs the model; None for a part of a model, which has
        no forward pass of its own."""
        self.recorded = recorded
        """The order of use a file records (`bridge.save(..., example=...)`): its
        model's forward pass, which the file cannot run."""
        self.done: list[Mapping[Path, Position] | None] = []
        self.contracted: dict[Path, Contraction] = {}
        self.scanned: dict[Path, int] = {}
        self.needs: dict[Path, tuple[int, int]] = {}
        self.convolved: dict[Path, tuple[int, ...]] = {}
        self.turned: dict[Path, frozenset[int]] = {}
        self.called: dict[Path, Any] = {}
        """The module each path's call ran (`Adapter.called`: Linen's compact
        submodules)."""
        self.normalised: dict[Path, str] = {}
        self.epsilons: dict[Path, float] = {}
        self.added: set[Path] = set()
        self.alone: dict[Path, bool] = {}
        """PyTorch's `Uses.alone` (a JAX side has its program instead)."""
        self.merges: tuple = ()
        """PyTorch's `Uses.merges` (a JAX side has its program instead)."""
        self.placed: dict[Path, int] = {}
        self.tied: dict[Path, Path] = {}
        self.program: list[tuple[Program, list[Path]]] = []
        """The traced program (`_branches` reads it), where JAX traced it here."""
        self.read: list[Mapping[Path, frozenset]] = []
        """`_branches.reads`' answer, once made (PyTorch's `Uses.reads`)."""
        self.attended: dict[Path, Path] = {}
        self.gathered: set[Path] = set()
        self.why = ""
        """Why there is no trace, where the adapter says (`Untraced`)."""
        self.channel_first = False
        """Whether the pass ran on the example images moved to channels first
        (`_channels_first`: a PyTorch model's convolutions)."""

    def __call__(self) -> Mapping[Path, Position] | None:
        if not self.done:
            self.done.append(self._once())
        return self.done[0]

    def contractions(self) -> Mapping[Path, Contraction]:
        """`{leaf path: how the forward pass contracts it}` (see `first_uses`)."""
        self()
        return self.contracted

    def layer_axes(self) -> Mapping[Path, int]:
        """`{leaf path: the stored axis a scan iterates over}` (see `first_uses`)."""
        self()
        return self.scanned

    def upstream(self) -> Mapping[Path, tuple[int, int]]:
        """`{leaf path: (its bit, the bits of the leaves its first use is computed
        from)}` (see `first_uses`)."""
        self()
        return self.needs

    def kernels(self) -> Mapping[Path, tuple[int, ...]]:
        """`{leaf path: stored axes as (out, in, *spatial)}` of convolution kernels."""
        self()
        return self.convolved

    def transposed(self) -> Mapping[Path, frozenset[int]]:
        """`{leaf path: the stored axes reversed}` of the convolution kernels a JAX
        pass applies transposed (see `first_uses`)."""
        self()
        return self.turned

    def norms(self) -> Mapping[Path, str]:
        """`{leaf path: "mean", "rms" or "rms+1"}` of the arrays a normalisation
        scales, with `":bias"` for those it adds after (see `bridge._uses.Uses`;
        read from either side's trace: `_jaxpr_norms`, PyTorch's recorder)."""
        self()
        return self.normalised

    def lookups(self) -> frozenset[Path]:
        """The leaf paths first used as a table rows are looked up in (a JAX
        `gather`'s operand: an embedding, whatever module holds it)."""
        self()
        return frozenset(self.gathered)

    def norm_eps(self) -> Mapping[Path, float]:
        """`{leaf path: eps}` of the arrays a normalisation scales or shifts: the
        constant its variance is given before the inverse root, where the trace
        shows one."""
        self()
        return self.epsilons

    def biases(self) -> frozenset[Path]:
        """The leaf paths an operation adds to a product's result (a bias: see
        `first_uses`, `bridge._uses.Uses.added`), a tied name's as the path the
        Tree holds it at."""
        self()
        return frozenset(self.tied.get(p, p) for p in self.added)

    def scale_axes(self) -> Mapping[Path, int]:
        """`{leaf path: axis}` of 1-D arrays the pass multiplies, reshaped to one
        axis, with a weight (see `first_uses`)."""
        self()
        return self.placed

    def ties(self) -> Mapping[Path, Path]:
        """`{leaf path of a name the Tree holds once: the leaf path it holds it
        at}` that the traced model shows (a Hugging Face folder's tied embeddings,
        stored once: `bridge._uses.Uses.tied`)."""
        self()
        return self.tied

    def heads(self) -> Mapping[Path, Path]:
        """`{leaf path of a head: the leaf path of the table it reads}` for each
        array of a JAX model's Tree the pass looks up (a `gather`) and later
        contracts (a `dot_general`): one array in two roles, an embedding and the
        LM head tied to it (`nn.Embed.attend`, NNX's `embed.attend`, an Equinox
        head reading `self.embed.weight`). The head's path is the table's module
        and `ATTEND`; its position and `Contraction` are those of the product."""
        self()
        return self.attended

    def modules(self) -> Mapping[Path, Any]:
        """`{module path: module}` of the submodules the pass calls, where the Tree
        does not record them (Linen's compact submodules: their settings, which
        the variables do not hold)."""
        self()
        return self.called

    def _once(self) -> Mapping[Path, Position] | None:
        if self.recorded:
            return self.recorded
        adapter = self.adapter
        if adapter is None:  # a part of a model: nothing to run
            self.why = "a part of a model has no forward pass of its own"
            return None
        if adapter.trace is not None:  # a framework JAX does not trace (PyTorch)
            return self._by(adapter.trace)
        later: dict[Path, tuple[Position, Contraction]] = {}

        def run(kwargs: Mapping[str, Any]) -> dict[Path, Position]:
            return first_uses(
                self.tree,
                self.example.inputs,
                kwargs,
                self.contracted,
                self.scanned,
                self.needs,
                self.convolved,
                self.called,
                self.program,
                later,
                self.added,
                self.placed,
                self.turned,
                adapter,
                self.normalised,
                self.epsilons,
                self.gathered,
            )

        try:
            found = self._run(run)
        except NoModel:  # arrays without a model to run (Linen variables alone, a
            return None  # file read without its model's code): the order known
        if found is None:
            return None
        for table, (position, read) in later.items():
            head = table[:-1] + (ATTEND,)
            if (
                head in found
                or read.batch
                or read.inputs != (1,)
                or read.outputs != (0,)
            ):
                continue  # a name of the Tree's own, or no head's product (the
                # rows are the vocabulary: the features meet the input)
            self.attended[head] = table
            found[head] = position
            self.contracted[head] = read
        return found

    def _by(self, trace: Callable[..., Uses | None]) -> Mapping[Path, Position] | None:
        """The adapter's own trace (`Adapter.trace`), its records kept."""
        try:
            uses = self._channels_first(trace)
            if uses is None:
                uses = self._run(lambda kw: trace(self.tree, self.example.inputs, kw))
        except Untraced as why:  # nothing to run: no trace, and the reason
            self.why = str(why)
            return None
        if uses is None:
            return None
        # an adapter's trace is keyed by leaf path (`Adapter.trace`)
        self.contracted.update(cast(dict[Path, Contraction], uses.contracted))
        self.convolved.update(cast(dict[Path, tuple[int, ...]], uses.convolved))
        self.needs.update(cast(dict[Path, tuple[int, int]], uses.needs))
        self.normalised.update(cast(dict[Path, str], uses.norms))
        self.epsilons.update(cast(dict[Path, float], uses.eps))
        self.tied.update(cast(dict[Path, Path], uses.tied))
        self.added.update(cast(dict[Path, bool], uses.added))
        self.alone.update(cast(dict[Path, bool], uses.alone))
        self.merges = uses.merges
        if uses.reads:
            self.read.append(cast(dict[Path, frozenset], uses.reads))
        return cast(dict[Path, Position], uses.positions)

    def _channels_first(self, trace: Callable[..., Uses | None]) -> Uses | None:
        """The adapter's trace on the example images moved to channels first
        (`(N, H, W, C)` -> `(N, C, H, W)`, as PyTorch's convolutions take them),
        where the inputs as given (channels last, as Flax takes them) fail and those
        run: `channel_first` is then True. None where no input is an image, or the
        pass fails either way (the inputs as given are then tried again, and their
        error is the problem)."""
        inputs = self.example.inputs
        if not any(getattr(x, "ndim", 0) == 4 for x in inputs):
            return None
        kwargs = self.example.kwargs[self.side]
        try:
            return trace(self.tree, inputs, kwargs)
        except (Untraced, NoModel):
            raise
        except Exception:  # the model's own error: channels first, perhaps
            moved = tuple(
                jax.ShapeDtypeStruct((x.shape[0], x.shape[3], *x.shape[1:3]), x.dtype)
                if getattr(x, "ndim", 0) == 4
                else x
                for x in inputs
            )
            try:
                found = trace(self.tree, moved, kwargs)
            except Exception:  # not the channels: the inputs as given say why
                return None
            self.channel_first = True
            return found

    def _run(self, run: Callable[[Mapping[str, Any]], Any]) -> Any:
        """`run(this side's example_kwargs)`, or None with the model's error a
        problem. Where the kwargs were given for both sides alike (one dict) and
        the pass fails with them, it runs once more without them: they may be the
        other model's (an NNX model's `cache`, which transformers' models take as
        their own `cache`), and a PortWarning says so."""
        kwargs = self.example.kwargs[self.side]
        try:
            return run(kwargs)
        except (Untraced, NoModel):
            raise
        except Exception as error:  # the model's own error on these inputs
            if self.example.paired or not kwargs:
                self._failed(error)
                return None
            try:
                done = run({})
            except Exception:  # not the kwargs' fault: the first error says why
                self._failed(error)
                return None
            side = ("source", "target")[self.side]
            why = f"{type(error).__name__}: {error}"
            message = _errors.TRACE_WITHOUT.format(
                side=side, names=sorted(kwargs), error=why
            )
            warn(message, _errors.PortWarning, stacklevel=2)
            return done

    def _failed(self, error: Exception) -> None:
        side = ("source", "target")[self.side]
        names = sorted(self.example.kwargs[self.side])
        called = ""
        if names:
            called = _errors.TRACE_CALLED.format(side=side, names=names)
            called += "." if self.example.paired else _errors.TRACE_SHARED
        self.problems.append(
            _errors.TRACE.format(
                side=side, error=f"{type(error).__name__}: {error}", called=called
            )
        )
