"""The import layers of `bridge`, read from its source (no module is imported).

The package is layered; a module imports only modules of its own layer or below:

    8  bridge (the public API), _cli, _demo, __main__
    7  _quant     quantized weights: schemes, dequantized and kept reads, the GGUF
                  format; plug-ins of `_io` (it registers them, `_io` never imports it)
    6  _io        checkpoints: save/load, formats, training state, relayout;
       _lora      LoRA adapters: inject, merge, PEFT files
    5  _train     trainable specs, make_step, optimizer states
    4  _port      layers, pairing, plan, port, compare; codecs/
    3  _embed     one framework's model inside another's (as_nnx, as_linen, ...)
    2  _adapters  one adapter per framework, the registry, the build kit
    1  _tree      the neutral Tree
    0  _paths, _arguments, _lazy, _buffers, _placement, _kept (weights kept
       quantized: the QuantizedArray leaf, products with it as stored, their TPU
       kernels), _families (model families' names), _gc (the collector paused),
       _uses (what a traced forward pass tells about each parameter), _version,
       _clash (the name clash with flax.nnx.bridge), _sizes, _progress (the
       progress display of loads and saves), _shown (untrusted text in messages:
       escaped, bounded), _display (how a Tree, a plan, a report and a comparison
       look: text, HTML, treescope)

Checked here: no import cycle between modules, no import pointing up a layer, the
framework packages (flax, equinox, torch, transformers) imported only where a module
is of one framework (an adapter, a codec, a wrapper, a module named for its framework
such as `_lora/_nnx.py`, flax's msgpack format, the demo),
and the adapter modules imported from outside `_adapters/` only by the public API.
Imports under `if TYPE_CHECKING:` are not imports at run time: they are left out of
the cycles and of the frameworks' rule, but an import for typing that points up a
layer is refused as well (a lower layer whose signatures name a higher one's types
depends on it: the type belongs below).
What the code still does against these rules is listed in `DEBTS`, each with its
reason; an entry that no longer happens fails the test, so the list only shrinks.
"""

import ast
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent / "bridge"

LAYERS = {
    "bridge": 8,
    "bridge._cli": 8,
    "bridge._demo": 8,
    "bridge.__main__": 8,
    "bridge._quant": 7,
    "bridge._io": 6,
    "bridge._lora": 6,
    "bridge._train": 5,
    "bridge._port": 4,
    "bridge._embed": 3,
    "bridge._adapters": 2,
    "bridge._tree": 1,
    "bridge._paths": 0,
    "bridge._arguments": 0,
    "bridge._lazy": 0,
    "bridge._buffers": 0,
    "bridge._placement": 0,
    "bridge._families": 0,
    "bridge._gc": 0,
    "bridge._uses": 0,
    "bridge._version": 0,
    "bridge._kept": 0,
    "bridge._sizes": 0,
    "bridge._shown": 0,
    "bridge._clash": 0,
    "bridge._progress": 0,
    "bridge._display": 0,
}
FRAMEWORKS = {
    "flax",
    "equinox",
    "torch",
    "transformers",
    "peft",
    "haiku",
    "keras",
    "keras_hub",
}
ADAPTERS = {
    f"bridge._adapters._{n}"
    for n in (
        "linen",
        "linen_walk",
        "nnx",
        "nnx_walk",
        "equinox",
        "torch",
        "torch_trace",
        "haiku",
        "keras",
    )
}

# (importer, imported): what is still done against the rules, and why
DEBTS: dict[tuple[str, str], str] = {}  # none left


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str], typing: bool = False) -> set[str]:
    """The modules `name` imports (absolute names; `from . import _x` gives the
    submodule); those under `if TYPE_CHECKING:` too with `typing`."""
    tree = ast.parse(path.read_text())
    typing_only = (
        set()
        if typing
        else {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
    )
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            for a in node.names:
                sub = f"{full}.{a.name}"
                out.add(sub if sub in known else full)
    return out


def _graph(typing: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {n: _imports(n, p, set(modules), typing) for n, p in modules.items()}


def _layer(name: str) -> int | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def _top(name: str) -> str:
    return name.split(".")[0]


def _frameworks_allowed(name: str) -> bool:
    """A module of one framework: an adapter, a codec, a wrapper, flax's msgpack
    format, the demo."""
    return (
        (name.startswith("bridge._adapters._") and name not in _NEUTRAL_ADAPTERS)
        or name.startswith("bridge._port.codecs.")
        or name.startswith("bridge._embed._as_")
        or name.rpartition(".")[2] in ("_linen", "_nnx", "_equinox", "_torch")
        or name in ("bridge._io._msgpack", "bridge._demo")
    )


_NEUTRAL_ADAPTERS = {
    "bridge._adapters._registry",
    "bridge._adapters._build",
    "bridge._adapters._native",
}


def _violations() -> set[tuple[str, str]]:
    found = set()
    for name, imported in _graph(typing=True).items():
        for other in imported:
            here, there = _layer(name), _layer(other)
            if here is not None and there is not None and there > here:
                found.add((name, other))
    for name, imported in _graph().items():
        for other in imported:
            if other.startswith("bridge"):
                if other in ADAPTERS and not (
                    name.startswith("bridge._adapters") or name == "bridge"
                ):
                    found.add((name, other))
            elif _top(other) in FRAMEWORKS and not _frameworks_allowed(name):
                found.add((name, _top(other)))
    return found


def test_every_module_has_a_layer():
    assert [n for n in _modules() if _layer(n) is None] == []


def test_no_import_cycles():
    known = set(_modules())
    graph = {n: imported & known for n, imported in _graph().items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if m == n or _is_package_of(m, n):
                continue
            if state.get(m) == 1:
                cycles.append(path[path.index(m) :] + [m])
            elif m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert cycles == []


def _is_package_of(package: str, module: str) -> bool:
    """Importing a submodule runs its package's `__init__` first: not a cycle."""
    return module.startswith(package + ".")


def test_no_import_points_up_and_frameworks_stay_in_their_modules():
    new = _violations() - set(DEBTS)
    assert sorted(new) == [], "imports against the layers (see this file's docstring)"


@pytest.mark.parametrize("debt", sorted(DEBTS))
def test_each_listed_debt_still_happens(debt):
    assert debt in _violations(), f"{debt} no longer happens: remove it from DEBTS"


# the frameworks' names, as adapters register them: nothing above the adapters
# compares a framework with one (it asks the adapter: `layout_of`, `reads_classes`)
FRAMEWORK_NAMES = {"linen", "nnx", "equinox", "torch", "haiku", "keras"}


def _framework_tests(name: str, path: Path) -> list[str]:
    """The comparisons in a module of a framework (its `framework` attribute or
    the `framework(...)` of something) with a framework's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = set()
        for operand in operands:
            for n in ast.walk(operand):
                if isinstance(n, ast.Constant) and n.value in FRAMEWORK_NAMES:
                    names.add(n.value)
        framework = any(
            (isinstance(n, ast.Attribute) and n.attr == "framework")
            or (isinstance(n, ast.Name) and n.id == "framework")
            for operand in operands
            for n in ast.walk(operand)
        )
        if names and framework:
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_framework_name_test_above_the_adapters():
    """A layer above the adapters asks the adapter what it needs (a layout, whether
    classes are recorded), never which framework it holds (fails on `c.framework
    == "torch"`, as `_port/_computed.py` had)."""
    found = []
    for name, path in _modules().items():
        layer = _layer(name)
        if layer is not None and layer > LAYERS["bridge._adapters"]:
            if not _frameworks_allowed(name):
                found += _framework_tests(name, path)
    assert found == []
