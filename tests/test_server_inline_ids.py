"""Short token-id prompts are checked on the event loop (server/prompts.py
``TokenizerPool.run``): they answer while every tokenizer thread is busy, and a bad id is
still refused by index; text prompts still go through the pool."""

from __future__ import annotations

import threading

import httpx
from fake_core import FakeCore

from chunklocal.server import prompts


def _occupy(pool) -> threading.Event:
    release = threading.Event()
    for _ in range(pool._max_workers):
        pool.submit(release.wait, 30)
    return release


def test_token_ids_answer_while_the_tokenizer_pool_is_busy(serve, tokenizer):
    s = serve(FakeCore(tokenizer))
    release = _occupy(s.state.tokenizers.pool)
    try:
        with httpx.Client(base_url=s.url, timeout=10) as client:
            text = None
            try:
                client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                            timeout=0.5)
            except httpx.ReadTimeout as err:
                text = err  # the pool really is busy: a text prompt waits for it
            assert text is not None
            got = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            assert got.status_code == 200 and got.json()["choices"][0]["finish_reason"]
            bad = client.post("/v1/completions", json={"prompt": [[1, 2], [3, 999]],
                                                       "max_tokens": 2})
            assert bad.status_code == 400
            assert "prompt 1: token id 999 at index 1" in bad.json()["error"]["message"]
    finally:
        release.set()


def test_long_token_id_prompts_and_text_go_through_the_pool():
    class Req:
        def __init__(self, prompt):
            self.prompt = prompt

    assert prompts.ids_only(Req([1, 2, 3])) and prompts.ids_only(Req([[1], [2, 3]]))
    assert not prompts.ids_only(Req("text")) and not prompts.ids_only(Req(["a", "b"]))
    assert not prompts.ids_only(Req([1] * (prompts.INLINE_IDS + 1)))
    assert not prompts.ids_only(Req([[1] * prompts.INLINE_IDS, [2]]))
