"""The engine core's loop thread: each iteration schedules, runs, then publishes what
changed (synchronously, or with the next step launched first: engine/overlap.py).

Kept apart from core.py (the client API and the loop's commands) so each stays short.
Runs on the loop thread only.
"""

from __future__ import annotations

import queue
import time

from chunklocal.engine.overlap import overlappable, provisional, resolve
from chunklocal.engine.sequence import Status
from chunklocal.engine.stream import Wakeups


def run_loop(core_ref, commands, device) -> None:
    """The loop thread.  It holds the core only while working, never while it blocks for
    the next command, so a dropped LLM is freed (its finalizer wakes the thread).  If it
    dies, every request it holds or has queued fails with the cause and the core refuses
    new ones: a dead loop must never leave a client waiting."""
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
            _die(core, commands, err, first)
        raise


def _die(core, commands, err: BaseException, first) -> None:
    with core._lock:
        core.closed, core.died = True, err  # submit() refuses from now on
    try:
        fail_all(core, err)
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
            if req.request_id in core._requests:
                continue  # admitted before the loop died: fail_all finished it
            with req.stream.lock:
                for sample in req.samples:
                    sample.finish("abort")
                req.error = err
                with core._lock:
                    core._live.pop(req.request_id, None)
                req.stream.publish()


def run_step(core) -> None:
    """One step.  Any exception fails every request in the engine (see core.py)."""
    llm, sched = core.llm, core.scheduler
    try:
        batch = sched.schedule()
        if not batch.seqs:
            # Every request waits for pages that no running request will free.
            raise RuntimeError(f"no request could be scheduled ({len(sched.waiting)} waiting, "
                               f"{len(sched.running)} running): the KV pool cannot hold them")
        out = llm.runner.run(batch)
        virtual = llm.runner.step_virtual_batches
        if virtual > llm.max_virtual_batches:
            raise RuntimeError(f"{virtual} virtual batches in one step exceed the bound "
                               f"{llm.max_virtual_batches}")
        core.num_steps += 1
        core.step_log.append((virtual, int(sum(batch.num_new)),
                              tuple(g.num_used for g in llm.groups)))
        sched.postprocess(batch, out.tokens, llm.eos_ids)
        _publish(core, batch, out)
    except BaseException as err:  # noqa: B036 - handed to the requests' streams
        fail_all(core, err)


def launch_step(core, prev=None):
    """Schedule and queue one step (async_scheduling); None when nothing could be
    scheduled while ``prev`` is still in flight (its results may free pages)."""
    llm, sched = core.llm, core.scheduler
    batch = sched.schedule()
    if not batch.seqs:
        if prev is not None:
            return None
        raise RuntimeError(f"no request could be scheduled ({len(sched.waiting)} waiting, "
                           f"{len(sched.running)} running): the KV pool cannot hold them")
    launched = llm.runner.launch(batch, prev)
    virtual = llm.runner.step_virtual_batches
    if virtual > llm.max_virtual_batches:
        raise RuntimeError(f"{virtual} virtual batches in one step exceed the bound "
                           f"{llm.max_virtual_batches}")
    core.num_steps += 1
    launched.step = core.num_steps
    core.step_log.append((virtual, int(sum(batch.num_new)),
                          tuple(g.num_used for g in llm.groups)))
    return launched


def step_async(core, pending):
    """One loop iteration with async_scheduling (engine/overlap.py); the step left in
    flight (or None).  Any exception fails every request in the engine."""
    llm, sched = core.llm, core.scheduler
    try:
        if pending is None:
            return launch_step(core) if sched.has_work() else None
        if not overlappable(core, pending):
            out = llm.runner.collect(pending)
            sched.postprocess(pending.batch, out.tokens, llm.eos_ids)
            _publish(core, pending.batch, out, pending.step)
            return None
        provisional(sched, pending)
        launched = launch_step(core, pending) if sched.has_work() else None
        out = llm.runner.collect(pending)
        resolve(sched, pending, out, llm.eos_ids)
        _publish(core, pending.batch, out, pending.step)
        return launched
    except BaseException as err:  # noqa: B036 - handed to the requests' streams
        fail_all(core, err)
        return None


def fail_all(core, err: BaseException) -> None:
    """Free every page and fail every request still in the engine with ``err``."""
    core.scheduler.abort_all()
    for req in list(core._requests.values()):
        with req.stream.lock:
            for sample in req.samples:
                sample.finish("abort")
            core._finish(req, error=err)


def _publish(core, batch, out, step=None) -> None:
    """Per request that advanced: take its tokens, then finish or publish it, under its
    stream's lock once (a request of n > 1 samples publishes after all of them); the
    asyncio readers are woken once per event loop when all are published."""
    multi = {}
    now, step = time.monotonic(), core.num_steps if step is None else step
    wake = Wakeups()
    try:
        for i, seq in enumerate(batch.seqs):
            req = seq.sample.request
            if req.first_step is None:
                req.first_step = step
            req.last_step = step
            if len(out.tokens[i]) == 0 or seq.sample.finish_reason is not None:
                continue  # a prefill piece short of the prompt's end, or finished meanwhile
            with req.stream.lock:
                _advance(core, seq.sample, seq, out, i, now)
                if len(req.samples) > 1:
                    multi[req.request_id] = req
                elif seq.sample.finish_reason is not None:
                    core._finish(req, wakeups=wake)
                else:
                    req.stream.publish(wake)
        for req in multi.values():
            with req.stream.lock:
                if req.finished:
                    core._finish(req, wakeups=wake)
                else:
                    req.stream.publish(wake)
    finally:  # a reader published to is woken even if a later request raised
        wake.send()


def _advance(core, sample, seq, out, i: int, now: float) -> None:
    """Move the step's new tokens of ``seq`` into its sample: text, stop strings, logprobs."""
    req, params = sample.request, sample.params
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
        core.generation_tokens_total += 1
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
                core.scheduler.abort(seq)  # frees its pages now
            seq.finish_reason, seq.stop_reason = "stop", hit
            sample.finish("stop", hit)
            return
    if seq.status is Status.FINISHED:
        sample.finish(seq.finish_reason, seq.stop_reason)
