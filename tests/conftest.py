"""Shared pytest setup: puts tests/ (for ``from oracle import ...``, tests/gpu too) and the
repository root (for ``import benchmarks``) on sys.path, whatever directory pytest runs from."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _path in (str(_TESTS), str(_TESTS.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
