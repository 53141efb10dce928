"""Streams: incremental text never splits a UTF-8 character nor shows part of a stop
string that is later cut; finish reasons; abort; a failed step; asyncio.

The tokenizer is a byte-level BPE trained here (``tokenizers``) on text with 2-, 3- and
4-byte characters, so single tokens often hold part of a character.  Oracle for text:
``tokenizer.decode`` of the whole output, and "every snapshot is a prefix of the final
text" (a shown partial character or partial stop string would not be).  Engine tests
script the sampled tokens (the model still runs) so the text is known in advance.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from llama4_tiny import write_tiny_llama4

import chunklocal
from chunklocal.engine.detokenize import IncrementalDetokenizer
from chunklocal.engine.sampler import DeviceSample
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.stream import RequestStream

CORPUS = ["héllo wörld ünïcödé — naïve café", "日本語のテキスト、漢字とかな",
          "emoji 😀🎉👍 mixed ascii", "Ελληνικά κείμενα", "русский текст STOP"] * 20
ALPHABET = "abc STOPé日本語😀🎉ü—"


def byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


TOKENIZER = byte_level_tokenizer()


class PythonPath:
    """The tokenizer without its Rust backend: the detokenizer's two-decodes path."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


BOTH_PATHS = pytest.mark.parametrize("tokenizer", [TOKENIZER, PythonPath(TOKENIZER)],
                                     ids=["decode_stream", "python"])


def encode(text):
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_bpe")
    write_tiny_llama4(path, seed=0)
    TOKENIZER.save_pretrained(path)
    torch.set_num_threads(1)
    return chunklocal.LLM(path, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)


class Scripted:
    """Stands in for the sampler: request with prompt P gets the tokens script[P]."""

    def __init__(self, scripts):
        self.scripts = scripts

    def launch(self, logits, seqs, owner):
        tokens = [self.scripts[tuple(seqs[i].token_ids[:seqs[i].num_prompt_tokens])]
                  [seqs[i].num_generated] for i in owner]
        return DeviceSample(torch.tensor(np.array(tokens, dtype=np.int64)))


@BOTH_PATHS
@pytest.mark.parametrize("skip", [True, False])
@given(st.lists(st.integers(0, len(TOKENIZER) - 1), min_size=1, max_size=40))
@settings(max_examples=200, deadline=None)
def test_detokenizer_on_any_token_ids_streams_prefixes_of_the_decode(tokenizer, skip, ids):
    """Random ids: byte pieces that never complete a character, invalid UTF-8, <eos>."""
    final = TOKENIZER.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    for token in ids:
        detok.add(token)
        assert final.startswith(detok.visible_text), (detok.visible_text, final)
    detok.finish()
    assert detok.text == final


@pytest.fixture()
def scripted(llm, monkeypatch):
    scripts = {}
    monkeypatch.setattr(llm.runner, "sampler", Scripted(scripts))
    published = []  # every snapshot the loop publishes, in order

    def recording(self, *args):
        published.append(self._request.snapshot())
        return real(self, *args)

    real = RequestStream.publish
    monkeypatch.setattr(RequestStream, "publish", recording)
    return scripts, published


def check_prefixes(snapshots, final_text):
    for snap in snapshots:
        assert final_text.startswith(snap.outputs[0].text), (snap.outputs[0].text, final_text)


@BOTH_PATHS
@given(st.text(ALPHABET, min_size=1, max_size=30))
@settings(max_examples=300, deadline=None)
def test_detokenizer_text_is_the_decode_and_grows_by_whole_characters(tokenizer, text):
    ids = encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    for token in ids:
        assert detok.add(token) is None
        assert text.startswith(detok.visible_text)
    detok.finish()
    assert detok.text == TOKENIZER.decode(ids) == text


@BOTH_PATHS
@given(st.text(ALPHABET, min_size=1, max_size=30), st.text(ALPHABET, min_size=1, max_size=4),
       st.booleans())
@settings(max_examples=300, deadline=None)
def test_detokenizer_cuts_at_the_first_stop_string_and_never_shows_part_of_it(tokenizer, text,
                                                                             stop, include):
    detok = IncrementalDetokenizer(tokenizer, stop=(stop,), include_stop_str_in_output=include)
    at = text.find(stop)
    final = text if at < 0 else text[:at + len(stop) if include else at]
    for token in encode(text):
        shown = detok.visible_text
        assert final.startswith(shown), (shown, final)
        if detok.add(token) is not None:
            break
    detok.finish()
    assert detok.text == final
    assert detok.stopped_on == (None if at < 0 else stop)


def test_stream_snapshots_stop_string_across_tokens(llm, scripted):
    scripts, published = scripted
    text = "日本語 😀 café STOP and more text"
    prompt = [5, 6, 7]
    scripts[tuple(prompt)] = encode(text) + [0] * 5
    stream = llm.core.add_request(prompt, SamplingParams(max_tokens=30, stop=["STOP"]))
    seen = list(stream)
    final = seen[-1]
    assert final.finished and final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == "STOP"
    assert final.outputs[0].text == "日本語 😀 café "
    check_prefixes(published + seen, final.outputs[0].text)
    # token ids end with the token that completed the stop string
    ids = final.outputs[0].token_ids
    assert "STOP" in TOKENIZER.decode(ids) and "STOP" not in TOKENIZER.decode(ids[:-1])
    assert all(g.num_used == 0 for g in llm.groups)
    assert len(published) > 5  # a snapshot per step, each checked


@given(st.text(ALPHABET, min_size=1, max_size=24), st.text(ALPHABET, min_size=1, max_size=3),
       st.booleans())
@settings(max_examples=25, deadline=None)
def test_stream_prefix_property_end_to_end(llm, text, stop, include):
    """Every published snapshot (one per step) is a prefix of the final text."""
    published = []
    real = RequestStream.publish
    sampler = llm.runner.sampler
    prompt = [9, 9, len(text)]
    llm.runner.sampler = Scripted({tuple(prompt): encode(text) + [1] * 40})
    RequestStream.publish = lambda self, *a: (published.append(self._request.snapshot()),
                                               real(self, *a))[1]
    try:
        params = SamplingParams(max_tokens=len(encode(text)) + 2, stop=[stop],
                                include_stop_str_in_output=include)
        final = llm.core.add_request(prompt, params).result()
    finally:
        RequestStream.publish, llm.runner.sampler = real, sampler
    out = final.outputs[0]
    at = text.find(stop)
    if at >= 0:
        assert out.text == text[:at + len(stop) if include else at]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    else:
        assert out.finish_reason == "length"
        assert out.text == TOKENIZER.decode(out.token_ids)
    check_prefixes(published, out.text)


def test_finish_reasons_eos_stop_token_length(llm, scripted):
    scripts, _ = scripted
    body = encode("café 😀 ok")
    scripts[(1, 2)] = body + [0] + body
    scripts[(1, 3)] = body + [0] + body
    scripts[(1, 4)] = body + [0] + body
    scripts[(1, 5)] = body + [0] + body
    llm.eos_ids = frozenset([0])
    try:
        eos, stop_id, ignored, short = [s.result() for s in [
            llm.core.add_request([1, 2], SamplingParams(max_tokens=50)),
            llm.core.add_request([1, 3], SamplingParams(max_tokens=50, ignore_eos=True,
                                                        stop_token_ids=[body[2]])),
            llm.core.add_request([1, 4], SamplingParams(max_tokens=2 * len(body) + 1,
                                                        ignore_eos=True)),
            llm.core.add_request([1, 5], SamplingParams(max_tokens=3))]]
    finally:
        llm.eos_ids = frozenset()
    out = eos.outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.token_ids == body + [0] and out.text == "café 😀 ok"
    out = stop_id.outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", body[2])
    assert out.token_ids == body[:3] and out.text == TOKENIZER.decode(body[:2])
    out = ignored.outputs[0]
    assert out.finish_reason == "length" and out.token_ids == body + [0] + body
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 3
    for result in (eos, stop_id, ignored, short):
        m = result.metrics
        assert 0 <= m.time_to_first_token <= m.finished_time - m.arrival_time
        assert m.time_per_output_token is not None and m.time_per_output_token >= 0


def free_everywhere(llm):
    return all(g.num_free == g.num_blocks for g in llm.groups) and \
        not llm.scheduler.has_work()


def test_abort_frees_pages_running_and_waiting(llm, scripted, hold_steps):
    scripts, _ = scripted
    gate, entered = hold_steps(llm)  # conftest.py
    prompts = [[3, 3, i] for i in range(6)]  # 6 requests, max_num_seqs 4: 2 wait
    for p in prompts:
        scripts[tuple(p)] = [7] * 200
    streams = [llm.core.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True))
               for p in prompts]
    assert entered.wait(30)
    for s in streams[::2]:  # two running, one waiting
        s.abort()
    gate.set()
    llm.core.abort(streams[1].request_id, wait=True)
    finals = [s.result() for s in streams[:3]]
    assert all(f.outputs[0].finish_reason == "abort" for f in finals)
    assert all(len(f.outputs[0].token_ids) < 200 for f in finals)
    for s in streams[3:]:
        s.abort(wait=True)
    assert free_everywhere(llm)


def test_a_failed_step_fails_every_stream_and_frees_pages(llm, scripted):
    scripts, _ = scripted
    for i in range(3):
        scripts[(4, i)] = [8] * 20
    real_launch, calls = llm.runner.launch, []

    def fail_third(batch, prev=None):  # every step is launched, async scheduling or not
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fell over")
        return real_launch(batch, prev)

    llm.runner.launch = fail_third
    try:
        streams = [llm.core.add_request([4, i], SamplingParams(max_tokens=20)) for i in range(3)]
        for s in streams:
            with pytest.raises(RuntimeError, match="device fell over"):
                s.result()
        assert free_everywhere(llm)
    finally:
        llm.runner.launch = real_launch
    scripts[(4, 9)] = [8] * 5
    assert llm.core.add_request([4, 9], SamplingParams(max_tokens=5)).result().outputs[0]\
        .token_ids == [8] * 5


def test_async_stream_and_leaving_early_aborts(llm, scripted):
    scripts, _ = scripted
    scripts[(6, 1)] = encode("日本語 😀 café") + [1] * 100
    scripts[(6, 2)] = [1] * 100

    async def main():
        texts = [o.outputs[0].text async for o in llm.core.add_request(
            [6, 1], SamplingParams(max_tokens=len(encode("日本語 😀 café")))).aiter()]
        stream = llm.core.add_request([6, 2], SamplingParams(max_tokens=100, ignore_eos=True))
        async for _ in stream.aiter():
            break  # the client goes away
        return texts, stream

    texts, stream = asyncio.run(main())
    assert texts[-1] == "日本語 😀 café"
    assert all(texts[-1].startswith(t) for t in texts)
    final = stream.result()
    assert final.outputs[0].finish_reason == "abort"
    llm.core.abort("no-such-request", wait=True)
    assert free_everywhere(llm)
