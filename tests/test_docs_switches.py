"""docs/switches.md lists every CHUNKLOCAL_* variable the library reads, with the default
the code uses: a switch turned on (or renamed) without the table changing fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r'"(CHUNKLOCAL_[A-Z0-9_]+)"')
# a read with its default: os.environ.get("NAME", "D") or a helper's ("NAME", "D")
DEFAULT = re.compile(r'\(\s*"(CHUNKLOCAL_[A-Z0-9_]+)",\s*"([^"]*)"\s*\)')
ROW = re.compile(r"^\| `(CHUNKLOCAL_[A-Z0-9_]+)` \| (`[^`]*`|unset|empty) \|", re.M)


def code_switches() -> tuple[set[str], dict[str, str]]:
    names: set[str] = set()
    defaults: dict[str, str] = {}
    for path in (ROOT / "src" / "chunklocal").rglob("*.py"):
        text = path.read_text()
        names.update(NAME.findall(text))
        for name, default in DEFAULT.findall(text):
            assert defaults.setdefault(name, default) == default, (name, path)
    return names, defaults


def table() -> dict[str, str]:
    rows = ROW.findall((ROOT / "docs" / "switches.md").read_text())
    return {name: {"unset": "", "empty": ""}.get(cell, cell.strip("`")) for name, cell in rows}


def test_every_variable_the_code_reads_is_in_the_table_with_its_default():
    names, defaults = code_switches()
    rows = table()
    assert len(names) >= 30 and "CHUNKLOCAL_ROPE_VEC" in defaults  # the scan sees them
    assert sorted(names - rows.keys()) == [], "variables missing from docs/switches.md"
    assert sorted(rows.keys() - names) == [], "rows of docs/switches.md no code reads"
    wrong = {n: (rows[n], d) for n, d in defaults.items() if rows[n] != d}
    assert wrong == {}, "(table, code) defaults that differ"
