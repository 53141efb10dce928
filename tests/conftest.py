"""Shared pytest setup: puts tests/ (for ``from oracle import ...``, tests/gpu too) and the
repository root (for ``import benchmarks``) on sys.path, whatever directory pytest runs from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS = Path(__file__).resolve().parent
for _path in (str(_TESTS), str(_TESTS.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models (hidden size 64): one torch thread beats two (no fork/join per matmul).
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
