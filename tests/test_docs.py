"""The docs cover the public API: every re-exported name has a docstring and an API
reference entry, every page is in the site's navigation, and the code of the README
and of the getting started page runs."""

import ast
import inspect
import re
from pathlib import Path

import pytest

import bridge

from .helpers import requires, run_markdown


ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"


def public_names() -> list[str]:
    """The names `bridge/__init__.py` re-exports (`from ._x import name as name`) and
    any listed in its `__all__`."""
    module = ast.parse((ROOT / "bridge" / "__init__.py").read_text())
    names = []
    for node in module.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names += [a.name for a in node.names if a.asname == a.name]
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            names += list(ast.literal_eval(node.value))
    return sorted(set(names))


def documented_names() -> dict[str, str]:
    """`name -> page` for every `::: bridge.name` line of `docs/api/*.md`."""
    out = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        for match in re.finditer(r"^::: bridge\.(\w+)\s*$", page.read_text(), re.M):
            out[match[1]] = page.name
    return out


def test_public_names_are_found():
    # the parser must see the foundation's names, or every other check is vacuous
    assert {"Tree", "from_nnx", "to_native", "roles"} <= set(public_names())


def test_every_public_name_is_in_the_api_reference():
    missing = sorted(set(public_names()) - set(documented_names()))
    assert not missing, (
        f"public names missing from the API reference: {missing}; add a "
        "`::: bridge.<name>` line to the page of their concept in docs/api/"
    )


def test_the_api_reference_names_only_public_names():
    stale = {n: p for n, p in documented_names().items() if n not in public_names()}
    assert not stale, f"docs/api/ documents names bridge does not export: {stale}"


@pytest.mark.parametrize("name", public_names())
def test_public_name_has_a_docstring(name):
    obj = getattr(bridge, name)
    doc = inspect.getdoc(obj)
    assert doc and doc.strip(), f"bridge.{name} has no docstring"
    if inspect.isfunction(obj) and inspect.signature(obj).parameters:
        assert "**Arguments:**" in doc, f"bridge.{name}: no `**Arguments:**` list"


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    missing = [p for p in sorted(pages) if not re.search(rf"\s{re.escape(p)}\s", nav)]
    assert not missing, f"pages missing from the nav of mkdocs.yml: {missing}"


@requires("NNX")
@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_page_code_runs(page, capsys):
    code = run_markdown(ROOT / page)
    assert "bridge.from_nnx" in code
    if page.endswith("getting-started.md"):
        assert "loss after 50 steps" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize(
    "guide",
    [
        "porting.md",
        "checkpoints.md",
        "pytorch.md",
        "large-models.md",
        "lora.md",
        "quantized.md",
    ],
)
def test_guide_code_runs(guide, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # guides may write checkpoint files
    assert "import bridge" in run_markdown(ROOT / "docs" / "guides" / guide)
