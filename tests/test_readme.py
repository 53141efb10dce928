"""The README's Python examples run as written (the serving example needs a checkpoint)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
RUNNABLE = [b for b in BLOCKS if "path/to" not in b and "FlashInferBackend(" not in b]


def test_readme_has_runnable_examples():
    assert len(RUNNABLE) >= 2


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
def test_readme_example_runs(block):
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)
    if "vb" in namespace:
        vb = namespace["vb"]
        assert vb.query_start_loc.tolist() == [0, 1, 5, 7]
        assert vb.seq_lens.tolist() == [4, 4, 2]
        assert vb.block_table.tolist() == [[7, 3], [9, 1], [4, 4]]
        assert namespace["out"].shape == (7, 4, 16)
