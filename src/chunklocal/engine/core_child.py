"""The engine process's side of engine/core_process.py: it builds the ``LLM``, queues the
server's requests on its engine core, and forwards what the core publishes as deltas."""

from __future__ import annotations

import logging
import signal
import threading
from typing import cast

from chunklocal._threads import name_os_thread
from chunklocal.engine.stream import Request


def _portable(err: BaseException) -> BaseException:
    """``err`` if it pickles, else a RuntimeError with its text (for the pipe)."""
    import pickle

    try:
        pickle.dumps(err)
        return err
    except Exception:  # noqa: BLE001 - any unpicklable exception
        return RuntimeError(f"{type(err).__name__}: {err}")


class _Forwarder(threading.Thread):
    """Sends the requests the engine published since the last wake-up, as deltas."""

    def __init__(self, core, send):
        super().__init__(name="chunklocal-forwarder", daemon=True)
        self.core, self.send = core, send
        self._lock, self._event = threading.Lock(), threading.Event()
        self._dirty: set = set()
        self._sent: dict[str, list[tuple[int, int, int]]] = {}
        #: (first token time, finish time, cached tokens) last sent per request: metrics and
        #: the cached count go only when they change (first token, finish), as None
        #: otherwise: the dataclass in every delta was most of a batch's pickling.
        self._meta: dict[str, tuple] = {}
        self.stopping = False

    def watch(self, streams) -> None:
        with self._lock:
            for stream in streams:
                stream.listener = self._mark
                self._dirty.add(stream)
        self._event.set()

    def _mark(self, stream) -> None:  # RequestStream.publish, its lock held
        with self._lock:
            self._dirty.add(stream)
        self._event.set()

    def run(self) -> None:
        name_os_thread()
        while not self.stopping:
            self._event.wait()
            self._event.clear()
            self.flush()

    def flush(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        batch = []
        for stream in dirty:
            with stream.lock:
                batch.append(self._delta(stream))
        if batch:
            self.send(("out", batch, self.core.stats()))

    def _delta(self, stream):
        req = cast(Request, stream.request)  # this process's engine core's
        sent = self._sent.setdefault(req.request_id, [(0, 0, 0)] * len(req.samples))
        samples = []
        for i, s in enumerate(req.samples):
            tokens, chars, lps = sent[i]
            text = s.text
            samples.append((s.token_ids[tokens:], text[chars:],
                            None if s.logprobs is None else s.logprobs[lps:],
                            None if s.logprobs is None else s.cumulative_logprob,
                            s.finish_reason, s.stop_reason))
            sent[i] = (len(s.token_ids), len(text), 0 if s.logprobs is None else len(s.logprobs))
        error = None if req.error is None else _portable(req.error)
        done = req.finished or error is not None
        cached = req.seqs[0].num_cached_tokens if req.seqs else None
        meta = (req.first_token_time, req.finished_time, cached)
        changed = done or self._meta.get(req.request_id) != meta
        self._meta[req.request_id] = meta
        if done:
            self._sent.pop(req.request_id, None)
            self._meta.pop(req.request_id, None)
            stream.listener = None
        return (req.request_id, samples, req.finished, error,
                req.metrics() if changed else None, cached if changed else None)


def child_main(conn, model, llm_kwargs: dict, max_logprobs: int, log_level: int) -> None:
    # The server stops this process (Ctrl-C reaches the whole process group: the server
    # decides); its log lines (the KV pool's start-up line) go where the server's go.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    send_lock = threading.Lock()

    def send(msg):
        with send_lock:
            conn.send(msg)

    try:
        from chunklocal.engine.llm import LLM

        llm = LLM(model, **llm_kwargs)
        core = llm.core
        _ = core.tokenizer  # a bad tokenizer fails here, before the port opens
        core.max_logprobs = max_logprobs
    except BaseException as err:  # noqa: BLE001 - reported to the server, which exits
        send(("failed", _portable(err)))
        return
    forwarder = _Forwarder(core, send)
    forwarder.start()
    send(("ready", dict(max_model_len=core.max_model_len, model_name=core.model_name,
                        device=str(llm.device),
                        vocab_size=llm.config.vocab_size, max_logprobs=core.max_logprobs,
                        default_sampling=dict(llm.default_sampling),
                        max_waiting_requests=core.max_waiting_requests, stats=core.stats())))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "submit":
                _, token, specs, check_queue = msg
                try:
                    reqs = [core.make_request(ids, params, rid, prompt)
                            for ids, params, rid, prompt in specs]
                    streams = core.submit(reqs, check_queue=check_queue)
                except BaseException as err:  # noqa: BLE001 - the server answers it
                    send(("reply", token, None, _portable(err)))
                    continue
                forwarder.watch(streams)
                send(("reply", token, True, None))
            elif msg[0] == "abort":
                core.abort(msg[1])
            elif msg[0] == "call":  # ("call", token, name): an LLM method without arguments
                token, name = msg[1], msg[2]
                try:
                    value = getattr(llm, name)()
                except BaseException as err:  # noqa: BLE001
                    send(("reply", token, None, _portable(err)))
                    continue
                send(("reply", token, value, None))
            elif msg[0] == "shutdown":
                break
    except (EOFError, OSError):
        pass  # the server is gone
    core.shutdown()  # open requests end with finish_reason "abort" ...
    forwarder.stopping = True
    forwarder.flush()  # ... which the server gets before the pipe closes
    try:
        send(("closed",))
    except OSError:
        pass
