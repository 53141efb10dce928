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


def test_fp8_dummy_frees_the_first_engine_before_the_second_load(tmp_path, monkeypatch):
    """The second load sizes its KV pool from the memory left free: when release() runs,
    nothing may still hold the first engine's weights (a leftover ``weights(model)`` dict
    once kept 105 GiB alive on the H200 and the second load was refused)."""
    import gc
    import weakref

    import chunklocal
    from benchmarks import fp8_dummy

    made, released = [], []
    real_llm, real_release = chunklocal.LLM, fp8_dummy.release

    def llm(*args, **kwargs):
        engine = real_llm(*args, **kwargs)
        made.append([weakref.ref(engine)] + [weakref.ref(p) for p in engine.model.parameters()])
        return engine

    def release(device):
        gc.collect()
        alive = [ref for refs in made for ref in refs if ref() is not None]
        released.append(len(alive))
        return real_release(device)

    monkeypatch.setattr(chunklocal, "LLM", llm)
    monkeypatch.setattr(fp8_dummy, "release", release)
    assert fp8_dummy.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert len(made) == 2 and released == [0, 0]
    first = json.loads((tmp_path / "fp8_dummy_smoke.json").read_text())["first_load"]
    assert first["new_tokens"] == 8
