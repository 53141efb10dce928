"""moe_triton's grouped kernel in Triton's interpreter (CPU, float32), where Triton is
installed: the kernel alone against a per-expert float64 loop, and the MoE layer that
uses it against transformers' all-experts Llama4TextMoe.  The interpreter must be
switched on before the kernel is defined, so each check runs in a fresh process.  On
the GPU, tests/gpu/test_moe_gpu.py runs the compiled kernel in bf16."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
# The H200 image's Triton interpreter cannot run the kernel's data-dependent loop bounds
# (InterpreterError on range(start, end)); there tests/gpu/test_moe_gpu.py runs the compiled
# kernel against transformers instead.
pytestmark = pytest.mark.skipif(__import__("torch").cuda.is_available(),
                                reason="GPU machine: the compiled kernel is tested in tests/gpu")

SCRIPT = textwrap.dedent("""
    import torch
    from test_moe import hf_moe, ours_from, rel_err
    from chunklocal.models import moe_triton
    from chunklocal.models.moe_triton import grouped_mm_small

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 80, 200, generator=gen)
    ends = [0, 5, 5, 39, 50, 50]  # empty experts 0, 2, 5; expert 3 spans three row blocks
    x = torch.randn(50, 200, generator=gen)
    got = grouped_mm_small(x, w, torch.tensor(ends, dtype=torch.int32), block_n=32, block_k=64)
    expected = torch.zeros(50, 80, dtype=torch.float64)
    for e, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
        expected[a:b] = x[a:b].double() @ w[e].double().T
    assert rel_err(got, expected) < 1e-6, rel_err(got, expected)

    calls = []
    real = moe_triton.grouped_mm_small
    moe_triton.grouped_mm_small = lambda *a, **k: calls.append(1) or real(*a, **k)
    for top_k, experts, tokens, stack in ((1, 16, 40, False), (2, 8, 33, True)):
        hf = hf_moe(experts, top_k, seed=top_k)
        ours = ours_from(hf, fuse_max_tokens=10**6)
        if stack:
            ours.stack_shared()
        ours.triton_max_pairs = 10**6
        x = torch.randn(tokens, 16, generator=gen)
        with torch.no_grad():
            err = rel_err(ours(x), hf(x)[0])
        assert err < 2e-6, err
    assert len(calls) == 4, calls
    print("ok")
""")


def test_triton_kernel_in_interpreter():
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(tests), *sys.path]))
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tests,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
