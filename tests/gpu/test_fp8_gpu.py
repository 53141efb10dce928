"""FP8 on the GPU: the FP8 tensor-core paths against the CPU reference, and tiny FP8 models
of both published layouts against the float32 oracle (dequantized weights, per-token
fake-quantized activations) on a model trained to copy, so tokens are confident.

Skips without CUDA or flashinfer.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("flashinfer")

from llama4_published import (  # noqa: E402
    compressed_tensors_fp8,
    fbgemm_fp8,
    fp8_oracle,
    hf_generate,
    read_tensors,
    write_published,
)
from llama4_tiny import copy_prompts, train_copy_llama4  # noqa: E402

import chunklocal  # noqa: E402
from chunklocal.models.quant import FP8, fp8_grouped_mm, fp8_linear  # noqa: E402

GEOMETRY = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                attention_chunk_size=64, intermediate_size=128, intermediate_size_mlp=256)
LENGTHS = [20, 63, 64, 65, 130, 200, 257, 300]
NEW = 24


def rel_err(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max())


def fp8_weights(e, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=gen) * k ** -0.5
    scale = w.abs().amax(-1) / 448
    return (w / scale[..., None]).to(FP8), scale


@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_scaled_mm_equals_cpu_reference(m):
    w, scale = fp8_weights(1, 384, 256, seed=m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(384).bfloat16()
    got = fp8_linear(x.cuda(), w[0].cuda(), scale[0].cuda(), bias.cuda())
    want = fp8_linear(x.float(), w[0], scale[0], bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (m, 384)
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("sizes", [[16, 32, 0, 48], [1, 0, 5, 3, 0, 7, 2, 1], [0, 0, 130, 1]],
                         ids=["aligned", "ragged", "empty-groups"])
def test_scaled_grouped_mm_equals_cpu_reference(sizes):
    """Expert groups of any size (not multiples of 16, empty ones too), as routing gives."""
    e, n, k = len(sizes), 256, 128
    w, scale = fp8_weights(e, n, k, seed=e)
    m = sum(sizes)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = fp8_grouped_mm(x.cuda(), w.cuda(), scale.cuda(), offs.cuda())
    want = fp8_grouped_mm(x.float(), w, scale, offs)
    assert rel_err(got[:m], want) < 1e-2


def same_fraction(outs_a, outs_b):
    pairs = [(x, y) for a, b in zip(outs_a, outs_b, strict=True)
             for x, y in zip(a, b, strict=True)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from transformers import Llama4ForCausalLM

    path = tmp_path_factory.mktemp("llama4_copy_fp8")
    start = time.perf_counter()
    loss = train_copy_llama4(path, "cuda", vocab_size=128, **GEOMETRY)
    print(f"\ncopy-task training: final loss {loss:.3f} in {time.perf_counter() - start:.0f} s")
    assert loss < 0.1, f"the copy model did not train (loss {loss:.3f})"
    hf = Llama4ForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                           attn_implementation="eager").eval()
    text = {**hf.config.to_dict(), "torch_dtype": "bfloat16", "model_type": "llama4_text",
            "eos_token_id": None, "attn_temperature_tuning": 4}
    text.pop("dtype", None)
    return hf, text


@pytest.mark.parametrize("layout", ["compressed-tensors", "fbgemm_fp8"])
@torch.inference_mode()
def test_fp8_tokens_match_the_fake_quant_oracle_on_a_trained_model(trained, tmp_path, layout):
    hf, text = trained
    if layout == "compressed-tensors":
        tensors, qc = compressed_tensors_fp8(hf)
        ub = None
    else:
        skip = ["self_attn", "router", "lm_head"]
        tensors, ub = fbgemm_fp8(hf, skip), 1200.0
        qc = {"quant_method": "fbgemm_fp8", "activation_scale_ub": ub,
              "modules_to_not_convert": ["self_attn", "router", "language_model.lm_head"]}
    path = write_published(tmp_path, text, tensors, multimodal=True, quantization_config=qc)
    oracle = fp8_oracle(hf, read_tensors(path), scale_ub=ub).cuda()
    prompts = copy_prompts(LENGTHS, seed=1, vocab=128)
    llm = chunklocal.LLM(path, device="cuda", max_num_seqs=8, max_num_batched_tokens=512,
                         max_model_len=512)
    experts = llm.model.layers[1].feed_forward.experts
    assert experts.w13.dtype == FP8 and experts.w13.is_cuda
    outs = llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True)
    assert llm.runner.graph_steps > 0
    refs = [hf_generate(oracle, p, NEW) for p in prompts]
    plain = [hf_generate(hf.cuda(), p, NEW) for p in prompts]
    hf.cpu()
    agree = same_fraction(outs, refs)
    print(f"\n{layout}: FP8 engine = float32 fake-quant oracle on {agree:.1%} of "
          f"{len(prompts)}x{NEW} tokens (= unquantized float32 model on "
          f"{same_fraction(outs, plain):.1%})")
    assert agree >= 0.95


def test_dummy_fp8_scout_shaped_same_seed_same_tokens(tmp_path):
    """load_format='dummy' on the GPU: FP8 weights made on the device from the seed."""
    import json

    from llama4_published import SCOUT

    text = dict(SCOUT, hidden_size=256, head_dim=128, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=128, intermediate_size_mlp=256,
                attention_chunk_size=64, torch_dtype="bfloat16")
    qc = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
          "modules_to_not_convert": ["self_attn", "router", "language_model.lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama4", "text_config": text, "quantization_config": qc}))
    prompts = copy_prompts(LENGTHS[:4], seed=2, vocab=500)
    outs = []
    for seed in (3, 3, 4):
        llm = chunklocal.LLM(tmp_path, device="cuda", load_format="dummy", seed=seed,
                             max_model_len=512, max_num_batched_tokens=512, max_num_seqs=4)
        assert llm.model.layers[0].feed_forward.experts.w13.dtype == FP8
        outs.append(llm.generate(prompts, max_new_tokens=8, ignore_eos=True))
        del llm
    assert outs[0] == outs[1] != outs[2]
