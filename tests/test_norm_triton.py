"""norm_triton's kernels in Triton's interpreter (CPU, float32), where Triton is installed:
residual add + RMSNorm against a float64 reference (a hidden size that is not a power of
two, rows of very different scale, with and without a residual), rope + QK norm against a
float64 rotation of strided heads (with and without the norm), the switch and the
dispatch of ``llama4.add_rms_norm`` / ``llama4.rope_heads``, and a tiny Llama-4 whose
greedy tokens and logits are unchanged with the kernels on.  Fresh processes: the
interpreter must be on before the kernels are defined.  On the GPU,
tests/gpu/test_norm_triton_gpu.py runs them compiled."""

from __future__ import annotations

import os
import textwrap

import pytest

pytest.importorskip("triton")
from test_moe_triton import run_in_interpreter  # noqa: E402

pytestmark = pytest.mark.skipif(__import__("torch").cuda.is_available(),
                                reason="GPU machine: the compiled kernel is tested in tests/gpu")

KERNEL_SCRIPT = textwrap.dedent("""
    import torch
    from chunklocal.models import norm_triton
    from chunklocal.models.llama4 import RMSNorm, add_rms_norm

    assert norm_triton.NORM_ENABLED  # on by default (CHUNKLOCAL_NORM_TRITON=0: off)
    gen = torch.Generator().manual_seed(0)
    m, n, eps = 7, 80, 1e-5  # 80: the last lanes of the 128-wide block are masked
    scale = torch.logspace(-3, 3, m).view(-1, 1)
    h = torch.randn(m, n, generator=gen) * scale
    r = torch.randn(m, n, generator=gen) * scale
    w = torch.randn(n, generator=gen)
    for residual in (r, None):
        out, total = norm_triton.add_rms_norm_rows(h, residual, w, eps)
        want_total = h if residual is None else h + r  # float32 sum: the same bits
        assert torch.equal(total, want_total)
        t = want_total.double()
        want = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        err = ((out.double() - want).abs() / want.abs().clamp(min=1e-30)).max().item()
        assert err < 2e-6, err
    # the dispatch: torch's RMSNorm while off, the kernel when on
    norm = RMSNorm(n, eps)
    norm.weight.data = w
    calls, real = [], norm_triton.add_rms_norm_rows
    norm_triton.add_rms_norm_rows = lambda *a, **k: calls.append(1) or real(*a, **k)
    norm_triton.NORM_ENABLED = False
    off = add_rms_norm(h, r, norm)
    assert calls == []
    norm_triton.NORM_ENABLED = True
    on = add_rms_norm(h, r, norm)
    assert calls == [1]
    assert torch.equal(on[1], off[1])
    torch.testing.assert_close(on[0], off[0], rtol=2e-6, atol=0)
    print("ok")
""")


ROPE_SCRIPT = textwrap.dedent("""
    import torch
    from chunklocal.models import norm_triton
    from chunklocal.models.llama4 import rope_heads

    gen = torch.Generator().manual_seed(1)
    t, hq, hk, d, eps = 5, 4, 2, 16, 1e-5
    # q and k as the fused projection's output gives them: heads of strided rows
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3
    q = qkv[:, :hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].reshape(t, hk, d)
    positions = torch.tensor([0, 1, 7, 100, 4000])
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = positions.float()[:, None] * inv_freq[None, :]
    freqs = torch.polar(torch.ones_like(angles), angles) * 1.5  # a scaled rope's magnitude

    def reference(x, eps):
        pairs = torch.view_as_complex(x.double().reshape(t, -1, d // 2, 2).contiguous())
        y = torch.view_as_real(pairs * freqs.to(torch.complex128)[:, None, :]).flatten(-2)
        if eps is not None:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        return y

    for x in (q, k):
        for e in (eps, None):
            got = norm_triton.rope_norm_rows(x, freqs, e)
            assert got.shape == x.shape and got.is_contiguous()
            want = reference(x, e)
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-6, (e, err)
    # the dispatch: torch's ops while off, the kernel when on, the same values
    assert norm_triton.rope_available(q)  # on by default
    norm_triton.NORM_ENABLED = False
    assert not norm_triton.rope_available(q)
    calls, real = [], norm_triton.rope_norm_rows
    norm_triton.rope_norm_rows = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    off = rope_heads(q, freqs, eps)
    assert calls == []
    norm_triton.NORM_ENABLED = True
    on = rope_heads(q, freqs, eps)
    assert calls == [1]
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6)
    assert not norm_triton.rope_available(torch.zeros(2, 3, 12))  # D / 2 = 6: torch's ops

    # q and k of the fused projection in one launch (llama4.rope_qk), the bits of two,
    # at several tokens and at one (whose token stride reshape may give either view)
    from chunklocal.models.llama4 import rope_qk
    for rows in (qkv, qkv[:1]):
        n = rows.shape[0]
        qr = rows[:, :hq * d].reshape(n, hq, d)
        kr = rows[:, hq * d:(hq + hk) * d].reshape(n, hk, d)
        for e in (eps, None):
            calls.clear()
            got_q, got_k = rope_qk(qr, kr, freqs[:n], e)
            assert calls == [1], calls  # one launch
            assert torch.equal(got_q, real(qr, freqs[:n], e))
            assert torch.equal(got_k, real(kr, freqs[:n], e))
            assert got_q.is_contiguous() and got_k.is_contiguous()
    calls.clear()  # k not right after q (v's heads): two launches
    vr = qkv[:, (hq + hk) * d:].reshape(t, hk, d)
    got_q, got_v = rope_qk(q, vr, freqs, eps)
    assert calls == [1, 1] and torch.equal(got_v, real(vr, freqs, eps))
    for bad in (0, hq + hk):
        try:
            real(torch.as_strided(q, (t, hq + hk, d), q.stride()), freqs, eps, split=bad)
        except ValueError as err:
            assert "split must be in 1.." in str(err)
        else:
            raise AssertionError(bad)
    print("ok")
""")


ENGINE_SCRIPT = textwrap.dedent("""
    import tempfile
    import torch
    import chunklocal
    from llama4_tiny import write_tiny_llama4
    from chunklocal.engine.sampling import SamplingParams
    from chunklocal.models import norm_triton

    path = tempfile.mkdtemp()
    write_tiny_llama4(path, seed=3)
    llm = chunklocal.LLM(path, device="cpu", dtype=torch.float32, max_model_len=128,
                         block_size=4)
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate([5, 40])]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    calls, real, rope = [], norm_triton.add_rms_norm_rows, norm_triton.rope_norm_rows
    norm_triton.add_rms_norm_rows = lambda *a, **k: calls.append(1) or real(*a, **k)
    norm_triton.rope_norm_rows = lambda *a, **k: calls.append(2) or rope(*a, **k)
    outs, logits = {}, {}
    for on in (False, True):
        norm_triton.NORM_ENABLED = on
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        logits[on] = llm.prompt_logits(prompts)
    assert 1 in calls and 2 in calls  # both kernels ran
    assert outs[True] == outs[False]
    for a, b in zip(logits[False], logits[True]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    print("ok")
""")


def test_add_rms_norm_kernel_in_interpreter():
    run_in_interpreter(KERNEL_SCRIPT)


@pytest.mark.parametrize("tiled", [False, True, "vec"], ids=["one-head", "tiled", "vec"])
def test_rope_qk_norm_kernel_in_interpreter(tiled):
    """``tiled``: ROPE_TILED with tiles of 4 heads, so the fused q + k launch's 6 heads
    take a full tile and a masked one, and the split falls inside the second; ``vec``:
    the same tiles read and written as whole heads (ROPE_VEC)."""
    prefix = "from chunklocal.models import norm_triton as _nt\n_nt.ROPE_VEC = False\n"
    if tiled:
        prefix += "_nt.ROPE_TILED, _nt.ROPE_TILE_HEADS = True, 4\n"
    if tiled == "vec":
        prefix += "_nt.ROPE_TILED, _nt.ROPE_VEC = False, True\n"
    run_in_interpreter(prefix + ROPE_SCRIPT)


@pytest.mark.parametrize("rope_vec", [False, True], ids=["one-head", "vec"])
def test_engine_tokens_unchanged_with_the_kernels_in_interpreter(rope_vec):
    """``vec``: the rope kernel over whole heads (ROPE_VEC, on by default) in the engine's
    steps; ``one-head``: one head a program (``CHUNKLOCAL_ROPE_VEC=0``)."""
    from chunklocal.models import norm_triton

    assert norm_triton.ROPE_VEC or os.environ.get("CHUNKLOCAL_ROPE_VEC") == "0"
    prefix = f"from chunklocal.models import norm_triton as _nt\n_nt.ROPE_VEC = {rope_vec}\n"
    run_in_interpreter(prefix + ENGINE_SCRIPT)
