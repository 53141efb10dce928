"""FP8 checkpoints under tensor parallelism (gloo, CPU: FP8 weights dequantized, activations
fake-quantized per token) against the same engine with one rank.

Both published layouts: compressed-tensors FP8-dynamic (one Linear per expert, read as
per-expert pieces) and fbgemm_fp8 (fused expert stacks read transposed, scales
[E, 1, 2I] / [E, H, 1], activation_scale_ub, FP8 dense MLPs).  Row-parallel FP8 layers
see one rank's columns of each token; they scale the token by the max over ranks of
its amax, so two ranks quantize exactly as one: greedy tokens equal and prompt logits
within max|difference| / max|logit| <= 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from llama4_published import (
    MAVERICK,
    SCOUT,
    compressed_tensors_fp8,
    hf_model,
    write_maverick_fbgemm,
    write_published,
)
from test_tp_engine import compare, worker_pids_alive

import chunklocal

KW = dict(device="cpu", dtype=torch.float32, max_model_len=128, max_num_batched_tokens=32,
          block_size=4)
PROMPTS = [[(11 * i + 5 * j) % 500 for i in range(n)] for j, n in enumerate((6, 40, 77))]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def scout_ct(tmp_path_factory):
    hf = hf_model(SCOUT, seed=0)
    tensors, qc = compressed_tensors_fp8(hf)
    path = tmp_path_factory.mktemp("tp_ct")
    return write_published(path, SCOUT, tensors, multimodal=True, quantization_config=qc)


@pytest.fixture(scope="module")
def maverick_fbgemm(tmp_path_factory):
    hf = hf_model(MAVERICK, seed=2)
    path = tmp_path_factory.mktemp("tp_fbgemm")
    return write_maverick_fbgemm(path, hf)


@pytest.mark.parametrize("moe, hybrid", [("tp", True), ("ep", False)])
def test_compressed_tensors_fp8_two_ranks(scout_ct, moe, hybrid):
    ref = chunklocal.LLM(scout_ct, hybrid_kv_cache=hybrid, **KW)
    assert ref.model.layers[0].feed_forward.experts.w13.dtype == torch.float8_e4m3fn
    with chunklocal.LLM(scout_ct, tensor_parallel_size=2, moe_parallel=moe,
                        hybrid_kv_cache=hybrid, **KW) as llm:
        pids = llm.workers.pids
        compare(llm, ref, PROMPTS)
    assert worker_pids_alive(pids) == []


def test_fbgemm_fp8_fused_experts_two_ranks(maverick_fbgemm):
    ref = chunklocal.LLM(maverick_fbgemm, **KW)
    assert ref.model.layers[1].feed_forward.experts.w2.dtype == torch.float8_e4m3fn
    assert ref.model.layers[0].feed_forward.down_proj.weight.dtype == torch.float8_e4m3fn
    with chunklocal.LLM(maverick_fbgemm, tensor_parallel_size=2, **KW) as llm:
        compare(llm, ref, PROMPTS)
