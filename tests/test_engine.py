"""chunklocal.LLM against transformers' Llama-4 on tiny random checkpoints (float32).

Oracle: transformers' greedy ``generate`` (tokens) and full-sequence forward
(logits).  The first test checks that this oracle really implements the chunk
semantics ``k <= p and k // c == p // c`` on the lengths used here: its eager
masks at prefill, and its sliding-window cache (c - 1 keys kept for chunked
layers) during decode across a chunk boundary.  (`chunklocal demo` also matches
transformers fed a 36000-token prompt in 2048-token pieces through its cache.)

Prompts go to transformers one at a time, unpadded: with left padding its NoPE
temperature tuning counts positions from the cache length, padding included
(``arange(q) + past_seen_tokens``, not ``position_ids``), so padded batches
would shift the scale by the padding length once positions reach floor_scale.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import transformers
from llama4_tiny import hf_greedy, hf_logits, prompts_of, rel_err, write_tiny_llama4

import chunklocal

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py, as is ckpt


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory):
    """6 layers, c=16, two global layers, top-2 MoE on 0/2/5, GQA 4/1, llama3 RoPE."""
    path = tmp_path_factory.mktemp("llama4_b")
    model = write_tiny_llama4(
        path, seed=1, num_hidden_layers=6, attention_chunk_size=16, num_key_value_heads=1,
        no_rope_layers=[1, 1, 0, 1, 1, 0], moe_layers=[0, 2, 5], num_experts_per_tok=2,
        rope_parameters=LLAMA3_ROPE, intermediate_size=48)
    return path, model


def check_parity(llm, hf, prompts, max_new_tokens):
    outputs = llm.generate(prompts, max_new_tokens=max_new_tokens)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        assert out == hf_greedy(hf, prompt, max_new_tokens), f"prompt {i} (len {len(prompt)})"
    logits = llm.prompt_logits(prompts)
    for i, (prompt, got) in enumerate(zip(prompts, logits, strict=True)):
        assert got.shape == (len(prompt), hf.config.vocab_size)
        assert rel_err(got, hf_logits(hf, prompt)) < 1e-4, f"prompt {i} (len {len(prompt)})"
    return outputs


def test_transformers_oracle_implements_chunk_semantics(ckpt, monkeypatch):
    """HF's eager masks equal the dense chunk mask at prefill, and its cached decode
    (sliding cache layers) equals its own full forward across a chunk boundary."""
    from transformers.models.llama4 import modeling_llama4

    _, hf = ckpt
    c = hf.config.attention_chunk_size
    seen = {}
    original = modeling_llama4.eager_attention_forward

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = attention_mask[0, 0] == 0  # additive mask: 0 = visible
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling_llama4, "eager_attention_forward", recording)
    length = 100
    hf_logits(hf, prompts_of([length])[0])
    p = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    causal = k <= p
    chunked = causal & (k // c == p // c)
    for layer, mask in seen.items():
        expected = chunked if hf.config.layer_types[layer] == "chunked_attention" else causal
        assert torch.equal(mask, expected), f"layer {layer}"
    assert set(seen) == set(range(hf.config.num_hidden_layers))
    monkeypatch.undo()

    prompt = prompts_of([2 * c - 4], seed=3)[0]
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    full = hf_logits(hf, out.sequences[0].tolist())
    cached = torch.cat(out.logits)
    assert rel_err(cached, full[len(prompt) - 1:-1]) < 1e-4


def test_long_prompt_split_mid_chunk(ckpt):
    path, hf = ckpt
    llm = chunklocal.LLM(path, max_num_seqs=1, max_num_batched_tokens=20, max_model_len=256)
    prompts = prompts_of([150], seed=1)
    check_parity(llm, hf, prompts, 16)
    stats = llm.last_stats  # from prompt_logits: the same prefill, 20 tokens a step
    assert stats.steps == 8 and stats.peak_virtual_batches == 2


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_concurrent_ragged_prompts(ckpt_b, hybrid):
    path, hf = ckpt_b
    llm = chunklocal.LLM(path, max_num_seqs=8, max_num_batched_tokens=96, max_model_len=256,
                         hybrid_kv_cache=hybrid)
    prompts = prompts_of([1, 3, 15, 16, 17, 31, 64, 90, 121, 7], seed=2)
    check_parity(llm, hf, prompts, 10)
    assert len(llm.groups) == (2 if hybrid else 1)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="transformers 4.x derives chunked layer_types without a chunk size")
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_no_chunking_and_moe_on_every_layer(tmp_path, hybrid):
    """attention_chunk_size=None (every layer global) and Scout's MoE on every layer."""
    hf = write_tiny_llama4(tmp_path, seed=5, attention_chunk_size=None,
                           interleave_moe_layer_step=1, num_experts_per_tok=2)
    assert set(hf.config.layer_types) == {"full_attention"}
    llm = chunklocal.LLM(tmp_path, max_num_seqs=3, max_num_batched_tokens=40,
                         max_model_len=128, hybrid_kv_cache=hybrid)
    assert len(llm.groups) == 1 and llm.last_stats is None
    check_parity(llm, hf, prompts_of([50, 7, 33], seed=12), 8)
    assert llm.last_stats.peak_virtual_batches == 0


def test_hybrid_chunked_group_keeps_one_chunk(ckpt):
    path, _ = ckpt
    llm = chunklocal.LLM(path, max_num_seqs=1, max_num_batched_tokens=20, max_model_len=512)
    llm.generate(prompts_of([300], seed=4), max_new_tokens=20)
    peak = llm.last_stats.peak_blocks
    assert peak["global"] == -(-320 // 16)          # every page of the sequence
    assert peak["chunked"] <= -(-(32 - 1 + 20) // 16)  # current chunk + in-flight tokens


def test_speculative_k3_matches_k0(ckpt):
    path, hf = ckpt
    rng = random.Random(5)
    prompts = []
    for n in (40, 70, 25):
        motif = [rng.randrange(512) for _ in range(6)]
        prompts.append((motif * (n // 6 + 1))[:n])
    prompts += prompts_of([33, 50], seed=6)
    k0 = chunklocal.LLM(path, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    k3 = chunklocal.LLM(path, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                        num_speculative_tokens=3)
    out3 = check_parity(k3, hf, prompts, 24)
    assert out3 == k0.generate(prompts, max_new_tokens=24)
    spec = k3.generate(prompts, max_new_tokens=24)
    assert spec == out3
    assert k3.last_stats.accepted_tokens > 0 and k3.last_stats.draft_tokens > 0


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_preemption_under_a_tiny_pool(ckpt, hybrid):
    path, hf = ckpt
    llm = chunklocal.LLM(path, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=128,
                         num_kv_blocks=10, hybrid_kv_cache=hybrid)
    prompts = prompts_of([40, 55, 30, 61, 20, 45], seed=7)
    outputs = llm.generate(prompts, max_new_tokens=30)
    assert llm.last_stats.preemptions > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == hf_greedy(hf, prompt, 30)
    assert all(g.num_free == g.num_blocks for g in llm.groups)


# -- bad input ------------------------------------------------------------------------------

def test_chunk_not_multiple_of_block_size(ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match="not a multiple of block_size 24"):
        chunklocal.LLM(path, block_size=24)


def test_pool_too_small_for_one_request(ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match="cannot hold one request"):
        chunklocal.LLM(path, max_model_len=256, num_kv_blocks=8)
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds the config's "
                                         "max_position_embeddings 1024"):
        chunklocal.LLM(path, max_model_len=100_000)


def test_default_kv_budget_too_small_for_one_request(tmp_path, monkeypatch):
    from chunklocal.engine import llm as llm_module

    monkeypatch.setattr(llm_module, "available_memory", lambda device: 8 << 30)
    write_tiny_llama4(tmp_path, max_position_embeddings=100_000_000)
    # Hybrid pools: only the global layer (one of four) holds the whole sequence.
    with pytest.raises(ValueError, match=r"max_model_len 100000000 needs 23.8 GiB of KV cache, "
                                         r"more than the default budget of 3.2 GiB \(40% of"):
        chunklocal.LLM(tmp_path)


@pytest.mark.parametrize("overrides", [dict(hidden_act="gelu"),
                                       dict(layer_types=["full_attention"] * 4)],
                         ids=["gelu", "rope-layers-global"])
def test_config_fields_the_model_follows(tmp_path, overrides):
    """hidden_act and layer_types change the model: both must match transformers."""
    hf = write_tiny_llama4(tmp_path, seed=2, **overrides)
    prompt = prompts_of([100], seed=4)[0]
    llm = chunklocal.LLM(tmp_path, max_model_len=256, max_num_batched_tokens=48)
    assert rel_err(llm.prompt_logits([prompt])[0], hf_logits(hf, prompt)) < 1e-4
    assert llm.generate([prompt], max_new_tokens=12) == [hf_greedy(hf, prompt, 12)]


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "swishy", "unsupported hidden_act 'swishy'"),
    ("layer_types", ["chunked_attention", "sliding_attention", "chunked_attention",
                     "full_attention"], "layer 1: unsupported layer type 'sliding_attention'"),
    ("layer_types", ["full_attention"] * 3, "invalid config.json:(?s:.*)layer.types"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
     "unsupported rope_type 'dynamic'"),
])
def test_unsupported_config_rejected_before_loading(ckpt, tmp_path, monkeypatch, field, value,
                                                     message):
    """A config the model would not reproduce is an error, not different logits."""
    import json
    import shutil

    shutil.copytree(ckpt[0], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    if field == "rope_parameters":  # replaces transformers 4.x's rope_scaling + rope_theta
        config.pop("rope_scaling", None), config.pop("rope_theta", None)
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    from chunklocal.engine import llm as llm_module

    monkeypatch.setattr(llm_module, "plan_load", lambda *a, **k: pytest.fail("read weights"))
    with pytest.raises(ValueError, match=message):
        chunklocal.LLM(tmp_path, max_model_len=128)


@pytest.mark.parametrize("dtype, expected", [("bfloat16", torch.bfloat16), ("auto", None),
                                             (torch.float16, torch.float16)])
def test_dtype_names(ckpt, dtype, expected):
    llm = chunklocal.LLM(ckpt[0], max_model_len=64, dtype=dtype)
    assert next(llm.model.parameters()).dtype == (expected or torch.float32)


@pytest.mark.parametrize("model, kwargs, message", [
    ("ckpt", dict(dtype="int8"), "dtype must be None, 'auto', .* got 'int8'"),
    ("ckpt", dict(dtype=torch.int8), "dtype must be None, 'auto', .* got torch.int8"),
    ("missing", {}, "model must be a checkpoint directory with config.json"),
])
def test_bad_model_or_dtype_rejected_before_loading(ckpt, tmp_path, monkeypatch, model, kwargs,
                                                     message):
    from chunklocal.engine import llm as llm_module

    monkeypatch.setattr(llm_module, "plan_load", lambda *a, **k: pytest.fail("read weights"))
    path = ckpt[0] if model == "ckpt" else tmp_path / "meta-llama/Llama-4-Scout-17B-16E"
    with pytest.raises(ValueError, match=message):
        chunklocal.LLM(path, max_model_len=64, **kwargs)


def test_prompt_logits_of_a_prompt_filling_max_model_len(ckpt):
    path, hf = ckpt
    prompt = prompts_of([96], seed=5)[0]
    llm = chunklocal.LLM(path, max_model_len=96, max_num_batched_tokens=40)
    assert rel_err(llm.prompt_logits([prompt])[0], hf_logits(hf, prompt)) < 1e-4
    with pytest.raises(ValueError, match="prompt 0: 96 tokens . max_new_tokens 1 exceed"):
        llm.generate([prompt], max_new_tokens=1)


def test_prompt_logits_come_at_most_max_num_seqs_rows_at_a_time(ckpt, monkeypatch):
    """A step's captured logits are computed in passes of max_num_seqs rows, the most the
    memory profile's step held ([tokens, vocab] float32 at once would not be reserved)."""
    path, hf = ckpt
    prompts = prompts_of([37, 20], seed=6)
    llm = chunklocal.LLM(path, max_model_len=96, max_num_seqs=3, max_num_batched_tokens=40)
    seen, real = [], llm.model.compute_logits
    monkeypatch.setattr(llm.model, "compute_logits",
                        lambda hidden: seen.append(hidden.shape[0]) or real(hidden))
    for got, prompt in zip(llm.prompt_logits(prompts), prompts, strict=True):
        assert rel_err(got, hf_logits(hf, prompt)) < 1e-4
    assert max(seen) == 3 and sum(seen) >= 57  # 57 prompt rows (and the sampled ones)


@pytest.mark.parametrize("bad, message", [
    ([5] * 200, r"prompt 1: 200 tokens \+ max_new_tokens 8 exceed max_model_len 128"),
    ([], "prompt 1 is empty"),
    ([3, 512, 4], "prompt 1: token id 512 at index 1 is outside the vocabulary"),
    ([3, -1], "prompt 1: token id -1 at index 1"),
    ([1.5, 2.0], "prompt 1: expected a flat list of int token ids"),
    ([1, [2, 3]], "prompt 1: expected a flat list of int token ids"),
])
def test_bad_prompt_rejected_before_any_work(ckpt, bad, message):
    path, hf = ckpt
    llm = chunklocal.LLM(path, max_num_seqs=4, max_model_len=128)
    good = prompts_of([9, 14], seed=8)
    with pytest.raises(ValueError, match=message):
        llm.generate([good[0], bad, good[1]], max_new_tokens=8)
    assert not llm.scheduler.has_work()
    assert all(g.num_free == g.num_blocks for g in llm.groups)
    assert llm.generate(good, max_new_tokens=8) == [hf_greedy(hf, p, 8) for p in good]


@pytest.mark.parametrize("name, value", [
    ("max_num_seqs", 2.5), ("max_num_seqs", True), ("block_size", 16.0),
    ("max_num_batched_tokens", "64"), ("max_model_len", 127.9), ("max_model_len", 0),
    ("num_kv_blocks", 40.5), ("num_speculative_tokens", 1.5), ("seed", 0.5),
])
def test_non_integer_engine_config_rejected(ckpt, name, value):
    path, _ = ckpt
    kwargs = dict(max_model_len=128)
    kwargs[name] = value
    with pytest.raises(ValueError, match=rf"{name} must be (an integer|positive), got {value!r}"):
        chunklocal.LLM(path, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an integer, got 2.0"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive int, got 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
    (dict(temperature="0.5"), "temperature must be a finite number >= 0, got '0.5'"),
])
def test_bad_generate_arguments_rejected_before_any_work(ckpt, kwargs, message):
    path, _ = ckpt
    llm = chunklocal.LLM(path, max_model_len=128)
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts_of([9]), **kwargs)
    assert not llm.scheduler.has_work()
    assert all(g.num_free == g.num_blocks for g in llm.groups)
    # numpy integers and floats are exact values, not mistakes
    assert len(llm.generate(prompts_of([9]), max_new_tokens=np.int64(3),
                            temperature=np.float32(0.0))[0]) == 3


# -- API ------------------------------------------------------------------------------------

def test_string_prompts_use_the_checkpoint_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf = write_tiny_llama4(tmp_path, seed=3)
    words = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(512)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(tmp_path)
    llm = chunklocal.LLM(tmp_path, max_model_len=128)
    texts = ["w5 w7 w9 w11", "w100 w3"]
    got = llm.generate(texts, max_new_tokens=6)
    want = [" ".join(f"w{t}" for t in hf_greedy(hf, [int(w[1:]) for w in text.split()], 6))
            for text in texts]
    assert got == want


def test_a_tokenizer_directory_other_than_the_models(tmp_path):
    """``LLM(tokenizer=DIR)`` (vLLM's argument) tokenizes with DIR's tokenizer; a path that
    is not a directory is refused by name before loading."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf = write_tiny_llama4(tmp_path / "model", seed=3)
    words = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(512)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(
        tmp_path / "tok")
    llm = chunklocal.LLM(tmp_path / "model", max_model_len=128, tokenizer=tmp_path / "tok")
    from chunklocal.engine.sampling import SamplingParams

    (out,) = llm.generate(["w5 w7 w9"], SamplingParams(max_tokens=4, temperature=0.0),
                          use_tqdm=False)
    assert out.prompt_token_ids == [5, 7, 9]
    assert out.outputs[0].token_ids == hf_greedy(hf, [5, 7, 9], 4)
    assert llm.get_tokenizer().convert_ids_to_tokens([11]) == ["w11"]
    with pytest.raises(ValueError, match="tokenizer must be a tokenizer directory"):
        chunklocal.LLM(tmp_path / "model", tokenizer=tmp_path / "absent")


def test_string_prompt_without_a_tokenizer(ckpt):
    path, hf = ckpt
    llm = chunklocal.LLM(path, max_model_len=64)
    with pytest.raises(ValueError, match="prompt 0 is a string: .* has no tokenizer"):
        llm.generate(["hello world"], max_new_tokens=2)
    assert not llm.scheduler.has_work()
    good = prompts_of([9], seed=8)
    assert llm.generate(good, max_new_tokens=4) == [hf_greedy(hf, good[0], 4)]


def test_a_missing_tokenizer_is_looked_for_once(ckpt, monkeypatch):
    """Without tokenizer files every access raises the same ValueError, but the directory
    is searched once (requests ask for the tokenizer on the engine's per-request path)."""
    from chunklocal.engine import llm as llm_module
    from chunklocal.engine.requests import load_tokenizer

    path, _ = ckpt
    llm = chunklocal.LLM(path, max_model_len=64)
    looks = []

    def counted(where):
        looks.append(where)
        return load_tokenizer(where)

    monkeypatch.setattr(llm_module, "load_tokenizer", counted)
    for _ in range(3):
        with pytest.raises(ValueError, match="has no tokenizer"):
            _ = llm.tokenizer
    assert len(looks) == 1
    assert llm.core.tokenizer is None  # the engine core's "none"


def test_eos_among_accepted_drafts_stops_like_k0(ckpt):
    """With prompt-lookup drafts an EOS can arrive inside an accepted draft: the request
    must stop right after it, as without speculation.  The prompt ends with the model's own
    continuation, so drafts copied from it get accepted; the test checks that some token
    first reaches the output that way, then tries every output token as the EOS."""
    path, _ = ckpt
    kwargs = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=160)
    k0 = chunklocal.LLM(path, **kwargs)
    k3 = chunklocal.LLM(path, num_speculative_tokens=3, **kwargs)
    # Seed and length found by search: the model then revisits its own earlier tokens.
    prompt = prompts_of([30], seed=2)[0]
    prompt += k0.generate([prompt], max_new_tokens=20, ignore_eos=True)[0]
    free = k0.generate([prompt], max_new_tokens=16, ignore_eos=True)[0]
    first_as_draft = set()
    postprocess = k3.scheduler.postprocess

    def spy(batch, sampled, eos_ids):
        for seq, draft, tokens in zip(batch.seqs, batch.drafts, sampled, strict=True):
            seen = set(seq.output_ids)
            for token, chosen in zip(draft, tokens, strict=False):
                if token != int(chosen):
                    break
                if token not in seen:
                    first_as_draft.add(token)
                seen.add(token)
        return postprocess(batch, sampled, eos_ids)

    k3.scheduler.postprocess = spy
    assert k3.generate([prompt], max_new_tokens=16, ignore_eos=True)[0] == free
    assert first_as_draft, "no token reached the output first as an accepted draft"
    for eos in dict.fromkeys(free):
        k0.eos_ids = k3.eos_ids = frozenset([eos])
        expected = free[:free.index(eos) + 1]
        assert k0.generate([prompt], max_new_tokens=16)[0] == expected
        assert k3.generate([prompt], max_new_tokens=16)[0] == expected, f"eos {eos}"


def test_eos_stops_a_request_like_transformers(ckpt):
    path, hf = ckpt
    prompt = prompts_of([30], seed=9)[0]
    free = hf_greedy(hf, prompt, 12)
    eos = free[4]
    hf.generation_config.eos_token_id = eos
    try:
        stopped = hf.generate(torch.tensor([prompt]), max_new_tokens=12,
                              do_sample=False)[0, len(prompt):].tolist()
    finally:
        hf.generation_config.eos_token_id = None
    llm = chunklocal.LLM(path, max_model_len=128)
    llm.eos_ids = frozenset([eos])
    assert llm.generate([prompt], max_new_tokens=12) == [stopped]
    assert stopped == free[:free.index(eos) + 1]
    assert llm.generate([prompt], max_new_tokens=12, ignore_eos=True) == [free]


def test_sampling_is_seeded_and_in_vocabulary(ckpt):
    path, _ = ckpt
    prompts = prompts_of([10, 40], seed=10)
    runs = [chunklocal.LLM(path, max_model_len=128, seed=7).generate(
        prompts, max_new_tokens=16, temperature=1.5) for _ in range(2)]
    assert runs[0] == runs[1]
    greedy = chunklocal.LLM(path, max_model_len=128).generate(prompts, max_new_tokens=16)
    assert runs[0] != greedy  # temperature 1.5 on 32 draws: greedy everywhere is implausible
    assert all(0 <= t < 512 for out in runs[0] for t in out)


def test_progress_bar_and_summary_line(ckpt, capsys):
    """The summary's virtual-batch peak equals a count derived by hand from the schedule.

    c = 32, 40 query tokens per step, 2 requests at a time, prompts A=70, B=5, C=33,
    4 new tokens each: step 1 prefills A[0, 40); step 2 A[40, 70) + B[0, 5); steps 3-5
    decode A (position 70, 71, 72) and B (5, 6, 7); step 6 prefills C[0, 33) (A and B
    are done); steps 7-9 decode C (33, 34, 35).
    """
    path, _ = ckpt
    c = 32
    schedule = [[(0, 40)], [(40, 70), (0, 5)], [(70, 71), (5, 6)], [(71, 72), (6, 7)],
                [(72, 73), (7, 8)], [(0, 33)], [(33, 34)], [(34, 35)], [(35, 36)]]
    # One virtual batch per chunk a request's query touches.
    per_step = [sum(len({p // c for p in range(start, end)}) for start, end in step)
                for step in schedule]
    assert per_step == [2, 3, 2, 2, 2, 2, 1, 1, 1]
    llm = chunklocal.LLM(path, max_num_seqs=2, max_num_batched_tokens=40, max_model_len=256)
    llm.generate(prompts_of([70, 5, 33], seed=11), max_new_tokens=4, ignore_eos=True,
                 use_tqdm=True)
    err = capsys.readouterr().err
    assert "generate" in err and "3/3" in err
    assert "3 requests, 108 prompt + 12 new tokens" in err
    assert f"{len(schedule)} steps, peak virtual batches per step {max(per_step)}," in err
    assert list(llm.runner.virtual_batches_per_step) == per_step
    assert list(llm.runner.tokens_per_step) == [sum(e - s for s, e in step) for step in schedule]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("entry", ["generate", "prompt_logits"])
def test_failed_step_frees_every_request(ckpt, monkeypatch, error, entry):
    """A step that raises mid-call leaves no pages held and nothing queued; the next call
    answers exactly like a fresh engine (the stale requests do not run again)."""
    path, _ = ckpt
    kwargs = dict(max_num_seqs=2, max_num_batched_tokens=24, max_model_len=128)
    llm = chunklocal.LLM(path, **kwargs)
    real_launch, calls = llm.runner.launch, []

    def launch_then_fail(*args):  # every step is launched, with async scheduling or not
        calls.append(1)
        if len(calls) == 2:
            raise error("step failed")
        return real_launch(*args)

    monkeypatch.setattr(llm.runner, "launch", launch_then_fail)
    with pytest.raises(error, match="step failed"):
        if entry == "generate":
            llm.generate(prompts_of([40, 9, 30], seed=12), max_new_tokens=5)
        else:
            llm.prompt_logits(prompts_of([40, 9, 30], seed=12))
    assert len(calls) == 2
    assert not llm.scheduler.running and not llm.scheduler.waiting
    for group in llm.groups:
        assert sorted(group.free_blocks) == list(range(group.num_blocks))
    assert sorted(llm.block_manager.free_rows) == list(range(kwargs["max_num_seqs"]))
    assert not any(table.any() for table in llm.block_manager.tables)
    monkeypatch.setattr(llm.runner, "launch", real_launch)
    prompts = prompts_of([33, 12], seed=13)
    fresh = chunklocal.LLM(path, **kwargs).generate(prompts, max_new_tokens=6)
    assert llm.generate(prompts, max_new_tokens=6) == fresh
    assert llm.last_stats.requests == 2
