"""benchmarks/fp8_dummy.py runs end to end at --smoke sizes on the CPU: Scout's published
config with an FP8-dynamic quantization_config, dummy FP8 weights, the same tokens from a
second load with the same seed."""

from __future__ import annotations

import json


def test_fp8_dummy_benchmark_smoke_cpu(tmp_path):
    from benchmarks import fp8_dummy

    assert fp8_dummy.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fp8_dummy_smoke.json").read_text())
    assert data["same_seed_same_tokens"] is True
    first = data["first_load"]
    # experts (4 layers x 16 x 3 x 128 x 64) and shared experts (4 x 3 x 128 x 64) in FP8
    assert first["fp8_weight_gib"] * 2**30 == 4 * 17 * 3 * 128 * 64
    assert first["new_tokens"] == 8 and set(first["kv_groups"]) == {"chunked", "global"}
