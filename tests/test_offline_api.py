"""The offline Python API as vLLM's (issue 24): LLM() arguments checked by name before
anything loads, non-finite weights and corrupt tokenizers refused naming the file or
tensor, generate() / chat() / get_tokenizer() like vLLM's, and two sampler / scheduler
rules (top-p's smallest set, preemption of the latest-admitted request)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import chunklocal
from chunklocal.engine import llm as llm_module
from chunklocal.engine.outputs import RequestOutput
from chunklocal.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


# -- 1. arguments ---------------------------------------------------------------------------
BAD_ARGUMENTS = [
    ("device", "tpu"), ("device", 3.5), ("dtype", 5), ("dtype", "int8"),
    ("max_num_seqs", 2.5), ("max_num_seqs", "8"), ("max_num_seqs", 0),
    ("max_num_batched_tokens", "8192"), ("max_model_len", "128"), ("max_model_len", -1),
    ("block_size", 16.0), ("num_kv_blocks", "64"), ("num_kv_blocks", 0),
    ("attention_backend", 5), ("attention_backend", "xformers"), ("cuda_graphs", "yes"),
    ("hybrid_kv_cache", 1), ("num_speculative_tokens", -1), ("num_speculative_tokens", "2"),
    ("seed", 2**64), ("seed", -1), ("seed", 1.5), ("seed", None), ("load_format", "pt"),
    ("load_format", 5), ("generation_config", 5), ("generation_config", "/no/such/dir"),
    ("max_waiting_requests", 0), ("max_waiting_requests", "10"), ("async_scheduling", "no"),
    ("tensor_parallel_size", 0), ("tensor_parallel_size", "2"), ("moe_parallel", "dp"),
    ("moe_parallel", 5),
]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if LLM() reads config.json or plans / loads weights."""
    def refuse(*args, **kwargs):
        raise AssertionError("an argument check came after reading the checkpoint")
    for name in ("read_config", "plan_load", "load_model"):
        monkeypatch.setattr(llm_module, name, refuse)


@pytest.mark.parametrize("name, value", BAD_ARGUMENTS, ids=[f"{n}={v!r}" for n, v in
                                                             BAD_ARGUMENTS])
def test_each_llm_argument_is_checked_by_name_before_anything_loads(ckpt, nothing_loads, name,
                                                                    value):
    path, _ = ckpt
    with pytest.raises(ValueError, match=rf"{name}.*{re.escape(repr(value))}"):
        chunklocal.LLM(path, **{name: value})


@pytest.mark.parametrize("model", [None, 123, b"bytes", True])
def test_a_model_that_is_not_a_path_is_named(nothing_loads, model):
    with pytest.raises(ValueError, match=rf"model must be a checkpoint directory.*"
                                         rf"{re.escape(repr(model))}"):
        chunklocal.LLM(model)


def test_the_largest_seed_is_accepted(ckpt):
    path, _ = ckpt
    llm = chunklocal.LLM(path, max_model_len=64, seed=2**64 - 1)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, seed=None))[0]
               .outputs[0].token_ids) == 2


# -- 2. non-finite weights ------------------------------------------------------------------
def _corrupt_copy(src, dst, change):
    """A copy of checkpoint ``src`` in ``dst`` whose tensors pass through ``change``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({name: change(name, t) for name, t in tensors.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_all_nan_weights_are_refused_naming_the_first_tensor(ckpt, tmp_path):
    path, _ = ckpt
    bad = _corrupt_copy(path, tmp_path / "nan", lambda name, t: torch.full_like(t, torch.nan))
    with pytest.raises(ValueError, match=r"tensor \S+ in model.safetensors holds NaN or Inf"):
        chunklocal.LLM(bad, max_model_len=64)


@pytest.mark.parametrize("victim, value", [
    ("model.layers.2.self_attn.q_proj.weight", torch.inf),
    ("model.layers.1.feed_forward.experts.gate_up_proj", -torch.inf),  # fused, transposed
    ("model.norm.weight", torch.nan),
])
def test_one_non_finite_value_is_refused_naming_its_tensor(ckpt, tmp_path, victim, value):
    path, _ = ckpt

    def change(name, t):
        if name == victim:
            t = t.clone()
            t.view(-1)[t.numel() // 2] = value
        return t

    bad = _corrupt_copy(path, tmp_path / "one", change)
    with pytest.raises(ValueError, match=rf"tensor {re.escape(victim)} in model.safetensors "
                                         r"holds NaN or Inf"):
        chunklocal.LLM(bad, max_model_len=64)
    # tensor parallel: each rank checks the slices it loads
    from chunklocal.models.loader import load_llama4
    from chunklocal.models.parallel import TPGroup

    with pytest.raises(ValueError, match=rf"tensor {re.escape(victim)} in"):
        for rank in range(2):
            load_llama4(bad, tp=TPGroup(rank, 2, None, "tp"))


def test_dummy_weights_and_finite_checkpoints_load(ckpt):
    path, _ = ckpt
    for load_format in ("auto", "dummy"):
        llm = chunklocal.LLM(path, max_model_len=64, load_format=load_format)
        assert len(llm.generate([[1, 2, 3]], max_new_tokens=2)[0]) == 2


def test_all_finite_of_each_dtype():
    from chunklocal.models.loader import all_finite

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        t = (torch.rand(6, 8) * 2 - 1).to(dtype)
        assert bool(all_finite(t)) and bool(all_finite(t[:, 2:5]))
        for value in (torch.nan, -torch.nan) + (() if dtype == torch.float8_e4m3fn
                                                 else (torch.inf, -torch.inf)):
            broken = t.clone()
            broken[3, 4] = value
            assert not bool(all_finite(broken)), (dtype, value)
            assert not bool(all_finite(broken[:, 3:5])), (dtype, value)


# -- 3. corrupt tokenizer --------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory, ckpt):
    """The tiny checkpoint with the tiny byte-level tokenizer and its chat template."""
    import shutil

    from tiny_tokenizer import write_tiny_tokenizer

    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(ckpt[0], path)
    write_tiny_tokenizer(path, vocab_size=384)
    return path


@pytest.mark.parametrize("content", ['{"version": "1.0", trunc', "", '{"model": 5}'])
def test_a_corrupt_tokenizer_json_is_named(chat_ckpt, tmp_path, content):
    import shutil

    path = tmp_path / "model"
    shutil.copytree(chat_ckpt, path)
    (path / "tokenizer.json").write_text(content)
    llm = chunklocal.LLM(path, max_model_len=64)
    with pytest.raises(ValueError, match=re.escape(str(path / "tokenizer.json"))):
        llm.generate(["hello"], max_new_tokens=2)
    with pytest.raises(ValueError, match=re.escape(str(path / "tokenizer.json"))):
        llm.get_tokenizer()


# -- 4. generate / chat / get_tokenizer as vLLM's --------------------------------------------
@pytest.fixture(scope="module")
def chat_llm(chat_ckpt):
    return chunklocal.LLM(chat_ckpt, max_model_len=128, generation_config="none")


def test_generate_without_sampling_params_returns_request_outputs_of_16_tokens(chat_llm):
    for prompts in (["Hello"], "Hello", [[1, 2, 3]]):
        outs = chat_llm.generate(prompts)
        assert len(outs) == 1 and isinstance(outs[0], RequestOutput)
        assert len(outs[0].outputs[0].token_ids) == 16  # vLLM's default max_tokens
        assert outs[0].outputs[0].finish_reason == "length"
    assert chat_llm.generate("Hello")[0].prompt == "Hello"
    assert chat_llm.generate([[1, 2, 3]])[0].prompt is None
    # one string with SamplingParams, and the legacy keyword forms, still work
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    ids = chat_llm.generate("Hello", greedy)[0].outputs[0].token_ids
    assert chat_llm.generate([[1, 2, 3]], max_new_tokens=4) == [
        chat_llm.generate([[1, 2, 3]], greedy)[0].outputs[0].token_ids]
    text = chat_llm.generate("Hello", max_new_tokens=4)
    assert text == [chat_llm.get_tokenizer().decode(ids, skip_special_tokens=True)]
    assert chat_llm.generate(["Hello"], 4) == text  # old positional max_new_tokens


def test_generate_without_params_takes_the_generation_config_defaults(chat_ckpt):
    (chat_ckpt / "gen").mkdir(exist_ok=True)
    (chat_ckpt / "gen" / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    llm = chunklocal.LLM(chat_ckpt, max_model_len=128, generation_config=chat_ckpt / "gen")
    out = llm.generate([[1, 2, 3]])[0].outputs[0].token_ids
    assert out == llm.generate([[1, 2, 3]], max_new_tokens=5)[0]


def test_get_tokenizer_is_the_checkpoints(chat_llm, chat_ckpt):
    from transformers import AutoTokenizer

    tok = chat_llm.get_tokenizer()
    assert tok is chat_llm.tokenizer
    assert tok("hello world")["input_ids"] == AutoTokenizer.from_pretrained(
        str(chat_ckpt))("hello world")["input_ids"]


def test_chat_renders_the_template_with_one_bos_and_generates(chat_llm):
    from tiny_tokenizer import SPECIALS

    tok = chat_llm.get_tokenizer()
    conversation = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello world"}]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    out = chat_llm.chat(conversation, greedy)
    assert len(out) == 1 and isinstance(out[0], RequestOutput)
    text = (f"{SPECIALS[0]}<|header_start|>system<|header_end|>\n\nbe brief<|eot|>"
            "<|header_start|>user<|header_end|>\n\nhello world<|eot|>"
            "<|header_start|>assistant<|header_end|>\n\n")
    assert out[0].prompt == text
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert out[0].prompt_token_ids == ids and ids.count(tok.bos_token_id) == 1
    assert out[0].outputs[0].token_ids == chat_llm.generate([ids], greedy)[0].outputs[0] \
        .token_ids
    # a list of conversations, default params (16 tokens), no generation prompt
    two = chat_llm.chat([conversation, conversation[1:]], add_generation_prompt=False)
    assert [len(o.outputs[0].token_ids) for o in two] == [16, 16]
    assert not two[1].prompt.endswith("assistant<|header_end|>\n\n")
    # an explicit template wins over the tokenizer's
    own = chat_llm.chat(conversation, greedy, chat_template="{% for m in messages %}"
                        "{{ m['content'] }}|{% endfor %}")
    assert own[0].prompt == "be brief|hello world|"


@pytest.mark.parametrize("messages, message", [
    ("hello", "messages must be a conversation"), ([], "messages must be a conversation"),
    ([{"content": "no role"}], "conversation 0, message 0"),
    ([[{"role": "user", "content": "hi"}], "text"], "conversation 1 is 'text'"),
])
def test_bad_chat_messages_are_named(chat_llm, messages, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        chat_llm.chat(messages)


def test_chat_without_a_template_says_so(ckpt, tmp_path):
    import shutil

    from tiny_tokenizer import write_tiny_tokenizer

    shutil.copytree(ckpt[0], tmp_path / "m")
    write_tiny_tokenizer(tmp_path / "m", chat_template=False)
    llm = chunklocal.LLM(tmp_path / "m", max_model_len=64)
    with pytest.raises(ValueError, match="has no chat template: pass chat_template="):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        chunklocal.LLM(ckpt[0], max_model_len=64).chat([{"role": "user", "content": "hi"}])


# -- 5. top-p's smallest set, preemption's victim ----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("top_p, kept", [(0.5, 2), (0.25, 1), (0.26, 2), (0.75, 3),
                                         (0.76, 4), (1.0, 4)])
def test_top_p_keeps_exactly_the_smallest_set_reaching_it(dtype, top_p, kept):
    """Four equal logits (0.25 each): the fewest tokens whose mass reaches top_p."""
    from chunklocal.engine.sampler import top_k_top_p_min_p

    logits = torch.zeros(1, 4, dtype=dtype)
    got = top_k_top_p_min_p(logits, np.array([0]), np.array([top_p]), np.array([0.0]))
    assert int(torch.isfinite(got).sum()) == kept


def test_sampler_draws_only_from_the_top_p_set():
    from test_engine_sampler import fake_seqs

    from chunklocal.engine.sampler import Sampler

    logits = torch.full((1, 4), 2.0)  # four equal tokens: top_p 0.5 keeps two
    seqs = fake_seqs([SamplingParams(temperature=0.7, top_p=0.5)] * 4000)
    tokens = Sampler("cpu", seed=1)(logits.expand(4000, 4).contiguous(), seqs,
                                    np.arange(4000)).tokens
    assert len(set(tokens.tolist())) == 2


def test_preemption_evicts_the_latest_admitted_request():
    """Three running requests, pages short: the earliest-admitted one that needs a page
    takes it from the latest-admitted (vLLM's policy), not from the one admitted next."""
    from chunklocal.engine.block_manager import BlockManager, KVGroup
    from chunklocal.engine.scheduler import Scheduler
    from chunklocal.engine.sequence import Sequence, Status
    from chunklocal.kv_spec import FullAttentionSpec

    groups = [KVGroup(FullAttentionSpec(4, 1, 8, torch.float32), 6)]  # pages of 4 tokens
    scheduler = Scheduler(BlockManager(groups, 3, 4), 3, 64, 16, 0)
    seqs = [Sequence(i, [1, 2, 3, 4], SamplingParams(max_tokens=12, ignore_eos=True), 1)
            for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    while not scheduler.num_preemptions:  # 3 x 2 pages fill the pool; then each needs a 3rd
        batch = scheduler.schedule()
        assert batch.seqs
        scheduler.postprocess(batch, [np.array([5])] * len(batch.seqs), frozenset())
    assert [s.status for s in seqs] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    assert batch.seqs == seqs[:2] and scheduler.running == seqs[:2]
