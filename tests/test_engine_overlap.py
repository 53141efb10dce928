"""async_scheduling (engine/overlap.py): step n+1 is scheduled and launched before step n's
tokens reach the host.  Oracle: the synchronous loop on the same checkpoint; outputs,
texts, finish reasons and logprobs must be identical, nothing past EOS / a stop / max_tokens
may appear in any snapshot, and every page comes back.  On the CPU the overlap gains no
time (one device), but the control flow is the GPU's.
"""

from __future__ import annotations

import random

import pytest
import torch
from llama4_tiny import write_tiny_llama4
from test_engine_stream import TOKENIZER

import chunklocal
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.stream import RequestStream

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_overlap")
    write_tiny_llama4(path, seed=0)
    TOKENIZER.save_pretrained(path)
    return path


class Launch(int):
    """1 if launched with the previous step in flight; ``.penalised``: live penalised
    samples at that moment."""

    def __new__(cls, overlapped, penalised):
        obj = super().__new__(cls, overlapped)
        obj.penalised = penalised
        return obj


def engines(path, **kwargs):
    kwargs = dict(dict(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=160), **kwargs)
    sync = chunklocal.LLM(path, async_scheduling=False, **kwargs)
    overlapped = chunklocal.LLM(path, async_scheduling=True, **kwargs)
    launches = []
    real = overlapped.runner.launch

    def counting(batch, prev=None):
        launches.append(Launch(prev is not None, overlapped.core.num_penalised))
        return real(batch, prev)

    overlapped.runner.launch = counting
    return sync, overlapped, launches


def prompts_of(count, seed, low=3, high=60):
    rng = random.Random(seed)
    return [[rng.randrange(390) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def summary(outputs):
    return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs)
             for o in out.outputs] for out in outputs]


def all_free(llm):
    return (all(g.num_free == g.num_blocks for g in llm.groups)
            and not llm.scheduler.has_work())


def test_same_outputs_greedy_sampled_n_and_logprobs(path):
    sync, overlapped, launches = engines(path)
    prompts = prompts_of(10, 1)
    params = [SamplingParams(temperature=0.0, max_tokens=20, logprobs=2),
              SamplingParams(temperature=1.0, seed=3, max_tokens=17),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=30, seed=4, n=3, max_tokens=9),
              SamplingParams(temperature=1.0, min_p=0.05, seed=5, max_tokens=25)] * 2 + [
              SamplingParams(temperature=0.0, max_tokens=1),
              SamplingParams(temperature=0.0, max_tokens=None)]  # up to max_model_len
    assert summary(overlapped.generate(prompts, params)) == summary(sync.generate(prompts,
                                                                                  params))
    assert sum(launches) > 20  # most steps were launched with the previous one in flight
    legacy = prompts_of(6, 2)
    assert overlapped.generate(legacy, max_new_tokens=30) == sync.generate(legacy,
                                                                           max_new_tokens=30)
    logits = overlapped.prompt_logits(legacy)
    for a, b in zip(logits, sync.prompt_logits(legacy), strict=True):
        assert torch.equal(a, b)
    assert all_free(overlapped)


def test_nothing_past_eos_stop_token_or_stop_string(path, monkeypatch):
    sync, overlapped, launches = engines(path)
    prompts = prompts_of(8, 3)
    free = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                 ignore_eos=True))
    eos = free[0].outputs[0].token_ids[5]
    stop_id = free[1].outputs[0].token_ids[7]
    text = free[2].outputs[0].text
    stop_str = text[len(text) // 2:len(text) // 2 + 2]
    for llm in (sync, overlapped):
        llm.eos_ids = frozenset([eos])
    params = [SamplingParams(temperature=0.0, max_tokens=24),
              SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_str])] * 2 + [
              SamplingParams(temperature=1.0, seed=9, max_tokens=24, stop=[stop_str]),
              SamplingParams(temperature=0.0, max_tokens=3)]
    published = []
    real = RequestStream.publish
    monkeypatch.setattr(RequestStream, "publish",
                        lambda self, *a: (published.append(self._request.snapshot()),
                                          real(self, *a))[1])
    got = overlapped.generate(prompts, params)
    final = {out.request_id: out for out in got}
    want = sync.generate(prompts, params)
    assert summary(got) == summary(want)
    reasons = [out.outputs[0].finish_reason for out in got]
    assert reasons[:3] == ["stop", "stop", "stop"] and reasons[-1] == "length"
    assert got[0].outputs[0].token_ids[-1] == eos
    for snap in published:  # every snapshot is a prefix of the final output
        if snap.request_id in final:
            last = final[snap.request_id].outputs[0]
            ids = snap.outputs[0].token_ids
            assert last.token_ids[:len(ids)] == ids and last.text.startswith(
                snap.outputs[0].text)
    assert sum(launches) > 0 and all_free(overlapped)


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_preemption_under_a_tiny_pool(path, hybrid):
    sync, overlapped, launches = engines(path, max_num_seqs=6, max_num_batched_tokens=64,
                                         max_model_len=128, num_kv_blocks=10,
                                         hybrid_kv_cache=hybrid)
    prompts = prompts_of(6, 7, 20, 61)
    params = SamplingParams(temperature=0.9, seed=1, max_tokens=30, ignore_eos=True)
    got = overlapped.generate(prompts, params)
    assert overlapped.last_stats.preemptions > 0
    assert summary(got) == summary(sync.generate(prompts, params))
    assert sum(launches) > 0 and all_free(overlapped)


def test_penalties_turn_the_overlap_off_with_the_same_outputs(path):
    sync, overlapped, launches = engines(path)
    prompts = prompts_of(4, 11)
    params = [SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.4),
              SamplingParams(temperature=0.0, max_tokens=12)] * 2
    assert summary(overlapped.generate(prompts, params)) == summary(sync.generate(prompts,
                                                                                  params))
    # while a penalised request lives, every step is collected before the next launch
    assert not any(launch for launch in launches if launch.penalised)
    assert any(launch.penalised for launch in launches)
    launches.clear()
    overlapped.generate(prompts[:2], max_new_tokens=8)
    assert any(launches)  # and on again once they are gone


def test_abort_and_failed_step_in_flight(path):
    _, overlapped, _ = engines(path)
    stream = overlapped.core.add_request([5] * 20, SamplingParams(max_tokens=100,
                                                                   ignore_eos=True))
    next(iter(stream))
    stream.abort(wait=True)
    assert stream.result().outputs[0].finish_reason == "abort"
    # aborted with its step in flight: finished once (counters back to 0), not twice
    penalised = overlapped.core.add_request([6] * 20, SamplingParams(
        max_tokens=100, ignore_eos=True, repetition_penalty=1.2))
    next(iter(penalised))
    penalised.abort(wait=True)
    assert penalised.result().outputs[0].finish_reason == "abort"
    assert overlapped.core.num_penalised == 0 and overlapped.runner.capturing == 0
    real, calls = overlapped.runner.launch, []

    def fail_fourth(batch, prev=None):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("launch failed")
        return real(batch, prev)

    overlapped.runner.launch = fail_fourth
    with pytest.raises(RuntimeError, match="launch failed"):
        overlapped.generate(prompts_of(3, 12), max_new_tokens=10)
    assert all_free(overlapped)
    overlapped.runner.launch = real
    assert len(overlapped.generate([[1, 2, 3]], max_new_tokens=5)[0]) == 5
