"""chunklocal.LLM on the GPU: FlashInfer + CUDA graphs vs transformers and vs the torch backend.

bf16 throughout.  Greedy tokens are compared position by position (bf16 near-ties
may flip a few), logits by relative max error.  Skips without CUDA or flashinfer.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("flashinfer")

from llama4_tiny import write_tiny_llama4  # noqa: E402

import chunklocal  # noqa: E402

BF16 = torch.bfloat16


def prompts_of(lengths, seed, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def same_fraction(outs_a, outs_b):
    pairs = [(x, y) for a, b in zip(outs_a, outs_b, strict=True)
             for x, y in zip(a, b, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_gpu")
    write_tiny_llama4(path, seed=0, hidden_size=256, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=128, attention_chunk_size=64,
                      intermediate_size=128, intermediate_size_mlp=256)
    from transformers import Llama4ForCausalLM

    hf = Llama4ForCausalLM.from_pretrained(str(path), dtype=BF16,
                                           attn_implementation="sdpa").cuda().eval()
    return path, hf


@torch.inference_mode()
def test_bf16_parity_with_transformers_flashinfer_graphs(tiny):
    path, hf = tiny
    prompts = prompts_of([20, 63, 64, 65, 130, 200, 257, 300], seed=1, vocab=512)
    new = 24
    llm = chunklocal.LLM(path, device="cuda", max_num_seqs=8, max_num_batched_tokens=512,
                         max_model_len=512)
    assert type(llm.runner.backends[0]).__name__ == "FlashInferBackend"
    outs = llm.generate(prompts, max_new_tokens=new, ignore_eos=True)
    assert llm.runner.graph_steps > 0, "no decode step replayed a CUDA graph"
    refs = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    frac = same_fraction(outs, refs)
    print(f"\nbf16 greedy tokens equal to transformers on {frac:.1%} of "
          f"{len(prompts) * new} positions; graph steps {llm.runner.graph_steps}")
    assert frac >= 0.95
    errs = []
    for prompt, got in zip(prompts, llm.prompt_logits(prompts), strict=True):
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0]
        errs.append(rel_err(got, ref))
    print(f"prefill logits relative max error vs transformers: max {max(errs):.2e}")
    assert max(errs) < 5e-2

    spec = chunklocal.LLM(path, device="cuda", max_num_seqs=8, max_num_batched_tokens=512,
                          max_model_len=512, num_speculative_tokens=3)
    spec_outs = spec.generate(prompts, max_new_tokens=new, ignore_eos=True)
    stats = spec.last_stats
    frac_spec = same_fraction(spec_outs, outs)
    print(f"k=3: same tokens as k=0 on {frac_spec:.1%}; drafts accepted "
          f"{stats.accepted_tokens}/{stats.draft_tokens}; graph steps {spec.runner.graph_steps}")
    assert frac_spec >= 0.95 and spec.runner.graph_steps > 0


@torch.inference_mode()
def test_reporter_scenario_full_geometry_matches_torch_backend(tmp_path):
    """40/8 heads, dim 128, c=8192, one 36000-token prompt, max_num_seqs=1, 4 layers."""
    write_tiny_llama4(tmp_path, seed=0, vocab_size=1024, hidden_size=512,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                      attention_chunk_size=8192, intermediate_size=256,
                      intermediate_size_mlp=512, max_position_embeddings=65536,
                      floor_scale=8192, attn_scale=0.1, initializer_range=0.05)
    prompt = prompts_of([36000], seed=2, vocab=1024)
    new, results = 8, {}
    for name, backend, budget in (("flashinfer", "flashinfer", 36000),
                                  ("flashinfer-8192", "flashinfer", 8192),
                                  ("torch", "torch", 36000)):
        llm = chunklocal.LLM(tmp_path, device="cuda", dtype=BF16, max_num_seqs=1,
                             max_num_batched_tokens=budget, max_model_len=36000 + new,
                             attention_backend=backend)
        llm.runner.capture, llm.runner.capture_last_only = {}, True
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = llm.generate(prompt, max_new_tokens=new, ignore_eos=True)[0]
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        last = torch.cat(next(iter(llm.runner.capture.values())))[-1]
        stats = llm.last_stats
        print(f"\n{name}: {seconds:.2f} s, {36000 / seconds:.0f} prompt tokens/s, steps "
              f"{stats.steps}, peak virtual batches {stats.peak_virtual_batches}, graph steps "
              f"{llm.runner.graph_steps}, tokens {out}")
        results[name] = (out, last)
        assert stats.peak_virtual_batches == (5 if budget == 36000 else 1)
        del llm
        torch.cuda.empty_cache()
    ref_out, ref_last = results["torch"]
    for name in ("flashinfer", "flashinfer-8192"):
        out, last = results[name]
        err = rel_err(last, ref_last)
        frac = same_fraction([out], [ref_out])
        print(f"{name} vs torch backend: last prompt logits rel err {err:.2e}, same tokens "
              f"{frac:.0%}")
        assert err < 5e-2 and frac >= 0.75
