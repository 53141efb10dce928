"""A request's live state and the stream that hands its snapshots to a client.

The engine core's loop thread is the only writer: it updates a request's samples and
then publishes (``publish``) under the stream's lock.  Readers (any thread, or
an asyncio task) build a snapshot under the same condition, so a snapshot never mixes
two steps.  Snapshots are cumulative, so a slow reader simply skips to the latest one:
nothing queues up behind it and nothing is lost.

A step's asyncio readers are woken together (``Wakeups``): one ``call_soon_threadsafe``
per event loop and step, not one per request.  Each is a write to the loop's self-pipe, a
system call that hands the GIL to the loop thread, so one per request made the loop thread
and the engine thread trade the GIL 64 times per step at 64 streams.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from chunklocal.engine.detokenize import IncrementalDetokenizer
from chunklocal.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from chunklocal.engine.sequence import Sequence


class Wakeups:
    """The asyncio events to set after one engine step, grouped by event loop; ``send``
    sets each loop's events with one ``call_soon_threadsafe``."""

    __slots__ = ("events",)

    def __init__(self):
        self.events: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}

    def add(self, loop, event: asyncio.Event) -> None:
        events = self.events.get(loop)
        if events is None:
            self.events[loop] = [event]
        else:
            events.append(event)

    def send(self) -> None:
        events, self.events = self.events, {}
        for loop, group in events.items():
            try:
                loop.call_soon_threadsafe(_set_all, group)
            except RuntimeError:  # that event loop is closed: its readers are gone
                pass


def _set_all(events) -> None:
    for event in events:
        event.set()


class Sample:
    """One of a request's ``n`` samples: what has been emitted to the client so far (the
    loop thread writes it under the stream's lock; readers take the lock).  Its engine
    state is the request's ``seqs[index]``; neither points at the other."""

    def __init__(self, index: int, params, tokenizer):
        self.index, self.params = index, params
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None \
            else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output)

    @property
    def text(self) -> str:
        return "" if self.detok is None else self.detok.visible_text

    def finish(self, reason: str, stop_reason=None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason
            if self.detok is not None:
                self.detok.finish()

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            self.index, self.text, list(self.token_ids),
            None if self.logprobs is None else self.cumulative_logprob,
            None if self.logprobs is None else list(self.logprobs),
            self.finish_reason, self.stop_reason)


class Request:
    """A client request: prompt, params and, per sample ``i`` of ``n``, its output state
    ``samples[i]`` and its engine sequence ``seqs[i]`` (``seqs[i].request`` is this
    request, ``seqs[i].index`` is ``i``).  The request owns both; the one object shared
    with clients is ``stream``."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params, prompt,
                 arrival_time: float):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.params, self.prompt = params, prompt
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.samples: list[Sample] = []
        self.seqs: list[Sequence] = []
        self.error: BaseException | None = None
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.stream = RequestStream(self)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def metrics(self) -> RequestMetrics:
        ttft = tpot = None
        if self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival_time
            longest = max(len(s.token_ids) for s in self.samples)
            if self.finished_time is not None and longest > 1:
                tpot = (self.finished_time - self.first_token_time) / (longest - 1)
        return RequestMetrics(self.arrival_time, self.first_token_time, self.finished_time,
                              ttft, tpot)

    def snapshot(self) -> RequestOutput:
        # prompt_token_ids is shared, not copied per snapshot: treat it as read-only.
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [s.output() for s in self.samples], self.finished, self.metrics(),
                             self.seqs[0].num_cached_tokens if self.seqs else None)


class Published(Protocol):
    """What a stream reads of its request: a :class:`Request` of this process's engine
    core, or an engine process's request as its deltas built it (engine/core_process.py)."""

    request_id: str
    error: BaseException | None

    @property
    def finished(self) -> bool: ...

    def snapshot(self) -> RequestOutput: ...


class RequestStream:
    """Iterate (blocking, any thread) or ``async for`` over ``aiter()`` to get cumulative
    ``RequestOutput`` snapshots; the last has ``finished=True``.  If the engine failed the
    request (a step raised), iteration raises that error.  Leaving an ``aiter()`` loop
    before the end (a client gone) aborts the request."""

    def __init__(self, request: Published):
        self._request = request
        self.request_id = request.request_id
        self._cond = threading.Condition()
        self._version = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._abort: Callable[[bool], None] | None = None  # bind_abort()
        #: Called by publish() with the lock held (engine/core_process.py's forwarder).
        self.listener: Callable[[RequestStream], None] | None = None
        self._done = threading.Event()  # set after the final publish (result() waits here)
        self._sync_readers = 0  # threads inside __iter__'s wait (skip notify_all without)

    # -- writer side (the engine core) ------------------------------------------------------
    @property
    def request(self) -> Published:
        """The request whose state this stream publishes (the engine's writers only)."""
        return self._request

    @property
    def lock(self) -> threading.Condition:
        """Held by the engine while it changes the request's state and publishes it; the
        readers take snapshots under it."""
        return self._cond

    def bind_abort(self, abort: Callable[[bool], None]) -> None:
        """What :meth:`abort` calls (``abort(wait)``): the engine core's, bound once the
        request is made."""
        self._abort = abort

    def publish(self, wakeups: Wakeups | None = None) -> None:
        """Call with :attr:`lock` held, after changing the request's state; asyncio readers
        are woken now, or by ``wakeups.send()`` (the step's publish sends once)."""
        self._version += 1
        if self.listener is not None:  # an engine process's forwarder (core_process.py)
            self.listener(self)
        if self._request.finished or self._request.error is not None:
            self._done.set()
        if self._sync_readers:
            self._cond.notify_all()
        for loop, event in self._waiters:
            if wakeups is not None:
                wakeups.add(loop, event)
                continue
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that event loop is closed: its reader is gone
                pass

    # -- reader side -------------------------------------------------------------------------
    def _take(self, seen: int):
        """(version, snapshot, done) if newer than ``seen``, else None; raises the error."""
        req = self._request
        if req.error is not None:
            raise req.error
        if self._version == seen:
            return None
        return self._version, req.snapshot(), req.finished

    def __iter__(self):
        seen = 0
        while True:
            with self._cond:
                got = self._take(seen)
                while got is None:
                    self._sync_readers += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._sync_readers -= 1
                    got = self._take(seen)
            seen, snapshot, done = got
            yield snapshot
            if done:
                return

    async def aiter(self):
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        seen, done = 0, False
        try:
            while True:
                event.clear()
                with self._cond:
                    got = self._take(seen)
                if got is None:
                    await event.wait()
                    continue
                seen, snapshot, done = got
                yield snapshot
                if done:
                    return
        finally:
            with self._cond:
                self._waiters.remove((loop, event))
            if not done and self._request.error is None:
                self.abort(wait=False)  # reader gone before the end

    def result(self) -> RequestOutput:
        """Block until the request finishes; its final snapshot (or raise its error).
        Waits without building the snapshots in between."""
        self._done.wait()
        with self._cond:
            if self._request.error is not None:
                raise self._request.error
            return self._request.snapshot()

    @property
    def finished(self) -> bool:
        with self._cond:
            return self._request.finished or self._request.error is not None

    def abort(self, wait: bool = False) -> None:
        """Same as ``EngineCore.abort(self.request_id, wait)``."""
        if self._abort is None:
            raise RuntimeError(f"request {self.request_id}: not submitted to an engine core")
        self._abort(wait)
