"""The engine core in a process of its own (engine/core_process.py), driven directly: the
outputs rebuilt from its deltas equal the in-process engine's (n > 1, logprobs, stop
strings, streamed snapshots), refusals and a full queue raise with nothing queued, aborts
end a request, and a dead engine process fails every open stream and later request."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal

import pytest
from llama4_tiny import write_tiny_llama4

import chunklocal
from chunklocal.engine.core import QueueFullError
from chunklocal.engine.core_process import EngineProcessError, ProcessCore
from chunklocal.engine.sampling import SamplingParams

KW = dict(device="cpu", dtype="float32", max_model_len=256, block_size=4, max_num_seqs=8)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.fixture(scope="module")
def ckpt(served_ckpt):
    return served_ckpt


@pytest.fixture(scope="module")
def core(ckpt):
    core = ProcessCore(ckpt, dict(KW, max_waiting_requests=16), timeout=300)
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def offline(ckpt):
    return chunklocal.LLM(ckpt, **KW)


def submit(core, prompts, params, tag):
    return core.submit([core.make_request(p, params, f"{tag}-{i}") for i, p in enumerate(prompts)],
                       check_queue=True)


@pytest.mark.parametrize("params", [
    dict(max_tokens=12, temperature=0.0, ignore_eos=True),
    dict(max_tokens=8, temperature=0.8, seed=3, n=3, ignore_eos=True),
    dict(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True),
    dict(max_tokens=20, temperature=0.0, stop=["e"]),
], ids=["greedy", "n3-seeded", "logprobs", "stop-string"])
def test_outputs_equal_the_in_process_engine(core, offline, params):
    p = SamplingParams(**params)
    got = [s.result() for s in submit(core, PROMPTS, p, f"eq-{len(params)}")]
    want = offline.generate(PROMPTS, p)
    for g, w in zip(got, want, strict=True):
        assert g.finished and g.prompt_token_ids == w.prompt_token_ids
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert (a.index, a.text, a.token_ids, a.finish_reason, a.stop_reason) == \
                (b.index, b.text, b.token_ids, b.finish_reason, b.stop_reason)
            if p.logprobs is not None:
                assert [sorted(e) for e in a.logprobs] == [sorted(e) for e in b.logprobs]
                assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


def test_streamed_snapshots_grow_to_the_result(core):
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    async def read():
        stream = (await core.submit_async([core.make_request(PROMPTS[0], p, "st")]))[0]
        return [out async for out in stream.aiter()]

    snaps = asyncio.run(read())
    lengths = [len(s.outputs[0].token_ids) for s in snaps]
    assert lengths == sorted(lengths) and lengths[-1] == 16 and snaps[-1].finished
    texts = [s.outputs[0].text for s in snaps]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    # metrics and the cached count travel only when they change (first token, finish):
    # every snapshot with a token still carries them, the last one its finish and TPOT
    with_tokens = [s for s in snaps if s.outputs[0].token_ids]
    assert all(s.metrics.first_token_time is not None and s.metrics.time_to_first_token > 0
               for s in with_tokens)
    assert len({s.metrics.first_token_time for s in with_tokens}) == 1
    # the prefix cache may hold the prompt from an earlier test: a count, the same in each
    cached = {s.num_cached_tokens for s in with_tokens}
    assert len(cached) == 1 and isinstance(cached.pop(), int)
    assert all(s.metrics.finished_time is None for s in snaps[:-1])
    last = snaps[-1].metrics
    assert last.finished_time >= last.first_token_time and last.time_per_output_token > 0


def test_refusals_and_a_full_queue_raise_with_nothing_queued(core):
    p = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="token id 999 at index 1 is outside the vocabulary"):
        submit(core, [[5, 6], [5, 999]], p, "bad")  # all or none: the good one is not queued
    with pytest.raises(QueueFullError):
        submit(core, [[5, 6]] * 17, p, "full")  # 17 sequences > max_waiting_requests 16
    assert core.stats()["num_waiting"] == 0
    assert submit(core, [[5, 6]], p, "after")[0].result().finished


def test_abort_ends_a_request(core):
    stream = submit(core, [[5, 6, 7]], SamplingParams(max_tokens=200, ignore_eos=True),
                    "ab")[0]
    stream.abort()
    out = stream.result()
    assert out.finished and out.outputs[0].finish_reason == "abort"


def test_a_dead_engine_process_fails_its_streams_and_later_requests(ckpt):
    core = ProcessCore(ckpt, KW, timeout=300)
    try:
        stream = submit(core, [[5, 6, 7]], SamplingParams(max_tokens=250, ignore_eos=True),
                        "dead")[0]
        os.kill(core._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessError, match="died"):
            stream.result()
        with pytest.raises(EngineProcessError):
            submit(core, [[5]], SamplingParams(max_tokens=1), "later")
    finally:
        core.shutdown()


def test_a_bad_checkpoint_is_refused_at_start(tmp_path):
    write_tiny_llama4(tmp_path)
    with pytest.raises(ValueError, match="max_model_len 99999 exceeds"):
        ProcessCore(tmp_path, dict(KW, max_model_len=99999), timeout=300)


def test_tensor_parallel_ranks_inside_the_engine_process(ckpt, offline):
    """The engine process starts its own rank processes (it is no daemon)."""
    core = ProcessCore(ckpt, dict(KW, tensor_parallel_size=2), timeout=300)
    try:
        p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        got = [s.result().outputs[0].token_ids for s in submit(core, PROMPTS, p, "tp")]
        assert got == [o.outputs[0].token_ids for o in offline.generate(PROMPTS, p)]
    finally:
        core.shutdown()


def test_a_program_that_never_shuts_it_down_still_exits(ckpt, tmp_path):
    """multiprocessing joins a non-daemon child at exit: ProcessCore stops it first."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "leave.py"
    script.write_text(
        "from chunklocal.engine.core_process import ProcessCore\n"
        "if __name__ == '__main__':\n"
        f"    core = ProcessCore({str(ckpt)!r}, {KW!r}, timeout=300)\n"
        "    print('started', flush=True)\n")
    src = Path(__file__).resolve().parent.parent / "src"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240, env={**os.environ, "PYTHONPATH": str(src)})
    assert run.returncode == 0 and "started" in run.stdout, run.stderr[-2000:]
