"""``EngineCore``: one loop thread that owns the scheduler, the KV blocks and the runner.

Clients (``LLM.generate`` in any thread, the HTTP server) call ``add_request`` at any
time and read a ``RequestStream``.  The loop takes new requests and aborts between
steps, runs one step (continuous batching: arrivals join the running batch at the next
step), then turns the new tokens into text, checks stop strings and publishes a
snapshot per request that advanced.  Nothing else touches the scheduler, the block
manager or the runner while the core runs, so no lock guards them.

Failure: a step that raises fails *every* request in the engine with that error (the
KV cache may be half written, and this keeps the old ``generate()`` guarantee): their
pages are freed and their streams raise the error; the loop goes on serving new
requests.  Abort: pages are freed before the next step starts (``wait=True`` blocks
until then); the stream ends with finish_reason "abort".

With ``LLM(async_scheduling=True)`` the loop launches step n+1 before step n's tokens
reach the host (engine/overlap.py, same outputs); otherwise it is synchronous.
"""

from __future__ import annotations

import atexit
import copy
import functools
import itertools
import queue
import threading
import time
import uuid
import weakref
from collections import deque

from chunklocal.engine.prefix_cache import salt_key
from chunklocal.engine.requests import check_prompt_ids
from chunklocal.engine.sampler import sampling_row
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.sequence import Sequence
from chunklocal.engine.stream import Request, RequestStream, Sample

_LIVE_CORES: weakref.WeakSet = weakref.WeakSet()


class QueueFullError(RuntimeError):
    """More than ``max_waiting_requests`` sequences (prompts x n) would wait for admission
    (HTTP 503)."""


class EngineCore:
    """See the module docstring.  ``EngineCore(llm)`` becomes ``llm.core``."""

    def __init__(self, llm, max_waiting_requests: int | None = None):
        existing = getattr(llm, "_core", None)
        if existing is not None and not existing.closed:
            raise ValueError("this LLM already has a running EngineCore: use llm.core")
        # Weak: the LLM owns its core; a loop thread must not keep a dropped LLM (its
        # weights, KV cache and tensor-parallel workers) alive.  The thread holds the core
        # only while it works (see LLM.shutdown).
        self._llm = weakref.ref(llm)
        self.scheduler = llm.scheduler
        if max_waiting_requests is None:
            max_waiting_requests = getattr(llm, "max_waiting_requests", None)
        self.max_waiting_requests = max_waiting_requests
        self.max_logprobs = 20  # vLLM's default --max-logprobs
        self.max_model_len = llm.max_model_len
        self.model_name = str(llm.model_dir)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the fields below (client threads)
        self._live: dict[str, Request] = {}
        self._pending = 0  # added, not yet handed to the scheduler
        self._seq_ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.closed = False
        self.died: BaseException | None = None  # what ended the loop thread, if it died
        # Loop-thread state.
        self._requests: dict[str, Request] = {}
        self._detok_tokenizer = None
        self.num_steps = 0
        self.num_penalised = 0  # live samples with penalties (no overlap while > 0)
        self._in_flight = None  # async_scheduling: a step launched and not yet collected
        #: (virtual batches, query tokens, blocks used per group) of the latest steps.
        self.step_log: deque = deque(maxlen=1 << 16)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        llm._core = self
        _LIVE_CORES.add(self)

    @property
    def llm(self):
        llm = self._llm()
        if llm is None:
            raise RuntimeError("the LLM of this engine core was garbage-collected")
        return llm

    # -- client API (any thread) ---------------------------------------------------------------
    @property
    def tokenizer(self):
        """The checkpoint's HF tokenizer, or None when the directory has none."""
        try:
            return self.llm.tokenizer
        except ValueError:
            return None

    def add_request(self, prompt_token_ids, params: SamplingParams, request_id=None,
                    prompt: str | None = None, *, detokenize: bool = True,
                    cache_salt: str | None = None) -> RequestStream:
        """Queue a request; its stream.  ValueError names the request and the bad value
        (nothing changes); QueueFullError when ``max_waiting_requests`` wait already."""
        req = self.make_request(prompt_token_ids, params, request_id, prompt, detokenize,
                                cache_salt=cache_salt)
        return self.submit([req], check_queue=True)[0]

    def make_request(self, prompt_token_ids, params, request_id=None, prompt=None,
                     detokenize: bool = True, *, capture: str | None = None,
                     apply_defaults: bool = True, cache_salt: str | None = None) -> Request:
        """A checked request, not yet queued (``submit`` queues it); ``cache_salt``: only
        requests of the same salt share prefix-cache KV."""
        rid = f"req-{uuid.uuid4().hex}" if request_id is None else str(request_id)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {rid}: params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        asked = "max_tokens" in params.fields_set and params.max_tokens is not None
        if apply_defaults:
            params = params.with_defaults(self.llm.default_sampling)
        ids = self._check_prompt(rid, prompt_token_ids)
        room = self.max_model_len - len(ids)
        if capture is None:
            # A max_tokens the caller did not ask for (None, SamplingParams' 16 or the
            # generation config's) is capped by the room left; one asked for must fit.
            if not asked and (params.max_tokens is None or params.max_tokens > room):
                if room < 1:
                    raise ValueError(f"request {rid}: prompt of {len(ids)} tokens leaves no "
                                     f"room in max_model_len {self.max_model_len}")
                params = params.replace(max_tokens=room)
            elif params.max_tokens > room:
                raise ValueError(f"request {rid}: prompt of {len(ids)} tokens + max_tokens "
                                 f"{params.max_tokens} exceed max_model_len "
                                 f"{self.max_model_len}")
        vocab = self.llm.config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"request {rid}: stop_token_ids holds {bad[0]}, outside the "
                             f"vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"request {rid}: logprobs {params.logprobs} exceeds the "
                             f"maximum {self.max_logprobs}")
        tokenizer = self._loop_tokenizer() if detokenize or params.stop else None
        if params.stop and tokenizer is None:
            raise ValueError(f"request {rid}: stop strings {list(params.stop)} need a "
                             "tokenizer; the checkpoint has none")
        req = Request(rid, ids, params, prompt, time.monotonic())
        req.stream.bind_abort(functools.partial(_abort_weakly, weakref.ref(self), rid))
        groups = len(self.llm.groups)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"request {rid}: cache_salt must be a str, got {cache_salt!r}")
        hashes: list[int] = []  # the samples share the prompt's block hashes
        key = salt_key(cache_salt)
        for i in range(params.n):
            child = params if params.seed is None or params.n == 1 else params.replace(
                seed=params.seed + i, n=1)
            seq = Sequence(next(self._seq_ids), ids, child, groups)
            seq.block_hashes, seq.cache_key = hashes, key
            sample = Sample(req, i, child, tokenizer, seq)
            seq.sampling_row, seq.capture, seq.sample = sampling_row(child), capture, sample
            req.samples.append(sample)
        return req

    def submit(self, requests: list[Request], check_queue: bool = False):
        """Queue checked requests (all or none); their streams."""
        with self._lock:
            if self.closed:
                raise RuntimeError("the engine core is shut down" if self.died is None else
                                   f"the engine loop died: {self.died!r}")
            for req in requests:
                if req.request_id in self._live:
                    raise ValueError(f"request {req.request_id}: request_id already in use")
            if len({r.request_id for r in requests}) < len(requests):
                raise ValueError("request ids repeat within one submission")
            new = sum(len(r.samples) for r in requests)
            if check_queue and self.max_waiting_requests is not None:
                # Sequences (prompts x n), not requests: one request of 64 prompts x n = 16
                # is 1,024 sequences waiting.
                waiting = self._pending + len(self.scheduler.waiting)
                if waiting + new > self.max_waiting_requests:
                    raise QueueFullError(f"{waiting} sequences are waiting and this request "
                                         f"adds {new}; the limit (max_waiting_requests) is "
                                         f"{self.max_waiting_requests} sequences")
            for req in requests:
                self._live[req.request_id] = req
                self._commands.put(("add", req))
            self._pending += new
            self._start()
        return [r.stream for r in requests]

    def abort(self, request_id: str, wait: bool = False) -> None:
        """End the request (finish_reason "abort") and free its pages before the next
        step; ``wait=True`` blocks until that is done.  Unknown or finished ids: no-op."""
        done = threading.Event() if wait else None
        with self._lock:  # queued under the lock: never behind a shutdown
            if self._thread is None or self.closed:
                return
            self._commands.put(("abort", str(request_id), done))
        if done is not None:
            done.wait()

    def shutdown(self) -> None:
        """Abort every request (finish_reason "abort") and stop the loop thread."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            thread = self._thread
            if thread is not None:
                self._commands.put(("shutdown",))
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def stats(self) -> dict:
        groups = self.llm.groups
        with self._lock:
            waiting = self._pending + len(self.scheduler.waiting)
        return dict(num_running=len(self.scheduler.running), num_waiting=waiting,
                    kv_usage=max(g.num_used / g.num_blocks for g in groups),
                    peak_virtual_batches=self.llm.runner.peak_virtual_batches,
                    prompt_tokens_total=self.prompt_tokens_total,
                    generation_tokens_total=self.generation_tokens_total,
                    num_preemptions_total=self.scheduler.num_preemptions,
                    prefix_cache_queries_total=self.scheduler.block_manager.prefix_cache_queries,
                    prefix_cache_hits_total=self.scheduler.block_manager.prefix_cache_hits)

    # -- internals -------------------------------------------------------------------------------
    def _check_prompt(self, rid, prompt_token_ids) -> list[int]:
        return check_prompt_ids(rid, prompt_token_ids, self.llm.config.vocab_size,
                                self.max_model_len)

    def _loop_tokenizer(self):
        """A tokenizer of the loop's own (HF fast tokenizers are not safe to share
        across threads while a client encodes)."""
        if self._detok_tokenizer is None:
            shared = self.tokenizer
            if shared is None:
                return None
            try:
                self._detok_tokenizer = copy.deepcopy(shared)
            except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared
                self._detok_tokenizer = shared
        return self._detok_tokenizer

    def _start(self):
        if self._thread is None:
            from chunklocal.engine.core_step import run_loop

            # The device the runner steps on: LLM names one GPU with its index; under
            # tensor parallelism the ranks own the GPUs and this process stays on the CPU.
            device = self.llm.device if self.llm.tensor_parallel_size == 1 else None
            self._thread = threading.Thread(
                target=run_loop, args=(weakref.ref(self), self._commands, device),
                name="chunklocal-engine-core", daemon=True)
            # If the LLM (and so this core) is dropped, the idle thread wakes up and ends.
            weakref.finalize(self, self._commands.put, ("shutdown",))
            self._thread.start()

    def _iterate(self, first) -> bool:
        """One loop iteration: take the queued commands (``first`` already taken), then
        run one step.  True when the loop must end (shutdown)."""
        from chunklocal.engine.core_step import fail_all, run_step, step_async

        commands = [] if first is None else [first]
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        stop = False
        for kind, *args in commands:
            if kind == "add":
                try:
                    self._add(args[0])
                except BaseException as err:  # noqa: B036 - a dead loop would hang clients
                    fail_all(self, err)
            elif kind == "abort":
                self._abort(args[0])
                if args[1] is not None:
                    args[1].set()
            else:  # shutdown: the last command (nothing is queued after it)
                stop = True
        if stop:
            for rid in list(self._requests):
                self._abort(rid)
            return True
        if self.llm.async_scheduling:
            self._in_flight = step_async(self, self._in_flight)
        elif self.scheduler.has_work():
            run_step(self)
        return False

    @property
    def _idle(self) -> bool:
        return not self.scheduler.has_work() and self._in_flight is None

    def _add(self, req: Request) -> None:
        self._requests[req.request_id] = req
        for sample in req.samples:
            if sample.seq.capture is not None:
                self.llm.runner.capturing += 1
            self.num_penalised += _penalised(sample.params)
            self.scheduler.add(sample.seq)
        self.prompt_tokens_total += len(req.prompt_token_ids)
        with self._lock:
            self._pending -= len(req.samples)

    def _abort(self, rid: str) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        with req.stream.lock:
            for sample in req.samples:
                if sample.finish_reason is None:
                    self.scheduler.abort(sample.seq)
                    sample.finish("abort")
            self._finish(req)

    def _finish(self, req: Request, error: BaseException | None = None, wakeups=None):
        """The request is done (call with its stream's condition held): publish, forget."""
        req.finished_time = time.monotonic()
        req.error = error
        for sample in req.samples:
            if sample.seq.capture is not None:
                self.llm.runner.capturing -= 1
            self.num_penalised -= _penalised(sample.params)
        self._requests.pop(req.request_id, None)
        with self._lock:
            self._live.pop(req.request_id, None)
        req.stream.publish(wakeups)


def _abort_weakly(core_ref, request_id, wait=False) -> None:
    core = core_ref()  # a stream kept by a client must not keep the core alive
    if core is not None:
        core.abort(request_id, wait)


def _penalised(params) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


@atexit.register
def _shutdown_all():  # a daemon loop thread must not die mid-step at interpreter exit
    for core in list(_LIVE_CORES):
        core.shutdown()
