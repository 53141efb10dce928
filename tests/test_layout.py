"""The package's shape, checked in CI: no import cycles, layers one way, short modules."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tools.import_cycles import cycles, module_graph

SRC = Path(__file__).resolve().parents[1] / "src" / "chunklocal"
MAX_LINES = 500  # a module past this fails; past SOFT_LINES it is named in a warning
SOFT_LINES = 350  # (the code review of 2026-12: split by role, not by line count)

# Floors, top to bottom: a module may import its own floor or any floor below it.
FLOORS = [("chunklocal.cli", "chunklocal.server"), ("chunklocal.engine",), ("chunklocal.models",),
          ("chunklocal.backends",), ("chunklocal.bounds", "chunklocal.reference"),
          ("chunklocal.virtual_batches", "chunklocal.kv_spec", "chunklocal.kv_quant"),
          ("chunklocal._validate", "chunklocal._threads", "chunklocal._gc")]


def floor_of(module: str) -> int:
    for level, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} has no floor in FLOORS: add it")


def test_no_import_cycles():
    assert cycles(module_graph(SRC)) == []


def test_layers_run_one_way():
    upward = [f"{m} -> {t}" for m, targets in module_graph(SRC).items() if m != "chunklocal"
              for t in targets if floor_of(t) < floor_of(m)]
    assert upward == []


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """A cycle made only of a function-level and a TYPE_CHECKING import is still a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from .. import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert cycles(module_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_module_is_short(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(SRC.parent)}: {lines} lines > {MAX_LINES}"
    if lines > SOFT_LINES:
        warnings.warn(f"{path.relative_to(SRC.parent)}: {lines} lines (over {SOFT_LINES}: "
                      "does it hold more than one role?)", stacklevel=1)

