"""The docs cover the public API: every re-exported name has a docstring and an API
reference entry, every page is in the site's navigation, and the code of the README
and of the getting started page runs."""

import ast
import inspect
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import bridge

from .helpers import requires, run_markdown
from .processes import checkout_env


ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"


def public_names() -> list[str]:
    """The names `bridge/__init__.py` re-exports: the keys of its `_PUBLIC` table
    (imported on first use) and the `from ._x import name as name` lines that
    static tools read."""
    module = ast.parse((ROOT / "bridge" / "__init__.py").read_text())
    names = []
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names += [a.name for a in node.names if a.asname == a.name]
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_PUBLIC" for t in node.targets
        ):
            names += list(ast.literal_eval(node.value))
    return sorted(set(names))


def test_the_lazy_table_and_the_static_imports_agree():
    """`bridge._PUBLIC` (what `import bridge` gives on first use) names what the
    `if TYPE_CHECKING:` imports (what pyright and the API docs read) name."""
    module = ast.parse((ROOT / "bridge" / "__init__.py").read_text())
    static = {
        a.name: "." + node.module
        for node in ast.walk(module)
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        for a in node.names
        if a.asname == a.name
    }
    assert static == bridge._PUBLIC
    assert bridge.__all__ == sorted(static)
    # what `dir(bridge)` shows a user: the public names, not this file's imports
    shown = {n for n in dir(bridge) if not n.startswith("_")}
    assert shown == set(bridge.__all__) | {"VERSION"}


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


GUIDES = sorted(p.name for p in (DOCS / "guides").glob("*.md"))


def test_the_home_page_lists_every_guide():
    home = (DOCS / "index.md").read_text()
    missing = [g for g in GUIDES if f"(guides/{g})" not in home]
    assert not missing, f"docs/index.md does not list the guides {missing}"


_MARK = "\n--- bridge docs block ---\n"
_TMP = re.compile(r"/tmp/tmp\w+/")  # tempfile.mkdtemp()'s names differ per run
_FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks(path: Path) -> list[tuple[str, str | None]]:
    """`(code, printed)` for each ```python block of a page; `printed` is the ```text
    block that follows it (after at most one paragraph), else None."""
    return [(code, shown) for kind, code, shown in steps(path) if kind == "python"]


def steps(path: Path) -> list[tuple[str, str, str | None]]:
    """What a reader runs, in the page's order: `("python", code, printed)` for each
    ```python block (`printed`: the ```text block that follows it, after at most one
    paragraph, else None), and `("console", command, printed)` for each `$ command`
    line of a ```console block (`printed`: the lines under it)."""
    text = path.read_text()
    found = list(_FENCE.finditer(text))
    out: list[tuple[str, str, str | None]] = []
    for i, m in enumerate(found):
        if m[1] == "python":
            after = found[i + 1] if i + 1 < len(found) else None
            between = text[m.end() : after.start()] if after else ""
            printed = None
            shows = (
                after is not None and after[1] == "text" and "logged" not in after[2]
            )
            if after is not None and shows and between.count("\n\n") <= 2:
                printed = after[3]
            out.append(("python", m[3], printed))
        elif m[1] == "console":
            for command in re.split(r"^\$ ", m[3], flags=re.M)[1:]:
                line, _, printed = command.partition("\n")
                out.append(("console", line, printed))
    return out


def _console(command: str) -> str:
    """The code that runs a page's shell command as a reader's shell would, `bridge`
    being this checkout's (`python -m bridge`), and prints what it printed."""
    command = re.sub(r"^bridge ", f"{sys.executable} -m bridge ", command)
    return (
        "import subprocess as _s\n"
        f"_d = _s.run({command!r}, shell=True, capture_output=True, text=True)\n"
        "print(_d.stdout + _d.stderr, end='')\n"
    )


def logged(path: Path) -> dict[int, str]:
    """`{step index: text}` of the ```text title="logged" blocks of a page: what
    the ```python block before them logs (on stderr, as a reader's terminal or
    notebook shows it under the printed output)."""
    text = path.read_text()
    out, step = {}, -1
    for m in _FENCE.finditer(text):
        if m[1] == "python":
            step += 1
        elif m[1] == "console":
            step += len(re.split(r"^\$ ", m[3], flags=re.M)[1:])
        elif m[1] == "text" and "logged" in m[2] and step >= 0:
            out[step] = m[3]
    return out


def run_pasted(path: Path, cwd: Path, stderr: list[str] | None = None) -> list[str]:
    """Run a page as a reader does, top to bottom in one fresh Python process: its
    ```python blocks in order, and each `$ command` of its ```console blocks where
    it comes, in the same folder; what each printed (and, into `stderr`, what each
    wrote on stderr: its log lines)."""
    order = steps(path)
    script = "".join(
        (
            f"exec(compile({c!r}, {f'{path.name} block {i + 1}'!r}, 'exec'))\n"
            if kind == "python"
            else _console(c)
        )
        + f"print({_MARK!r}, end='')\n"
        + f"import sys as _sys; print({_MARK!r}, end='', file=_sys.stderr)\n"
        for i, (kind, c, _) in enumerate(order)
    )
    env = checkout_env(COLUMNS="100")
    env.pop("XLA_FLAGS", None)  # as a reader's shell: the page sets what it needs
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=1800,
    )
    assert done.returncode == 0, f"{path.name}: {done.stderr[-3000:]}"
    if stderr is not None:
        stderr.extend(done.stderr.split(_MARK)[: len(order)])
    return done.stdout.split(_MARK)[: len(order)]


PAGES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.md")),
]
# what a shown output may differ in: times and the figures of the machine
_VARIES = re.compile(r"\d+(\.\d+)? ?(s|ms)\b|\d+:\d\d:\d\d")


def _lines(text: str) -> list[str]:
    """A page's output as compared: temporary folders and times left out."""
    text = _TMP.sub("/tmp/.../", text)
    return [_VARIES.sub("T", line.rstrip()) for line in text.strip().splitlines()]


def _same(out: str, shown: str) -> bool:
    return _lines(out) == _lines(shown)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_runs_as_pasted_and_prints_what_it_shows(page, tmp_path):
    """Each page in a fresh process, top to bottom, no setup but an empty folder."""
    path = ROOT / page
    written: list[str] = []
    printed = run_pasted(path, tmp_path, written)
    for (kind, code, shown), out in zip(steps(path), printed):
        if shown is not None and shown.strip():
            assert _same(out, shown), (
                f"{page}: {code[:200]!r} printed\n{out}\nshown\n{shown}"
            )
    for step, shown in logged(path).items():  # each line among what it logged
        lines = set(_lines(written[step]))
        missing = [line for line in _lines(shown) if line not in lines]
        assert missing == [], f"{page}: block {step + 1} logged\n{written[step]}"


def test_the_page_runner_reads_a_page_as_a_reader_does(tmp_path):
    """python and console blocks in the page's order, one process for the page,
    the shown outputs compared."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport os\nprint(os.getpid())\n"
        "open('x.txt', 'w').write('hi')\n```\n"
        "\n```console\n$ cat x.txt\nhi\n$ echo b\nb\n```\n"
        "```python\nprint(os.getpid())\n```\n"
        '```py title="Fragment: not run"\nundefined_name\n```\n'
    )
    assert [k for k, _, _ in steps(page)] == ["python", "console", "console", "python"]
    first, cat, echo, second = run_pasted(page, tmp_path)
    assert first == second  # one process: the second block sees the first's `os`
    assert (cat, echo) == ("hi", "b\n")
    assert steps(page)[1][2] == "hi\n"


def test_the_page_runner_compares_what_a_block_logs(tmp_path):
    """A ```text title="logged" block: each of its lines is among what the block
    before it wrote on stderr (a logger's lines, which a reader sees too)."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport logging\nlogging.getLogger('x').warning('told')\n"
        "print('printed')\n```\n\n```text\nprinted\n```\n\n"
        '```text title="logged"\ntold\n```\n'
    )
    assert logged(page) == {0: "told\n"}
    assert [shown for _, _, shown in steps(page)] == ["printed\n"]
    written: list[str] = []
    assert run_pasted(page, tmp_path, written) == ["printed\n"]
    assert "told" in written[0]


def test_shown_outputs_are_text_blocks():
    """What a ```python block prints is shown in a ```text block, the one the page
    runner compares: a bare ``` block after it is never checked (two went stale so)."""
    bare = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        found = list(_FENCE.finditer(text))
        for m, after in zip(found, found[1:]):
            between = text[m.end() : after.start()]
            if m[1] == "python" and after[1] == "" and between.count("\n\n") <= 2:
                bare.append(f"{page}:{text[: after.start()].count(chr(10)) + 1}")
    assert not bare, (
        f"outputs shown in bare ``` blocks, which the page runner never compares: "
        f"{bare}; write ```text"
    )


def test_bridge_commands_are_console_blocks():
    """A `bridge inspect` or `bridge convert` a page shows is in a ```console block,
    which the page runner runs where the page's code made its files: a ```sh block
    is never run (pytorch.md's converted a seq.safetensors nobody made)."""
    unrun = [
        f"{page}:{text[: m.start()].count(chr(10)) + 1}"
        for page in PAGES
        for text in [(ROOT / page).read_text()]
        for m in _FENCE.finditer(text)
        if m[1] != "console"
        and re.search(r"^(\$ )?bridge (inspect|convert)\b", m[3], re.M)
    ]
    assert not unrun, (
        f"bridge commands outside ```console blocks: {unrun}; show them as "
        "`$ bridge ...` lines of a ```console block, with what they print"
    )


def test_fragments_are_marked():
    """A code block the runner does not run (```py) says it is a fragment."""
    unmarked = [
        f"{page}:{text[: m.start()].count(chr(10)) + 1}"
        for page in PAGES
        for text in [(ROOT / page).read_text()]
        for m in _FENCE.finditer(text)
        if m[1] == "py" and 'title="Fragment' not in m[2]
    ]
    assert not unmarked, (
        f"```py blocks without a fragment title: {unmarked}; write ```py "
        'title="Fragment: ..." (what it needs), or make it a ```python block that runs'
    )


def _imported(code: str) -> set[str]:
    """The top-level modules `code` imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _canonical(name: str) -> str:
    """A distribution's name as the package index compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_with(dist: str, extra: str) -> set[str]:
    """The distributions `pip install dist[extra]` installs (whatever the markers),
    as far as they are installed here."""
    seen: set[str] = set()
    todo = [(dist, extra)]
    while todo:
        name, wanted = todo.pop()
        if _canonical(name) in seen:
            continue
        seen.add(_canonical(name))
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            marker = req.partition(";")[2]
            if "extra" in marker and f'"{wanted}"' not in marker:
                continue
            todo.append((re.split(r"[<>=!~\[ (;]", req.strip(), maxsplit=1)[0], ""))
    return seen


def test_the_pages_import_what_tests_slow_installs():
    # `tests_slow`, which CI does not run, runs every ```python block of these pages
    # with bridge[test] and the noxfile's GUIDE_PACKAGES: a page importing anything
    # else fails there only
    nox = ast.parse((ROOT / "noxfile.py").read_text())
    extras = next(
        ast.literal_eval(node.value)
        for node in nox.body
        if isinstance(node, ast.Assign)
        and [t.id for t in node.targets if isinstance(t, ast.Name)]
        == ["GUIDE_PACKAGES"]
    )
    try:
        metadata.requires("bridge")
    except metadata.PackageNotFoundError:
        pytest.skip("reads what bridge[test] installs: pip install -e '.[test]'")
    dists = _installed_with("bridge", "test") | {_canonical(e) for e in extras}
    provided = {
        module
        for module, names in metadata.packages_distributions().items()
        if any(_canonical(n) in dists for n in names)
    }
    # a distribution imported under another name, installed or not
    modules = {"dm-haiku": "haiku"}
    named = {modules.get(e, e) for e in extras}
    allowed = set(sys.stdlib_module_names) | provided | named | {"bridge"}
    pages = ["README.md", "docs/getting-started.md"]
    imported = {
        page: set().union(*(_imported(code) for code, _ in blocks(ROOT / page)))
        for page in [*pages, *[f"docs/guides/{g}" for g in GUIDES]]
    }
    assert {"optax", "flax", "gguf"} <= set().union(*imported.values())
    missing = {page: sorted(names - allowed) for page, names in imported.items()}
    missing = {page: names for page, names in missing.items() if names}
    assert not missing, (
        f"pages import what `nox -s tests_slow` does not install: {missing}; add "
        "them to GUIDE_PACKAGES in noxfile.py, or show that code in a ```py block"
    )


def test_install_lines_name_extras_pyproject_defines():
    """Each `pip install` of the README and the docs that names extras of this
    checkout (`./bridge[torch]`, `-e ".[test]"`) names extras that pyproject.toml
    defines: pip only warns about an unknown extra, and installs without it."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    defined = set(pyproject["project"]["optional-dependencies"])
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))]
    named, unknown = 0, []
    for page in pages:
        for line in re.findall(r"pip install [^\n`]*", page.read_text()):
            for extras in re.findall(r"(?:\./bridge|\.)\[([\w,-]+)\]", line):
                named += 1
                unknown += [
                    f"{page.relative_to(ROOT)}: {line.strip()} ({extra})"
                    for extra in extras.split(",")
                    if extra not in defined
                ]
    assert named >= 4  # the README's, getting started's, the torch guide's
    assert not unknown, f"install lines naming extras pyproject lacks: {unknown}"


def test_the_version_is_one_and_the_changelog_lists_it():
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["dynamic"] == ["version"]  # the wheel's: read from
    assert pyproject["tool"]["hatch"]["version"]["path"] == "bridge/_version.py"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## (\d+\.\d+\.\d+)", changelog, re.M)
    assert first is not None
    assert bridge.__version__ == first[1]
    done = subprocess.run(
        [sys.executable, "-m", "bridge", "--version"],
        capture_output=True,
        text=True,
        env=checkout_env(),
    )
    assert done.stdout == f"bridge {bridge.__version__}\n"


def _slug(heading: str) -> str:
    """The anchor mkdocs' `toc` extension gives a heading (its default `slugify`)."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_every_link_between_pages_arrives():
    """Each relative link of the README and the docs names a file that exists and,
    after `#`, a heading of that page (a split page moves sections: this is what
    tells)."""
    broken = []
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))]
    for page in pages:
        text = _FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md":
                headings = re.findall(
                    r"^#+ (.+)$", _FENCE.sub("", path.read_text()), re.M
                )
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(
                        f"{page.relative_to(ROOT)}: {target} (no such heading)"
                    )
    assert len(pages) > 10
    assert not broken, "links that arrive nowhere:\n" + "\n".join(broken)
