"""The engine core in a process of its own (``chunklocal serve --engine-process``).

In one process the HTTP event loop and the engine core's loop thread share a GIL: the
engine waits while the loop encodes and sends chunks (docs/engine-process.md).  Here a child
process builds the ``LLM`` and runs its :class:`~chunklocal.engine.core.EngineCore`;
:class:`ProcessCore` in the server's process offers the core's client API over one pipe.

* **Requests** are checked and queued by the child (``make_request`` + ``submit``, so the
  engine's own checks apply); the server awaits the reply (``submit_async``) before it
  answers, so a refusal is still a 400 / 503 and nothing of a refused request is queued.
* **Outputs** travel as deltas: when the engine publishes a request, the child's forwarder
  thread sends its new token ids, text, logprobs and finish state, batched per wake-up; the
  server's reader thread adds them to a cumulative request whose :class:`RequestStream`
  readers see the snapshots an in-process core would give (text held back for partial
  characters and stop strings is already decided by the child's detokenizer).
* **Counters** (``stats()``) come with every batch: reading them costs no round trip.
* **Failures**: a request the engine fails raises its error in its stream; if the child
  dies, every open stream raises :class:`EngineProcessError` and new requests are refused.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import itertools
import logging
import multiprocessing
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from typing import cast

from chunklocal._threads import name_os_thread
from chunklocal.engine.core_child import child_main
from chunklocal.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from chunklocal.engine.stream import RequestStream, Wakeups


class EngineProcessError(RuntimeError):
    """The engine process died or could not start."""


def _shutdown_at_exit(core_ref) -> None:
    core = core_ref()
    if core is not None:
        core.shutdown()


class _RemoteRequest:
    """A request's outputs as the deltas have built them (what RequestStream reads)."""

    def __init__(self, request_id: str, prompt, prompt_token_ids, n: int):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, \
            prompt_token_ids
        self.outputs = [CompletionOutput(i, "", [], None, None, None, None) for i in range(n)]
        self.finished = False
        self.error: BaseException | None = None
        now = time.monotonic()
        self.metrics = RequestMetrics(now, None, None, None, None)
        self.num_cached_tokens: int | None = None

    def apply(self, samples, finished, error, metrics, cached) -> None:
        for out, (ids, text, lps, cumulative, reason, stop) in zip(self.outputs, samples,
                                                                   strict=True):
            out.token_ids.extend(ids)
            out.text += text
            if lps is not None:
                out.logprobs = (out.logprobs or []) + lps
                out.cumulative_logprob = cumulative
            out.finish_reason, out.stop_reason = reason, stop
        self.finished, self.error = finished, error
        if metrics is not None:  # None: unchanged since the last delta (core_child)
            self.metrics, self.num_cached_tokens = metrics, cached

    def snapshot(self) -> RequestOutput:
        outs = [CompletionOutput(o.index, o.text, list(o.token_ids), o.cumulative_logprob,
                                 None if o.logprobs is None else list(o.logprobs),
                                 o.finish_reason, o.stop_reason) for o in self.outputs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             self.finished, self.metrics, self.num_cached_tokens)


class ProcessCore:
    """The engine core's client API (``add_request``, ``make_request`` + ``submit``,
    ``abort``, ``stats``, ``shutdown``) for an engine in a child process; the tokenizer is
    loaded again here.  Construction returns once the child has loaded the model."""

    def __init__(self, model, llm_kwargs: dict, max_logprobs: int = 20, timeout=None):
        from chunklocal.engine.requests import load_tokenizer

        ctx = multiprocessing.get_context("spawn")  # CUDA, and no inherited threads
        self._conn, child = ctx.Pipe()
        # Not a daemon: its tensor-parallel ranks are its children.  It ends when asked, or
        # when this process's end of the pipe closes (this process gone).
        self._proc = ctx.Process(target=child_main, name="chunklocal-engine", daemon=False,
                                 args=(child, model, llm_kwargs, max_logprobs,
                                       logging.getLogger().getEffectiveLevel()))
        self._proc.start()
        child.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the fields below
        self._streams: dict[str, RequestStream] = {}
        self._replies: dict[int, Future] = {}
        self._tokens = itertools.count()
        self.closed = False
        self.died: BaseException | None = None
        msg = self._first_message(timeout)
        if msg[0] == "failed":
            self._proc.join(10)
            raise msg[1]
        info = msg[1]
        self.max_model_len, self.model_name = info["max_model_len"], info["model_name"]
        self.device = info["device"]
        self.vocab_size, self.default_sampling = info["vocab_size"], info["default_sampling"]
        self.max_logprobs, self.max_waiting_requests = info["max_logprobs"], \
            info["max_waiting_requests"]
        self._stats = info["stats"]
        try:  # None without tokenizer files, as EngineCore.tokenizer (the child checked them)
            self.tokenizer = load_tokenizer(llm_kwargs.get("tokenizer") or model)
        except ValueError:
            self.tokenizer = None
        self._reader = threading.Thread(target=self._read, name="chunklocal-engine-reader",
                                        daemon=True)
        self._reader.start()
        # multiprocessing joins a non-daemon child at exit: stop it first (atexit runs the
        # hooks registered last first)
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    def _first_message(self, timeout):
        if not self._conn.poll(timeout):
            self._proc.kill()
            raise EngineProcessError(f"the engine process did not load in {timeout} s")
        try:
            return self._conn.recv()
        except EOFError:
            self._proc.join(10)
            raise EngineProcessError(f"the engine process exited with status "
                                     f"{self._proc.exitcode} while loading") from None

    # -- client API ---------------------------------------------------------------------------
    def make_request(self, prompt_token_ids, params, request_id=None, prompt=None):
        """What ``submit`` sends; the child checks it as EngineCore.make_request does."""
        rid = f"req-{uuid.uuid4().hex}" if request_id is None else str(request_id)
        return list(prompt_token_ids), params, rid, prompt

    def submit(self, specs, check_queue: bool = False) -> list[RequestStream]:
        """Queue ``specs`` (all or none); their streams, or the child's refusal raised."""
        streams, future = self._send_submit(specs, check_queue)
        try:
            future.result()
        except BaseException:  # refused (nothing queued), or the caller went away
            self._forget(streams, abort=True)
            raise
        return streams

    async def submit_async(self, specs, check_queue: bool = False) -> list[RequestStream]:
        """``submit`` without blocking the event loop while the child answers."""
        streams, future = self._send_submit(specs, check_queue)
        try:
            await asyncio.wrap_future(future)
        except BaseException:  # refused (nothing queued), or the caller went away
            self._forget(streams, abort=True)
            raise
        return streams

    def add_request(self, prompt_token_ids, params, request_id=None, prompt=None):
        return self.submit([self.make_request(prompt_token_ids, params, request_id, prompt)],
                           check_queue=True)[0]

    def abort(self, request_id: str, wait: bool = False) -> None:
        if not self.closed:
            self._send(("abort", str(request_id)))

    def stats(self) -> dict:
        """The engine's counters as of its latest output batch."""
        return dict(self._stats)

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("reset_prefix_cache"))

    def shutdown(self) -> None:
        """Abort every request in the engine (their streams end with "abort") and stop it."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            self._send(("shutdown",))
        except (OSError, EngineProcessError):
            pass
        self._reader.join(60)
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()

    # -- internals ----------------------------------------------------------------------------
    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except OSError as err:
            raise EngineProcessError(f"the engine process is gone: {self.died or err}") from err

    def _request(self, msg_of) -> Future:
        future: Future = Future()
        with self._lock:
            if self.died is not None:
                raise EngineProcessError(f"the engine process is gone: {self.died}")
            if self.closed:
                raise RuntimeError("the engine core is shut down")
            token = next(self._tokens)
            self._replies[token] = future
        self._send(msg_of(token))
        return future

    def _call(self, name: str):
        return self._request(lambda token: ("call", token, name)).result()

    def _send_submit(self, specs, check_queue):
        streams = []
        for ids, params, rid, prompt in specs:
            stream = RequestStream(_RemoteRequest(rid, prompt, ids, params.n))
            stream.bind_abort(functools.partial(self.abort, rid))
            streams.append(stream)
        with self._lock:  # outputs may come before the reply: the streams wait for them
            for stream in streams:
                self._streams[stream.request_id] = stream
        try:
            future = self._request(lambda token: ("submit", token, specs, check_queue))
        except BaseException:
            self._forget(streams)
            raise
        return streams, future

    def _forget(self, streams, abort: bool = False) -> None:
        with self._lock:
            for stream in streams:
                self._streams.pop(stream.request_id, None)
        if abort and not self.closed and self.died is None:
            for stream in streams:  # an unknown id is a no-op in the engine
                self.abort(stream.request_id)

    def _read(self) -> None:
        name_os_thread()
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "out":
                    self._apply(msg[1])
                    self._stats = msg[2]
                elif msg[0] == "reply":
                    _, token, value, error = msg
                    with self._lock:
                        future = self._replies.pop(token)
                    if error is not None:
                        future.set_exception(error)
                    else:
                        future.set_result(value)
                elif msg[0] == "closed":
                    break
        except (EOFError, OSError) as err:
            self._fail_all(EngineProcessError(
                f"the engine process died (exit status {self._proc.exitcode}): {err!r}"))
            return
        self._fail_all(EngineProcessError("the engine process stopped"))

    def _apply(self, batch) -> None:
        wake = Wakeups()
        try:
            for rid, samples, finished, error, metrics, cached in batch:
                with self._lock:
                    stream = self._streams.get(rid)
                    if stream is not None and (finished or error is not None):
                        del self._streams[rid]
                if stream is None:
                    continue
                with stream.lock:
                    cast(_RemoteRequest, stream.request).apply(samples, finished, error,
                                                               metrics, cached)
                    stream.publish(wake)
        finally:
            wake.send()

    def _fail_all(self, err: BaseException) -> None:
        """Every open stream raises ``err``; every waiting call too."""
        with self._lock:
            if self.died is None and not self.closed:
                self.died = err
            streams, self._streams = list(self._streams.values()), {}
            replies, self._replies = list(self._replies.values()), {}
        for future in replies:
            if not future.done():
                future.set_exception(err)
        wake = Wakeups()
        for stream in streams:
            with stream.lock:
                stream.request.error = err
                stream.publish(wake)
        wake.send()
