"""A stand-in engine core with the EngineCore interface (docs: notes/serving-interface),
for HTTP-layer tests that need no model: fast, and with a ``gate`` that holds every
request in place so tests can observe running / waiting / aborted requests.

Token k of choice i of a prompt is ``(sum(prompt) + 7 * k + i) % vocab_size``; text is the
tokenizer's decoding of the tokens so far (or "" without a tokenizer).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field


class QueueFullError(RuntimeError):
    pass


@dataclass
class FakeParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: object = None
    stop_token_ids: list | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Out:
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: object = None


@dataclass
class ReqOut:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: list
    finished: bool
    metrics: object = None


class FakeStream:
    def __init__(self, core, rid, ids, params, prompt):
        self.core, self.request_id, self.ids, self.params, self.prompt = (
            core, rid, ids, params, prompt)
        self.aborted = threading.Event()
        self.done = False  # finished by max_tokens

    def abort(self):
        self.core.abort(self.request_id)

    def _snapshot(self, k, reason):
        outs = []
        base = sum(self.ids)
        for i in range(self.params.n):
            toks = [(base + 7 * j + i) % self.core.vocab_size for j in range(k)]
            text = self.core.tokenizer.decode(toks) if self.core.tokenizer else ""
            lps = ([{t: -1.0, (t + 1) % self.core.vocab_size: -2.0} for t in toks]
                   if self.params.logprobs is not None else None)
            outs.append(Out(i, text, toks, None, lps, reason))
        return ReqOut(self.request_id, self.prompt, self.ids, outs, reason is not None)

    async def aiter(self):
        core = self.core
        try:
            for k in range(1, self.params.max_tokens + 1):
                while not core.gate.is_set() and not self.aborted.is_set():
                    await asyncio.sleep(0.005)
                if self.aborted.is_set():
                    yield self._snapshot(k - 1, "abort")
                    return
                await asyncio.sleep(core.step_s)
                if core.fail_at is not None and k == core.fail_at and self.ids[0] == 2:
                    raise RuntimeError("step failed")  # only prompts starting with 2 fail
                reason = "length" if k == self.params.max_tokens else None
                self.done = reason is not None
                yield self._snapshot(k, reason)
        finally:
            core.live.pop(self.request_id, None)


class FakeCore:
    def __init__(self, tokenizer=None, vocab_size=384, max_model_len=256, max_waiting=None,
                 step_s=0.001):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.max_waiting, self.step_s = max_waiting, step_s
        self.fail_at: int | None = None  # token at which streams of prompts [2, ...] raise
        self.model_name = "fake"
        self.gate = threading.Event()
        self.gate.set()
        self.live: dict[str, FakeStream] = {}
        self.added: list[FakeStream] = []
        self.aborted: list[str] = []
        self.closed = False

    def add_request(self, prompt_token_ids, params, request_id=None, prompt=None):
        if self.closed:
            raise RuntimeError("core is shut down")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"request {request_id}: prompt too long")
        if self.max_waiting is not None and len(self.live) >= self.max_waiting:
            raise QueueFullError(f"{len(self.live)} requests waiting")
        stream = FakeStream(self, request_id or f"r{time.time_ns()}", list(prompt_token_ids),
                            params, prompt)
        self.live[stream.request_id] = stream
        self.added.append(stream)
        return stream

    def abort(self, request_id):
        stream = self.live.pop(request_id, None) or next(
            (s for s in self.added if s.request_id == request_id), None)
        if stream is not None and not stream.done:
            stream.aborted.set()
            self.aborted.append(request_id)

    def shutdown(self):
        self.closed = True
        for rid in list(self.live):
            self.abort(rid)

    def stats(self):
        return {"num_running": len(self.live), "num_waiting": 0, "kv_usage": 0.0,
                "peak_virtual_batches": 0, "prompt_tokens_total": 0,
                "generation_tokens_total": 0, "num_preemptions_total": 0}
