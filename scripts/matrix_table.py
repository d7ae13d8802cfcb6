"""The version tables of README.md and docs/versions.md, written from docs/matrix.json.

`nox -s tests_matrix` and `nox -s tests_floor` record each cell's result in
`docs/matrix.json` (the versions installed, the counts of passed, skipped and failed
tests, each skip's reason); this script writes the tables from that file, so they say
what the last run found and nothing else:

    python scripts/matrix_table.py          # rewrite README.md's, docs/versions.md's
    python scripts/matrix_table.py --check  # exit 1 if they differ from matrix.json

The tables sit between `<!-- matrix: begin -->` and `<!-- matrix: end -->` lines
(`<!-- floor: ... -->` for the floor's line); the text around them is written by hand.
Standard library only: the noxfile imports it from the host's Python.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "matrix.json"
PAGES = (ROOT / "README.md", ROOT / "docs" / "versions.md")
# The packages whose installed versions a cell records (and the tables show).
PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "equinox",
    "optax",
    "numpy",
    "orbax-checkpoint",
    "safetensors",
)
# `requires(...)` in tests/helpers.py skips with "needs <feature> (<package> >= <v>)".
FEATURE_SKIP = re.compile(r"^needs (?P<feature>.+) \((?P<needs>[^()]+)\)$")


# --- recording a cell (called by the noxfile) ----------------------------------------


def cell_key(python: str, flax: str, equinox: str, optax: str) -> str:
    return f"python {python}, flax {flax}, equinox {equinox}, optax {optax}"


def junit_counts(path: Path) -> dict:
    """Passed, failed (errors included) and skipped test counts of a pytest
    `--junitxml` report, with each skip reason's count and the failed tests' ids."""
    passed, skipped, failed = 0, Counter(), []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcomes = {child.tag: child for child in case}
        name = f"{case.get('classname')}::{case.get('name')}"
        if "failure" in outcomes or "error" in outcomes:
            failed.append(name)
        elif "skipped" in outcomes:
            skipped[outcomes["skipped"].get("message", "").strip()] += 1
        else:
            passed += 1
    return {
        "passed": passed,
        "skipped": dict(sorted(skipped.items())),
        "failed": len(failed),
        "failed_tests": sorted(failed),
    }


def record(key: str, result: dict, path: Path = RESULTS) -> None:
    """Store one cell's `result` under `key` in the results file (other cells kept)."""
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = result
    path.write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")


# --- the tables ----------------------------------------------------------------------


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.]", version))


# one feature of a reason that needs several: "NNX (flax >= 0.12.1) and ..."
FEATURE = re.compile(r"(?P<feature>.+?) \((?P<needs>[^()]+ >= [^()]+)\)(?: and |$)")


def _needs(reason: str) -> list[tuple[str, str]]:
    """The `(feature, "package >= version")` pairs of a `requires(...)` skip reason;
    [] for any other reason (torch not installed, a collection skipped)."""
    rest = reason.removeprefix("needs ")
    found = list(FEATURE.finditer(rest))
    if rest == reason or "".join(m[0] for m in found) != rest:
        return []
    return [(m["feature"], m["needs"]) for m in found]


def _skips(skipped: dict, *, short: bool) -> str:
    """The skips by feature (a test needing two features counts under both, joined by
    `+`), then the other skips with their reasons."""
    by_feature, other = [], []
    for reason, count in skipped.items():
        reason = reason.removeprefix("Skipped: ")
        needs = _needs(reason)
        if needs:
            label = " + ".join(
                f"`{feature}`" + ("" if short else f" ({version})")
                for feature, version in needs
            )
            by_feature.append(f"{count} {label}")
        else:
            other.append(f"{count} {reason}")
    parts = [("skipped by feature", by_feature), ("other skips", other)]
    return "; ".join(f"{name}: {', '.join(p)}" for name, p in parts if p)


def cell_text(cell: dict, *, short: bool) -> str:
    """One cell of a table: passes or fails, and the skips by feature."""
    if "declared_skip" in cell:
        return f"cannot run: {cell['declared_skip']}"
    if cell["failed"]:
        text = f"**fails**: {cell['failed']} failed, {cell['passed']} passed"
        if not short:
            shown = ", ".join(f"`{t}`" for t in cell["failed_tests"][:5])
            text += f" ({shown}{', ...' if cell['failed'] > 5 else ''})"
    else:
        text = f"**passes**: {cell['passed']} passed"
    if "note" in cell:
        text += f" ({cell['note']})"
    if cell["skipped"]:
        text += "; " + _skips(cell["skipped"], short=short)
    return text


def _cells(results: dict) -> list[dict]:
    return [cell for key, cell in results.items() if key != "floor"]


def _columns(cells: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """The newest optax, and the (equinox, optax) columns: the newest optax first,
    each optax's equinox releases oldest first."""
    newest_optax = max((c["optax"] for c in cells), key=_version_key)
    columns = sorted({(c["equinox"], c["optax"]) for c in cells}, key=_version_key_eo)
    columns.sort(key=lambda eo: eo[1] != newest_optax)
    return newest_optax, columns


def _rows(cells: list[dict]) -> list[tuple[str, str]]:
    """The (Python, flax) rows, oldest first."""
    return sorted({(c["python"], c["flax"]) for c in cells}, key=_version_key_eo)


def _row_jax(cells: list[dict], python: str, flax: str) -> str | None:
    """The jax most of the row's cells ran on (a cell on another jax names its own)."""
    ran = [
        c["versions"]["jax"]
        for c in cells
        if (c["python"], c["flax"]) == (python, flax) and "versions" in c
    ]
    return Counter(ran).most_common(1)[0][0] if ran else None


def matrix_table(results: dict, *, short: bool) -> str:
    """Markdown: a row per Python and flax release (with the jax it ran on), a column
    per equinox release (and optax, where it is not the newest one of the matrix).
    `short`: a mark per cell (✅, ✗) and one line of footnotes; else each cell's
    counts, skips by feature and failed tests."""
    cells = _cells(results)
    newest_optax, columns = _columns(cells)
    by_place = {(c["python"], c["flax"], c["equinox"], c["optax"]): c for c in cells}
    head = ["Python", "flax (jax)"] + [
        f"equinox {e}" if o == newest_optax else f"equinox {e}, optax {o}"
        for e, o in columns
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    notes: list[str] = []  # the reasons cells cannot run, numbered in order
    for python, flax in _rows(cells):
        jax = _row_jax(cells, python, flax)
        texts = []
        for e, o in columns:
            cell = by_place.get((python, flax, e, o))
            if cell is None:
                texts.append("" if short else "not in the matrix")
                continue
            text = _mark(cell, notes) if short else cell_text(cell, short=False)
            if "versions" in cell and cell["versions"]["jax"] != jax:
                text += f" (jax {cell['versions']['jax']})"
            texts.append(text)
        label = f"{flax} (jax {jax})" if jax else flax
        lines.append("| " + " | ".join([python, label, *texts]) + " |")
    if short:
        why = ", ".join(f"{_SUPERSCRIPTS[i]} {n}" for i, n in enumerate(notes))
        lines += [
            "",
            "✅ the fast suite passes (a test of a feature the release lacks is "
            "skipped); ✗ N: N tests fail; "
            + (f"✗ cannot run, or fails, because: {why}; " if notes else "")
            + f"optax {newest_optax} where no other is named; "
            "blank: not in the matrix.",
        ]
    else:
        caption = f"optax {newest_optax} in every column that names no other optax."
        lines += ["", caption]
    return "\n".join(lines)


_SUPERSCRIPTS = "¹²³⁴⁵⁶⁷⁸⁹"


def _mark(cell: dict, notes: list[str]) -> str:
    """✅, `✗ N` (N tests failed) or ✗ with the footnote of why the cell cannot run
    (appended to `notes` when new)."""
    if "declared_skip" not in cell and "short" not in cell:
        return f"**✗ {cell['failed']}**" if cell["failed"] else "✅"
    note = cell.get("short", cell.get("declared_skip"))
    if note not in notes:
        notes.append(note)
    mark = f"**✗ {cell['failed']}**" if cell.get("failed") else "✗"
    return mark + _SUPERSCRIPTS[notes.index(note)]


def _version_key_eo(eo: tuple[str, str]) -> tuple:
    return _version_key(eo[0]), _version_key(eo[1])


def _versions(cell: dict) -> str:
    return ", ".join(
        f"{p} {cell['versions'][p]}" for p in PACKAGES if p in cell["versions"]
    )


def floor_text(results: dict, *, short: bool) -> str:
    floor = results.get("floor")
    if floor is None:
        return "`tests_floor` has not been recorded yet."
    python = f"Python {floor['python']}, " if "python" in floor else ""
    head = f"`tests_floor` ({python}{_versions(floor)}): "
    if not short:
        return head + cell_text(floor, short=False) + "."
    skipped = sum(floor["skipped"].values())
    if floor["failed"]:
        return head + f"**✗ {floor['failed']}** tests fail."
    return head + f"✅ {floor['passed']} passed, {skipped} skipped."


def run_text(results: dict) -> str:
    """When, at which commit, how long: the line under the detailed table."""
    cells = _cells(results)
    commits = sorted({c["commit"] for c in cells if "commit" in c})
    dates = sorted({c["date"] for c in cells if "date" in c})
    minutes = sum(c.get("seconds", 0) for c in cells) / 60
    ran = sum("versions" in c for c in cells)
    return (
        f"Last run: {', '.join(dates)}, at commit {', '.join(commits)}: {ran} cells "
        f"ran, {len(cells) - ran} declared, in {minutes:.0f} min one after the other "
        "(installs included, on 2 shared CPU cores)."
    )


def details(results: dict) -> str:
    """Markdown: every cell's installed versions."""
    lines = ["| cell | installed |", "| --- | --- |"]
    for key, cell in results.items():
        if "versions" in cell:
            lines.append(f"| {key} | {_versions(cell)} |")
    return "\n".join(lines)


def blocks(page: Path, results: dict) -> dict[str, str]:
    """The generated blocks of `page`, by marker name."""
    detailed = page.name != "README.md"
    out = {"matrix": matrix_table(results, short=not detailed)}
    out["floor"] = floor_text(results, short=not detailed)
    if detailed:
        out["matrix"] += "\n\n" + run_text(results) + "\n\n" + details(results)
    return out


def rewrite(text: str, generated: dict[str, str]) -> str:
    """`text` with each `<!-- name: begin -->` ... `<!-- name: end -->` block's body
    replaced by `generated[name]`; an error if a marker is missing."""
    for name, body in generated.items():
        pattern = re.compile(
            rf"(<!-- {name}: begin -->\n).*?(<!-- {name}: end -->)", re.S
        )
        if not pattern.search(text):
            raise ValueError(
                f"no `<!-- {name}: begin -->` ... `<!-- {name}: end -->` block to "
                "write the table into: add the two lines where it belongs"
            )
        text = pattern.sub(lambda m: m[1] + body + "\n" + m[2], text)
    return text


def main(argv: list[str]) -> int:
    results = json.loads(RESULTS.read_text())
    stale = []
    for page in PAGES:
        old = page.read_text()
        new = rewrite(old, blocks(page, results))
        if new == old:
            continue
        if "--check" in argv:
            stale.append(str(page.relative_to(ROOT)))
        else:
            page.write_text(new)
    if stale:
        print(
            f"{', '.join(stale)}: the version tables differ from docs/matrix.json; "
            "run `python scripts/matrix_table.py`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
