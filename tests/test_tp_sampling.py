"""Sampling under tensor_parallel_size=2: rank 0 samples with the engine's Sampler, so
seeded draws, penalties and logprobs match one rank; async_scheduling is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llama4_tiny import write_tiny_llama4

import chunklocal
from chunklocal import SamplingParams

GEOMETRY = dict(device="cpu", dtype=torch.float32, max_model_len=128,
                max_num_batched_tokens=32, block_size=4, generation_config="none")
PROMPTS = [[(7 * i + 3 * j) % 512 for i in range(n)] for j, n in enumerate((5, 33, 70))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_sampling")
    write_tiny_llama4(path, seed=0)
    return path


def test_seeded_penalised_logprob_requests_match_one_rank(ckpt):
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=11, logprobs=3),
              SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=5,
                             repetition_penalty=1.3, presence_penalty=0.2),
              SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=0.5,
                             logprobs=2)]
    ref = chunklocal.LLM(ckpt, **GEOMETRY)
    want = ref.generate(PROMPTS, params)
    with chunklocal.LLM(ckpt, tensor_parallel_size=2, **GEOMETRY) as llm:
        got = llm.generate(PROMPTS, params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        if w.outputs[0].logprobs is not None:
            for gd, wd in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
                assert gd.keys() == wd.keys()
                np.testing.assert_allclose([gd[t] for t in gd],
                                           [wd[t] for t in gd], atol=1e-4)


def test_async_scheduling_is_refused(ckpt):
    with pytest.raises(ValueError, match="async_scheduling is not supported"):
        chunklocal.LLM(ckpt, tensor_parallel_size=2, async_scheduling=True, **GEOMETRY)
