"""Checkpoints laid out as the published Llama-4 repositories, served by chunklocal.LLM.

Each layout (tests/llama4_published.py: config.json as published, shards + index, EOS
only in generation_config.json, a stray file, multimodal nesting, both FP8 layouts) must
give transformers' greedy tokens on the same weights and stop where transformers stops.
Bad checkpoints raise ValueError naming the file or tensor before any weight is read.
Runs on every supported transformers (CI also runs this file on the declared floor).
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from llama4_published import (
    MAVERICK,
    SCOUT,
    compressed_tensors_fp8,
    fp8_oracle,
    hf_generate,
    hf_model,
    read_tensors,
    routing_flips,
    routing_logits,
    routing_trace,
    write_maverick_fbgemm,
    write_published,
)

import chunklocal
from chunklocal.engine import llm as llm_module
from chunklocal.models import route_triton

NEW = 16


def engine(path, **kwargs):
    """The issue's external check: CPU, float32, small pages and budget."""
    args = dict(device="cpu", dtype=torch.float32, max_model_len=256,
                max_num_batched_tokens=32, block_size=4)
    return chunklocal.LLM(path, **{**args, **kwargs})


def prompts_of(lengths, seed=0, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


PROMPTS = prompts_of([5, 40, 77], seed=3)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def eos_stop(hf, prompts=None):
    """A generation_config EOS list under which transformers stops one of ``prompts``
    early (after 3+ tokens), on a token that is not a config.json EOS."""
    for prompt in prompts or PROMPTS:
        free = hf_generate(hf, prompt, NEW, SCOUT["eos_token_id"])
        for i, t in enumerate(free[3:-1], start=3):
            if t not in free[:i]:
                return [511, t]
    raise AssertionError("no prompt runs 5 tokens before a config.json EOS")


def check_tokens(llm, oracle, prompts, generation_eos):
    """transformers stops at config.json's EOS ids and generation_config.json's."""
    eos = SCOUT["eos_token_id"] + (generation_eos or [])
    got = llm.generate(prompts, max_new_tokens=NEW)
    want = [hf_generate(oracle, p, NEW, eos) for p in prompts]
    assert got == want
    return got


@pytest.fixture(scope="module")
def scout(tmp_path_factory):
    hf = hf_model(SCOUT, seed=0)
    return hf, eos_stop(hf)


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_scout_as_published_sharded_with_stray_file(scout, tmp_path, multimodal):
    """Legacy llama3 rope_scaling (Scout's factor 16, equal band factors),
    attn_temperature_tuning 4, MoE on every layer, EOS only in generation_config.json, a
    stray file with a tensor of the same name that the index does not name."""
    hf, eos = scout
    path = write_published(tmp_path, SCOUT, hf.state_dict(), multimodal=multimodal,
                           generation_eos=eos, stray=True)
    llm = engine(path)
    assert llm.eos_ids == {501, 502, 503, *eos}
    out = check_tokens(llm, hf, PROMPTS, eos)
    assert any(len(o) < NEW and o[-1] == eos[1] for o in out)  # a generation_config stop


def test_maverick_multimodal_as_published(tmp_path):
    """Maverick's layout: MoE every other layer, no qk norm, rope_scaling null, no
    attn_temperature_tuning key, nested text_config, vision tensors skipped."""
    hf = hf_model(MAVERICK, seed=1)
    eos = eos_stop(hf)
    path = write_published(tmp_path, MAVERICK, hf.state_dict(), multimodal=True,
                           generation_eos=eos)
    check_tokens(engine(path), hf, PROMPTS, eos)


def test_unsharded_without_index(scout, tmp_path):
    hf, eos = scout
    path = write_published(tmp_path, SCOUT, hf.state_dict(), shards=1, index=False,
                           generation_eos=eos[1])  # an int, not a list
    check_tokens(engine(path), hf, PROMPTS, eos)


# -- FP8 ------------------------------------------------------------------------------------

def test_compressed_tensors_fp8_dynamic(scout, tmp_path):
    """compressed-tensors FP8_DYNAMIC as the community Scout FP8 checkpoints: channel-wise
    e4m3 weights, one Linear per expert, attention / router / lm_head 16-bit."""
    hf, _ = scout
    tensors, qc = compressed_tensors_fp8(hf)
    assert tensors["model.layers.0.feed_forward.experts.3.up_proj.weight"].dtype == \
        torch.float8_e4m3fn
    assert tensors["model.layers.0.feed_forward.experts.3.up_proj.weight_scale"].shape == (64, 1)
    path = write_published(tmp_path, SCOUT, tensors, multimodal=True, quantization_config=qc)
    oracle = fp8_oracle(hf, read_tensors(path))
    llm = engine(path)
    fp8 = llm.model.layers[0].feed_forward
    assert fp8.experts.w13.dtype == torch.float8_e4m3fn
    # the FP8 shared expert: slot E of the experts' stacks (moe.SHARED_GROUP_TOKENS)
    assert fp8.stacked and fp8.experts.w2.shape[0] == fp8.num_experts + 1
    assert llm.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # fused at load
    check_tokens(llm, oracle, PROMPTS, None)


@torch.inference_mode()
def test_routing_flips_between_the_engine_and_the_oracle(scout, tmp_path, monkeypatch):
    """The GPU FP8 test's routing comparison (tests/gpu/test_fp8_gpu.py applies its gap bound
    where routing agrees): on the CPU in float32 the engine routes every token of a 77-token
    prompt (prefilled over 3 steps) as the fake-quant oracle does; with two experts' router
    rows swapped in the engine's last layer (so no later routing moves), exactly the tokens
    that chose either of them flip, including ones far from a tie."""
    hf, _ = scout
    tensors, qc = compressed_tensors_fp8(hf)
    path = write_published(tmp_path, SCOUT, tensors, multimodal=True, quantization_config=qc)
    oracle, llm = fp8_oracle(hf, read_tensors(path)), engine(path)
    seq = PROMPTS[2]
    with routing_trace(oracle) as traced:
        oracle(torch.tensor([seq]))
    want = routing_logits(traced, len(seq))
    assert len(want) == len(SCOUT["moe_layers"]) and want[0].shape == (77, 4)

    def engine_routing():
        with routing_trace(llm.model) as traced:
            assert not route_triton.ROUTER_IN_KERNEL  # it would call no hook
            llm.prompt_logits([seq])
        assert route_triton.ROUTER_IN_KERNEL  # restored
        return routing_logits(traced, len(seq))

    monkeypatch.setattr(route_triton, "ROUTER_IN_KERNEL", True)
    flipped, closeness = routing_flips(want, engine_routing(), top_k=1)
    assert not flipped.any() and torch.isinf(closeness).all()
    router = llm.model.layers[3].feed_forward.router.weight
    router.copy_(router[[1, 0, 2, 3]])
    flipped, closeness = routing_flips(want, engine_routing(), top_k=1)
    chose = want[3].argmax(-1)
    assert torch.equal(flipped, (chose == 0) | (chose == 1)) and flipped.any()
    assert torch.isfinite(closeness[flipped]).all() and closeness[flipped].max() > 0.25
    with pytest.raises(ValueError, match="fewer than the 78"):
        routing_logits(traced, len(seq) + 1)


def test_fbgemm_fp8_maverick(tmp_path):
    """fbgemm_fp8 as meta-llama's Maverick FP8: fused e4m3 experts with per-channel scales,
    activation_scale_ub, modules_to_not_convert 16-bit."""
    hf = hf_model(MAVERICK, seed=2)
    path = write_maverick_fbgemm(tmp_path, hf)
    tensors = read_tensors(path)
    assert tensors["model.layers.1.feed_forward.experts.gate_up_proj_scale"].shape == (8, 1, 128)
    assert tensors["model.layers.1.feed_forward.experts.down_proj_scale"].shape == (8, 64, 1)
    llm = engine(path)
    assert llm.model.layers[1].feed_forward.experts.w2.dtype == torch.float8_e4m3fn
    assert llm.model.layers[0].feed_forward.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert llm.model.layers[0].feed_forward.gate_up_proj.act_scale_ub == 1200.0
    assert llm.model.layers[1].feed_forward.experts.act_scale_ub == 1200.0
    check_tokens(llm, fp8_oracle(hf, tensors, scale_ub=1200.0), PROMPTS, None)


def fp8_layout(scout, tmp_path, layout):
    """(checkpoint dir, its fake-quant oracle): Scout as compressed-tensors FP8-dynamic, or
    Maverick as fbgemm_fp8 (activation cap 1200, dense and MoE layers interleaved)."""
    if layout == "compressed-tensors":
        hf = scout[0]
        tensors, qc = compressed_tensors_fp8(hf)
        path = write_published(tmp_path, SCOUT, tensors, multimodal=True,
                               quantization_config=qc)
        return path, fp8_oracle(hf, read_tensors(path))
    hf = hf_model(MAVERICK, seed=2)
    path = write_maverick_fbgemm(tmp_path, hf)
    return path, fp8_oracle(hf, read_tensors(path), scale_ub=1200.0)


@pytest.mark.parametrize("group_tokens", [4, 10**6], ids=["decode-steps", "every-step"])
@pytest.mark.parametrize("layout", ["compressed-tensors", "fbgemm_fp8"])
def test_fp8_shared_expert_as_a_group_of_the_experts(scout, tmp_path, monkeypatch, layout,
                                                     group_tokens):
    """moe.SHARED_GROUP_TOKENS: the FP8 shared expert stacked into slot E of the experts
    (its bytes, per-channel scales and the experts' activation cap) runs as group E of the
    grouped GEMMs on steps of at most that many tokens, and as FP8 dense GEMMs on the slot
    beyond; the tokens stay the fake-quant oracle's.  With a threshold of 4, the prefill
    steps (up to 32 tokens) take the dense path and the decode steps (3 sequences) the
    group."""
    from chunklocal.models import moe, routing
    from chunklocal.models.moe import MoE

    path, oracle = fp8_layout(scout, tmp_path, layout)
    monkeypatch.setattr(moe, "SHARED_GROUP_TOKENS", group_tokens)
    llm = engine(path)
    layers = [m for m in llm.model.modules() if isinstance(m, MoE)]
    for layer in layers:
        ex = layer.experts
        assert layer.stacked and layer.shared_expert is None
        assert ex.w13.dtype == ex.w2.dtype == torch.float8_e4m3fn
        assert ex.w13.shape[0] == ex.w2.shape[0] == ex.w13_scale.shape[0] == \
            ex.w2_scale.shape[0] == layer.num_experts + 1
    groups, dense = [], []
    real_sort, real_shared = routing.sort_by_expert, MoE._shared
    monkeypatch.setattr(routing, "sort_by_expert",
                        lambda e, n: groups.append(n) or real_sort(e, n))
    monkeypatch.setattr(MoE, "_shared", lambda self, x: dense.append(1) or real_shared(self, x))
    check_tokens(llm, oracle, PROMPTS, None)
    assert layers[0].num_experts + 1 in groups  # group E ran
    assert bool(dense) == (group_tokens == 4)   # and the dense slot past the threshold


def test_only_fp8_shared_experts_are_grouped_by_default(scout, tmp_path, monkeypatch):
    """The default (moe.SHARED_GROUP_TOKENS = 16, CHUNKLOCAL_MOE_SHARED_GROUP_TOKENS): FP8
    layers stack their shared expert and run it as group E up to 16 tokens; bf16 layers keep
    theirs (it measured no faster there); 0 keeps every shared expert in its own layers."""
    from chunklocal.models import moe

    assert moe.SHARED_GROUP_TOKENS == 16 and not moe.STACK_SHARED
    path, _ = fp8_layout(scout, tmp_path / "fp8", "compressed-tensors")
    layer = engine(path).model.layers[0].feed_forward
    assert layer.stacked and layer.fuse_max_tokens == 16
    bf16 = engine(write_published(tmp_path / "bf16", SCOUT, scout[0].state_dict()))
    layer = bf16.model.layers[0].feed_forward
    assert not layer.stacked and layer.fuse_max_tokens == 0
    monkeypatch.setattr(moe, "SHARED_GROUP_TOKENS", 0)
    layer = engine(path).model.layers[0].feed_forward
    assert not layer.stacked and layer.shared_expert is not None


def test_fp8_shared_expert_with_another_activation_cap_is_not_stacked(tmp_path,
                                                                     monkeypatch):
    """A shared expert whose FP8 layers quantize under another activation cap than the
    experts' would not get its own bits as group E: stack_shared refuses, changing nothing."""
    from chunklocal.models import moe
    from chunklocal.models.moe import MoE

    monkeypatch.setattr(moe, "SHARED_GROUP_TOKENS", 0)  # load them apart
    llm = engine(write_maverick_fbgemm(tmp_path, hf_model(MAVERICK, seed=2)))
    layer = next(m for m in llm.model.modules() if isinstance(m, MoE))
    layer.experts.act_scale_ub = 600.0
    w13 = layer.experts.w13
    assert not layer.stack_shared()
    assert layer.shared_expert is not None and layer.experts.w13 is w13
    layer.experts.act_scale_ub = 1200.0
    assert layer.stack_shared() and layer.experts.w13.shape[0] == layer.num_experts + 1


def test_fp8_oracle_is_not_the_float_model(scout, tmp_path):
    """The FP8 checks can fail: the FP8 engine's logits differ from the float model's
    by far more than from the fake-quantized oracle's."""
    hf, _ = scout
    tensors, qc = compressed_tensors_fp8(hf)
    path = write_published(tmp_path, SCOUT, tensors, quantization_config=qc)
    llm, prompt = engine(path), PROMPTS[2]
    got = llm.prompt_logits([prompt])[0]
    with torch.inference_mode():
        exact = hf(torch.tensor([prompt])).logits[0]
        oracle = fp8_oracle(hf, read_tensors(path))(torch.tensor([prompt])).logits[0]
    to_oracle = float((got - oracle).abs().max() / oracle.abs().max())
    to_float = float((got - exact).abs().max() / exact.abs().max())
    assert to_oracle < 1e-4 < 1e-2 < to_float


@pytest.mark.parametrize("eos", [None, SCOUT["eos_token_id"]], ids=["no-eos", "eos"])
def test_oracle_generate_sees_prompt_tokens_equal_to_the_pad_id(scout, eos):
    """hf_generate's tokens are step-by-step argmaxes of full forwards, also when the prompt
    holds the pad id it gives generate() (0, or eos[0]): left to infer an attention mask,
    generate() hides such tokens as padding (an FP8 GPU test once failed on it)."""
    hf, _ = scout
    pad = (eos or [0])[0]
    prompt = [pad if i % 5 == 2 else t for i, t in enumerate(PROMPTS[1])]
    seq, want = list(prompt), []
    with torch.inference_mode():
        for _ in range(6):
            want.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            if eos and want[-1] in eos:
                break
            seq.append(want[-1])
    assert hf_generate(hf, prompt, 6, eos) == want


# -- refused before loading -------------------------------------------------------------------

@pytest.fixture
def published(scout, tmp_path):
    hf, eos = scout
    return write_published(tmp_path / "ckpt", SCOUT, hf.state_dict(), generation_eos=eos)


@pytest.fixture
def no_load(monkeypatch):
    monkeypatch.setattr(llm_module, "load_model", lambda *a, **k: pytest.fail("loaded"))


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_stray_duplicate_without_index_names_both_files(scout, tmp_path, no_load):
    hf, _ = scout
    path = write_published(tmp_path, SCOUT, hf.state_dict(), shards=2, index=False, stray=True)
    with pytest.raises(ValueError, match=r"tensor lm_head.weight is in both "
                       r"consolidated.safetensors .* and model-00001-of-00002.safetensors"):
        engine(path)


def test_truncated_shard_names_the_file(published, no_load):
    shard = published / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model-00002-of-00003.safetensors: unreadable "
                                         r"safetensors file"):
        engine(published)


def test_index_naming_a_missing_file(published, no_load):
    (published / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match="names model-00003-of-00003.safetensors, which is not"):
        engine(published)


def rewrite_shard(path, file, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / file))
    change(tensors)
    save_file(tensors, str(path / file))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file}
    index["weight_map"].update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"),
     r"missing tensor model.layers.2.self_attn.k_proj.weight; the config's model needs "
     r"model.layers.2.self_attn.k_proj.weight of shape \[32, 64\]"),
    (lambda t: t.update({"model.layers.2.self_attn.k_proj.bias": torch.zeros(32)}),
     r"unexpected tensor model.layers.2.self_attn.k_proj.bias in model-00002-of-00003"
     r".safetensors \(shape \[32\]\)"),
    (lambda t: t.update({"model.layers.2.self_attn.k_proj.weight": torch.zeros(16, 64)}),
     r"tensor model.layers.2.self_attn.k_proj.weight in model-00002-of-00003.safetensors "
     r"has shape \[16, 64\]; the config needs \[32, 64\]"),
    (lambda t: t.update({"model.layers.2.self_attn.k_proj.weight":
                         torch.zeros(32, 64, dtype=torch.float8_e4m3fn)}),
     r"model.layers.2.self_attn.k_proj.weight .* is float8_e4m3fn but config.json has no "
     r"quantization_config"),
], ids=["missing", "unexpected", "mis-shaped", "fp8-without-quantization-config"])
def test_bad_tensor_named_with_shapes(published, no_load, change, message):
    file = json.loads((published / "model.safetensors.index.json").read_text())[
        "weight_map"]["model.layers.2.self_attn.k_proj.weight"]
    assert file == "model-00002-of-00003.safetensors"
    rewrite_shard(published, file, change)
    with pytest.raises(ValueError, match=message) as err:
        engine(published)
    assert len(str(err.value)) < 300  # one tensor named, not a dump of every key


def test_fp8_weight_without_its_scales(scout, tmp_path, no_load):
    hf, _ = scout
    tensors, qc = compressed_tensors_fp8(hf)
    del tensors["model.layers.1.feed_forward.experts.2.down_proj.weight_scale"]
    path = write_published(tmp_path, SCOUT, tensors, multimodal=True, quantization_config=qc)
    with pytest.raises(ValueError, match=r"missing tensor language_model.model.layers.1."
                       r"feed_forward.experts.2.down_proj.weight_scale \(an FP8 weight needs "
                       r"its scales\)"):
        engine(path)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq' is not supported"),
    ({"quant_method": "awq"}, "quantization method 'awq' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "method 'bitsandbytes'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "method 'fp8' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                       "strategy": "group", "group_size": 128,
                                                       "symmetric": True}}}},
     "compressed-tensors format 'pack-quantized' is not served"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                       "strategy": "block",
                                                       "block_structure": [128, 128]},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                          "group_size": 128, "dynamic": True}}}},
     r"scheme not served \(group 'group_0': weights float8 block\[128, 128\] static, "
     r"input_activations float8 group\(128\) dynamic\)"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                       "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float",
                                          "strategy": "tensor", "dynamic": False}}}},
     r"input_activations float8 tensor static"),
], ids=["gptq", "awq", "bnb", "fp8-block", "w4a16", "ct-block", "ct-static"])
def test_unserved_quantization_refused_naming_it(published, no_load, qc, message):
    edit_config(published, quantization_config=qc)
    with pytest.raises(ValueError, match=message):
        engine(published)


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok 5 exceeds num_local_experts 4"),
    (dict(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of "
                                  "num_key_value_heads 3"),
    (dict(moe_layers=[0, 7]), r"moe_layers \[0, 7\] must be distinct layer indices"),
    (dict(no_rope_layers=[1, 1, 0]), "no_rope_layers must hold 4 flags"),
    (dict(attn_temperature_tuning="yes"), "attn_temperature_tuning must be a bool or an int"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}),
     "unsupported rope_type 'longrope'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}),
     "rope_parameters .* and rope_scaling .* disagree"),
    (dict(torch_dtype="float8"), "torch_dtype 'float8' is not a torch float dtype"),
], ids=["experts-per-token", "heads", "moe-layers", "no-rope-layers", "tuning", "longrope",
        "rope-conflict", "dtype"])
def test_bad_config_refused_before_loading(published, monkeypatch, changes, message):
    monkeypatch.setattr(llm_module, "plan_load", lambda *a, **k: pytest.fail("read weights"))
    edit_config(published, **changes)
    with pytest.raises(ValueError, match=message):
        engine(published)


def test_chunk_not_a_multiple_of_block_size_refused_before_loading(published, no_load):
    with pytest.raises(ValueError, match="not a multiple of block_size 24"):
        engine(published, block_size=24)


def test_unreadable_generation_config(published, no_load):
    (published / "generation_config.json").write_text('{"eos_token_id": [1, "2"]}')
    with pytest.raises(ValueError, match="eos_token_id must be an int or a list of ints"):
        engine(published)


# -- KV room ------------------------------------------------------------------------------------

def test_default_max_model_len_is_max_position_embeddings_and_must_fit(published, monkeypatch):
    """No max_model_len: the config's max_position_embeddings (Scout: 10485760).  A pool
    that cannot hold one such request is refused before loading, with a length that fits;
    that length then loads and serves."""
    edit_config(published, max_position_embeddings=10485760)
    monkeypatch.setattr(llm_module, "available_memory", lambda device: 160 << 20)
    with monkeypatch.context() as m:
        m.setattr(llm_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
        with pytest.raises(ValueError, match=r"one request of max_model_len 10485760 needs "
                           r"2.5 GiB of KV cache, .* pass max_model_len <= (\d+)") as err:
            chunklocal.LLM(published)
    fits = int(err.value.args[0].rsplit("<= ", 1)[1].split()[0])
    # 40% of 160 MiB, less weights; a hybrid pool: only the global layer (one of four) holds
    # the whole sequence (2.5 GiB of the 10 GiB all four layers would hold).
    assert 0 < fits < 4 * (64 << 20) // (4 * 2 * 2 * 16 * 4 * 16) * 16
    llm = chunklocal.LLM(published, max_model_len=fits, max_num_seqs=1)
    assert llm.max_model_len == fits
    with pytest.raises(ValueError, match="one request of max_model_len"):
        chunklocal.LLM(published, max_model_len=fits + 16, max_num_seqs=1)


def test_explicit_pool_too_small_suggests_a_length(published):
    with pytest.raises(ValueError, match=r"num_kv_blocks=20 cannot hold one request: the global "
                       r"KV group needs 64 blocks of 4 tokens .*num_kv_blocks >= 64, or "
                       r"max_model_len <= 80 fits"):
        engine(published, num_kv_blocks=20)
    assert engine(published, num_kv_blocks=20, max_model_len=80).max_model_len == 80


# -- multimodal -----------------------------------------------------------------------------------

def test_image_input_refused(scout, tmp_path):
    hf, _ = scout
    path = write_published(tmp_path, SCOUT, hf.state_dict(), multimodal=True)
    llm = engine(path)
    with pytest.raises(ValueError, match="prompt 1: token id 507 at index 2 is the image "
                                         "placeholder"):
        llm.generate([PROMPTS[0], [3, 4, 507, 5]], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0: image input is not supported"):
        llm.generate([{"prompt_token_ids": [1, 2], "multi_modal_data": {"image": None}}])
    assert not llm.scheduler.has_work()
    assert llm.generate(PROMPTS[:1], max_new_tokens=4) == [hf_generate(hf, PROMPTS[0], 4)]


# -- dummy weights ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_dummy_weights_read_only_config_json(tmp_path, fp8):
    """load_format='dummy': config.json alone (garbage beside it is never read), the config's
    shapes and dtypes (FP8 ones for an FP8 config), same seed -> same tokens."""
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
              "text_config": SCOUT, "vision_config": {}, "image_token_index": 507}
    if fp8:
        config["quantization_config"] = {"quant_method": "fbgemm_fp8",
                                         "activation_scale_ub": 1200.0,
                                         "modules_to_not_convert": ["self_attn", "router",
                                                                    "language_model.lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "model.safetensors.index.json", "generation_config.json"):
        (tmp_path / name).write_text("not what it claims to be")
    runs = [engine(tmp_path, load_format="dummy", seed=s) for s in (5, 5, 6)]
    outs = [llm.generate(PROMPTS, max_new_tokens=8, ignore_eos=True) for llm in runs]
    assert outs[0] == outs[1] != outs[2]
    model = runs[0].model
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    moe_layer = model.layers[0].feed_forward
    assert moe_layer.experts.w13.dtype == dtype
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    if fp8:  # the shared expert is the experts' slot E (moe.SHARED_GROUP_TOKENS)
        assert moe_layer.stacked and moe_layer.experts.w13.shape == (5, 128, 64)
    else:
        assert moe_layer.shared_expert.gate_up_proj.weight.dtype == dtype
        assert moe_layer.experts.w13.shape == (4, 128, 64)
    assert runs[0].eos_ids == {501, 502, 503}  # config.json's only


def test_bad_load_format(published, no_load):
    with pytest.raises(ValueError, match=r"load_format must be one of .* got 'pt'"):
        engine(published, load_format="pt")


def test_published_copy_matches_original_files(published):
    """The fixture itself: a re-read of the shards gives transformers' tensors back."""
    shutil.copy(published / "config.json", published / "config.copy")
    tensors = read_tensors(published)
    assert set(tensors) >= {"lm_head.weight", "model.layers.3.feed_forward.experts.gate_up_proj"}


def test_transformers_below_the_declared_floor_is_refused(published, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.51.3")
    with pytest.raises(ImportError, match=r"transformers 4.51.3 is too old for Llama-4: "
                                          r"install transformers>=4.57"):
        engine(published)
