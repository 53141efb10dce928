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
import itertools
import queue
import threading
import time
import weakref
from collections import deque

from chunklocal._threads import name_os_thread
from chunklocal.engine.overlap import overlappable, provisional, resolve
from chunklocal.engine.requests import build_request
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.sequence import Status
from chunklocal.engine.stream import Request, RequestStream, Wakeups

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
        self.seq_ids = itertools.count()  # Sequence ids (engine/requests.py)
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
        """A checked request, not yet queued (``submit`` queues it); engine/requests.py."""
        return build_request(self, prompt_token_ids, params, request_id, prompt, detokenize,
                             capture=capture, apply_defaults=apply_defaults,
                             cache_salt=cache_salt)

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
    def loop_tokenizer(self):
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
            # The device the runner steps on: LLM names one GPU with its index; under
            # tensor parallelism the ranks own the GPUs and this process stays on the CPU.
            device = self.llm.device if self.llm.tensor_parallel_size == 1 else None
            self._thread = threading.Thread(
                target=_run_loop, args=(weakref.ref(self), self._commands, device),
                name="chunklocal-engine-core", daemon=True)
            # If the LLM (and so this core) is dropped, the idle thread wakes up and ends.
            weakref.finalize(self, self._commands.put, ("shutdown",))
            self._thread.start()

    def _iterate(self, first) -> bool:
        """One loop iteration: take the queued commands (``first`` already taken), then
        run one step.  True when the loop must end (shutdown)."""
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
                    self._fail_all(err)
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
            self._in_flight = self._step_async(self._in_flight)
        elif self.scheduler.has_work():
            self._run_step()
        return False

    @property
    def _idle(self) -> bool:
        return not self.scheduler.has_work() and self._in_flight is None

    def _add(self, req: Request) -> None:
        self._requests[req.request_id] = req
        for seq in req.seqs:
            if seq.capture is not None:
                self.llm.runner.capturing += 1
            self.num_penalised += _penalised(seq.params)
            self.scheduler.add(seq)
        self.prompt_tokens_total += len(req.prompt_token_ids)
        with self._lock:
            self._pending -= len(req.samples)

    def _abort(self, rid: str) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        with req.stream.lock:
            for sample, seq in zip(req.samples, req.seqs, strict=True):
                if sample.finish_reason is None:
                    self.scheduler.abort(seq)
                    sample.finish("abort")
            self._finish(req)

    def _finish(self, req: Request, error: BaseException | None = None, wakeups=None):
        """The request is done (call with its stream's condition held): publish, forget."""
        req.finished_time = time.monotonic()
        req.error = error
        for seq in req.seqs:
            if seq.capture is not None:
                self.llm.runner.capturing -= 1
            self.num_penalised -= _penalised(seq.params)
        self._requests.pop(req.request_id, None)
        with self._lock:
            self._live.pop(req.request_id, None)
        req.stream.publish(wakeups)

    # -- the loop thread's step ------------------------------------------------------------------
    def _run_step(self) -> None:
        """One step.  Any exception fails every request in the engine (module docstring)."""
        llm, sched = self.llm, self.scheduler
        try:
            batch = self._schedule()
            out = llm.runner.run(batch)
            self._count_step(batch)
            sched.postprocess(batch, out.tokens, llm.eos_ids)
            self._publish(batch, out)
        except BaseException as err:  # noqa: B036 - handed to the requests' streams
            self._fail_all(err)

    def _launch_step(self, prev=None):
        """Schedule and queue one step (async_scheduling); None when nothing could be
        scheduled while ``prev`` is still in flight (its results may free pages)."""
        batch = self._schedule(prev)
        if batch is None:
            return None
        launched = self.llm.runner.launch(batch, prev)
        launched.step = self._count_step(batch)
        return launched

    def _schedule(self, prev=None):
        sched = self.scheduler
        batch = sched.schedule()
        if batch.seqs:
            return batch
        if prev is not None:
            return None
        # Every request waits for pages that no running request will free.
        raise RuntimeError(f"no request could be scheduled ({len(sched.waiting)} waiting, "
                           f"{len(sched.running)} running): the KV pool cannot hold them")

    def _count_step(self, batch) -> int:
        """Check the step's virtual batches against the bound the buffers were sized for,
        log the step; its number."""
        llm = self.llm
        virtual = llm.runner.step_virtual_batches
        if virtual > llm.max_virtual_batches:
            raise RuntimeError(f"{virtual} virtual batches in one step exceed the bound "
                               f"{llm.max_virtual_batches}")
        self.num_steps += 1
        self.step_log.append((virtual, int(sum(batch.num_new)),
                              tuple(g.num_used for g in llm.groups)))
        return self.num_steps

    def _step_async(self, pending):
        """One loop iteration with async_scheduling (engine/overlap.py); the step left in
        flight (or None).  Any exception fails every request in the engine."""
        llm, sched = self.llm, self.scheduler
        try:
            if pending is None:
                return self._launch_step() if sched.has_work() else None
            if not overlappable(self, pending):
                out = llm.runner.collect(pending)
                sched.postprocess(pending.batch, out.tokens, llm.eos_ids)
                self._publish(pending.batch, out, pending.step)
                return None
            provisional(sched, pending)
            launched = self._launch_step(pending) if sched.has_work() else None
            out = llm.runner.collect(pending)
            resolve(sched, pending, out, llm.eos_ids)
            self._publish(pending.batch, out, pending.step)
            return launched
        except BaseException as err:  # noqa: B036 - handed to the requests' streams
            self._fail_all(err)
            return None

    def _fail_all(self, err: BaseException) -> None:
        """Free every page and fail every request still in the engine with ``err``."""
        self.scheduler.abort_all()
        for req in list(self._requests.values()):
            with req.stream.lock:
                for sample in req.samples:
                    sample.finish("abort")
                self._finish(req, error=err)

    def _publish(self, batch, out, step=None) -> None:
        """Per request that advanced: take its tokens, then finish or publish it, under its
        stream's lock once (a request of n > 1 samples publishes after all of them); the
        asyncio readers are woken once per event loop when all are published."""
        multi = {}
        now, step = time.monotonic(), self.num_steps if step is None else step
        wake = Wakeups()
        try:
            for i, seq in enumerate(batch.seqs):
                req = seq.request
                sample = req.samples[seq.index]
                if req.first_step is None:
                    req.first_step = step
                req.last_step = step
                if len(out.tokens[i]) == 0 or sample.finish_reason is not None:
                    continue  # a prefill piece short of the prompt's end, or finished
                with req.stream.lock:
                    self._advance(sample, seq, out, i, now)
                    if len(req.samples) > 1:
                        multi[req.request_id] = req
                    elif sample.finish_reason is not None:
                        self._finish(req, wakeups=wake)
                    else:
                        req.stream.publish(wake)
            for req in multi.values():
                with req.stream.lock:
                    if req.finished:
                        self._finish(req, wakeups=wake)
                    else:
                        req.stream.publish(wake)
        finally:  # a reader published to is woken even if a later request raised
            wake.send()

    def _advance(self, sample, seq, out, i: int, now: float) -> None:
        """Move the step's new tokens of ``seq`` into its sample: text, stop strings,
        logprobs."""
        req, params = seq.request, sample.params
        new = seq.token_ids[seq.num_prompt_tokens + len(sample.token_ids):]
        if new and req.first_token_time is None:
            req.first_token_time = now
        row0, result = int(out.row_bounds[i]), out.sample
        for j, token in enumerate(new):
            # A final EOS or stop token id adds no text (vLLM), unless asked to.
            terminal = j == len(new) - 1 and seq.finish_reason == "stop"
            hit = None
            if sample.detok is not None and (not terminal or params.include_stop_str_in_output):
                hit = sample.detok.add(token)
            sample.token_ids.append(token)
            self.generation_tokens_total += 1
            if sample.logprobs is not None:
                row = row0 + j
                entry = {}
                if params.logprobs:
                    entry = dict(zip(result.topk_ids[row, :params.logprobs].tolist(),
                                     result.topk_logprobs[row, :params.logprobs].tolist(),
                                     strict=True))
                logprob = float(result.token_logprobs[row])
                entry[token] = logprob
                sample.logprobs.append(entry)
                sample.cumulative_logprob += logprob
            if hit is not None:  # a stop string: later tokens of this step are dropped
                if seq.status is not Status.FINISHED:
                    self.scheduler.abort(seq)  # frees its pages now
                seq.finish_reason, seq.stop_reason = "stop", hit
                sample.finish("stop", hit)
                return
        if seq.status is Status.FINISHED:
            sample.finish(seq.finish_reason, seq.stop_reason)

    def _die(self, commands, err: BaseException, first) -> None:
        """The loop thread raised: refuse new requests, fail every request it holds or has
        queued (``first``: the command it had taken)."""
        with self._lock:
            self.closed, self.died = True, err  # submit() refuses from now on
        try:
            self._fail_all(err)
        finally:
            # submitted, never admitted by the loop
            queued = [first[1]] if first is not None and first[0] == "add" else []
            while True:
                try:
                    kind, *args = commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    queued.append(args[0])
            for req in queued:
                if req.request_id in self._requests:
                    continue  # admitted before the loop died: _fail_all finished it
                with req.stream.lock:
                    for sample in req.samples:
                        sample.finish("abort")
                    req.error = err
                    with self._lock:
                        self._live.pop(req.request_id, None)
                    req.stream.publish()


def _run_loop(core_ref, commands, device) -> None:
    """The loop thread.  It holds the core only while working, never while it blocks for
    the next command, so a dropped LLM is freed (its finalizer wakes the thread).  If it
    dies, every request it holds or has queued fails with the cause and the core refuses
    new ones: a dead loop must never leave a client waiting."""
    name_os_thread()
    first = None  # the command taken while idle, until the loop has handled it
    try:
        if device is not None and device.type == "cuda":  # the current device is per thread
            import torch

            torch.cuda.set_device(device)
        while True:
            core = core_ref()
            if core is None:
                return
            idle = core._idle
            del core
            first = commands.get() if idle else None
            core = core_ref()
            if core is None or core._iterate(first):
                return
            del core
            first = None
    except BaseException as err:  # noqa: B036 - handed to every waiting client
        core = core_ref()
        if core is not None:
            core._die(commands, err, first)
        raise



def _penalised(params) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


@atexit.register
def _shutdown_all():  # a daemon loop thread must not die mid-step at interpreter exit
    for core in list(_LIVE_CORES):
        core.shutdown()
