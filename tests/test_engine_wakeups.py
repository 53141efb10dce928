"""The engine core wakes a step's asyncio readers together (engine/stream.py ``Wakeups``):
one ``call_soon_threadsafe`` per event loop and step, not one per request, and every
reader still gets every token and its final snapshot."""

from __future__ import annotations

import asyncio

import pytest

import chunklocal
from chunklocal.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

READERS, NEW_TOKENS = 8, 6


def _run_readers(core, hand_offs: list):
    async def main():
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            hand_offs.append(callback)
            return plain(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        streams = [core.add_request([1 + i, 2, 3, 4], params) for i in range(READERS)]

        async def read(stream):
            seen, last = 0, None
            async for out in stream.aiter():
                seen, last = seen + 1, out
            return seen, last

        return await asyncio.gather(*(read(s) for s in streams))

    return asyncio.run(main())


def test_one_hand_off_per_step_for_all_readers(ckpt):
    llm = chunklocal.LLM(ckpt[0], max_num_seqs=READERS, max_model_len=64)
    core = llm.core
    offline = [o.outputs[0].token_ids for o in llm.generate(
        [[1 + i, 2, 3, 4] for i in range(READERS)],
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        use_tqdm=False)]
    steps_before, hand_offs = core.num_steps, []
    results = _run_readers(core, hand_offs)
    steps = core.num_steps - steps_before
    assert [last.outputs[0].token_ids for _, last in results] == offline
    assert all(last.finished for _, last in results)
    # One wake-up per step at most (8 readers, 6 tokens each: 48 if one per request).
    assert 1 <= len(hand_offs) <= steps, (len(hand_offs), steps)
    core.shutdown()
