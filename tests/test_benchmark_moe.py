"""benchmarks/moe.py runs end to end at --smoke sizes on the CPU and writes its JSON.

The script itself checks every grouped variant against the all-experts bmm before
timing it; this test checks that those checks ran and what the floor counts."""

from __future__ import annotations

import json


def test_moe_benchmark_smoke_cpu(tmp_path):
    from benchmarks import moe

    assert moe.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "moe_smoke.json").read_text())
    assert data["errors"] == []
    rows = data["rows"]
    assert [(r["geometry"], r["tokens"]) for r in rows] == [
        (g, n) for g in ("scout", "maverick") for n in (1, 5, 40)]
    for row in rows:
        for name in ("grouped", "stacked", "fused"):
            assert row[f"{name}_rel_err"] < 1e-5
        # the Triton variants run on CUDA only
        assert all(row[f"{v}_ms"] > 0 for v in moe.VARIANTS if not v.startswith("triton"))
        assert "triton_ms" not in row
        hidden, inner, experts, top_k = moe.SMOKE_GEOMETRIES[row["geometry"]]
        assert 1 <= row["experts_touched"] <= min(experts, row["tokens"] * top_k)
        # bytes: touched experts + shared expert (3 matrices each), router, x in and out
        expected = ((row["experts_touched"] + 1) * 3 * hidden * inner
                    + experts * hidden + 2 * row["tokens"] * hidden) * 4
        assert abs(row["floor_GB"] * 1e9 - expected) < 1
