"""docs/architecture.md describes the code as it is: its module table names every module of every
folder and nothing else, and every repository path the document names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGES = ("ftis_fed", "strategies", "clients", "sims")


def _table() -> dict[str, set[str]]:
    """folder -> the modules its row of the module table names."""
    rows = {}
    for line in DOC.splitlines():
        m = re.match(r"^\| `([\w/]+/)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`(\w+\.py)`", m.group(2)))
    return rows


def _folders() -> dict[str, set[str]]:
    out = {}
    for pkg in PACKAGES:
        for init in (ROOT / pkg).rglob("__init__.py"):
            folder = init.parent
            out[folder.relative_to(ROOT).as_posix() + "/"] = {p.name for p in folder.glob("*.py")} - {"__init__.py"}
    return out


def test_the_module_table_names_every_module_and_nothing_else():
    table, folders = _table(), _folders()
    assert sorted(table) == sorted(folders), "folders missing from / extra in the module table"
    for folder, modules in folders.items():
        assert table[folder] == modules, (folder, "missing:", modules - table[folder], "extra:", table[folder] - modules)


def test_every_path_the_document_names_exists():
    quoted = set(re.findall(r"`([\w.\-]+(?:/[\w.\-]*)+)`", DOC))          # `a/b.py`, `docs/x.md`, `ftis_fed/engine/`
    top = ("ftis_fed/", "strategies/", "clients/", "sims/", "tests/", "docs/")
    named = {p for p in quoted if p.startswith(top) or p.endswith((".py", ".md", ".toml"))}   # not metric names
    named |= set(re.findall(r"\b((?:ftis_fed|strategies|clients|sims|tests|docs)/[\w./\-]+\.(?:py|md|toml))", DOC))
    assert len(named) > 40
    missing = sorted(p for p in named if not (ROOT / p.rstrip(".")).exists())
    assert not missing, missing
