"""Requests in flight: submit to the engine core, collect or stream, abort on disconnect.

The waiting queue's limit counts sequences (prompts x n), not requests.  A request with
several prompts is all-or-nothing: every SamplingParams is built (and so
checked) before the first prompt reaches the engine, and a full queue or a refused prompt
aborts the prompts already added before answering 503 / 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from chunklocal.server.protocol import APIError

log = logging.getLogger("chunklocal.server")


def sampling_params_class():
    from chunklocal.engine.sampling import SamplingParams

    return SamplingParams


def _queue_full_class():
    try:
        from chunklocal.engine.core import QueueFullError
    except ImportError:  # pragma: no cover - engine without a waiting-queue limit
        return ()
    return QueueFullError


def check_room(core, kwargs_per_prompt) -> None:
    """The waiting queue counts sequences (prompts x n), as the engine core's does: refuse a
    request whose sequences do not fit beside those waiting (503), or never fit (400)."""
    limit = getattr(core, "max_waiting_requests", None)
    if limit is None:
        return
    new = sum(k.get("n", 1) for k in kwargs_per_prompt)
    prompts, n = len(kwargs_per_prompt), kwargs_per_prompt[0].get("n", 1)
    if new > limit:
        raise APIError(f"{prompts} prompt(s) x n = {n} make {new} sequences, more than the "
                       f"{limit} the server lets wait (--max-waiting-requests)",
                       param="n" if n > 1 else "prompt", code="too_many_sequences")
    waiting = int(core.stats().get("num_waiting", 0))
    if waiting + new > limit:
        raise APIError(f"the server is busy: {waiting} sequences wait and this request adds "
                       f"{new}, the limit (--max-waiting-requests) is {limit}", status=503,
                       code="queue_full", type="service_unavailable")


def submit(core, prompts, kwargs_per_prompt, request_id: str):
    """RequestStreams, one per (text, ids) prompt, or APIError with nothing left queued."""
    items = _checked(core, prompts, kwargs_per_prompt)
    streams: list = []
    with _refusals(core, streams):
        if len(items) > 1 and hasattr(core, "make_request"):
            # All prompts checked, then queued together (or none: a full queue refuses all).
            reqs = [core.make_request(ids, p, f"{request_id}-{i}", text)
                    for i, ((text, ids), p) in items]
            return core.submit(reqs, check_queue=True)
        for i, ((text, ids), p) in items:
            streams.append(core.add_request(ids, p, request_id=f"{request_id}-{i}", prompt=text))
    return streams


async def submit_async(core, prompts, kwargs_per_prompt, request_id: str):
    """``submit``; an engine in another process (engine/core_process.py) is awaited, so
    the event loop streams on while it checks and queues the prompts."""
    if not hasattr(core, "submit_async"):
        return submit(core, prompts, kwargs_per_prompt, request_id)
    items = _checked(core, prompts, kwargs_per_prompt)
    with _refusals(core, []):
        specs = [core.make_request(ids, p, f"{request_id}-{i}", text)
                 for i, ((text, ids), p) in items]
        return await core.submit_async(specs, check_queue=True)


def _checked(core, prompts, kwargs_per_prompt):
    """(index, ((text, ids), SamplingParams)) per prompt, every one built (so checked) before
    any reaches the engine; APIError naming the field otherwise."""
    check_room(core, kwargs_per_prompt)
    cls = sampling_params_class()
    params = []
    for i, kwargs in enumerate(kwargs_per_prompt):
        try:
            params.append(cls(**kwargs))
        except (ValueError, TypeError) as err:
            where = f"prompt {i}: " if len(kwargs_per_prompt) > 1 else ""
            raise APIError(f"{where}{err}", param=_param_named_in(str(err), kwargs)) from err
    return list(enumerate(zip(prompts, params, strict=True)))


@contextlib.contextmanager
def _refusals(core, streams):
    """The engine's refusals as APIErrors, after aborting ``streams`` already queued."""
    try:
        yield
    except BaseException as err:
        for s in streams:
            s.abort()
        if isinstance(err, _queue_full_class() or ()):
            raise APIError(f"the server is busy: {err}", status=503,
                           code="queue_full", type="service_unavailable") from err
        if isinstance(err, ValueError):
            raise APIError(str(err), param=_field_in(str(err))) from err
        if isinstance(err, RuntimeError) and getattr(core, "closed", False):
            raise APIError("the server is shutting down", status=503,
                           code="shutting_down") from err
        raise


def _field_in(message: str) -> str:
    """The request field an engine refusal is about ("request X: logprobs 25 exceeds ...")."""
    for name in ("stop_token_ids", "logprobs", "stop", "max_tokens", "seed"):
        if name in message:
            return name
    return "prompt"


def _param_named_in(message: str, kwargs: dict) -> str | None:
    # SamplingParams names the field first ("SamplingParams.top_p must be ..., got 2.0").
    head = message.split(" ", 1)[0].strip(":'\"").removeprefix("SamplingParams.")
    return head if head in kwargs or head in ("max_tokens", "logprobs") else None


async def wait_disconnect(request) -> None:
    """Returns when the client has gone (the body was read already, so only
    http.disconnect can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _last(aiter):
    last = None
    async for out in aiter:
        last = out
    return last


async def collect(request, streams, observe):
    """Final RequestOutput per stream; aborts all of them if the client disconnects."""
    finals = asyncio.gather(*(_last(observe(s.aiter())) for s in streams))
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait([finals, gone], return_when=asyncio.FIRST_COMPLETED)
        if not finals.done():
            raise asyncio.CancelledError("client disconnected")
        return finals.result()
    finally:
        gone.cancel()
        if not finals.done():
            finals.cancel()
            for s in streams:
                s.abort()
            with contextlib.suppress(BaseException):
                await finals


async def merged(streams, observe):
    """(prompt index, snapshot) from several streams as they arrive."""
    if len(streams) == 1:
        async for out in observe(streams[0].aiter()):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, s):
        try:
            async for out in observe(s.aiter()):
                await queue.put((i, out))
            await queue.put((i, done))
        except Exception as err:  # noqa: BLE001 - a failed step: re-raised by the reader
            await queue.put((i, err))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out = await queue.get()
            if out is done:
                remaining -= 1
            elif isinstance(out, Exception):
                raise out
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def sse(streams, state, observe, opening=()):
    """Server-sent events of a stream; a disconnect (cancellation) aborts every prompt."""
    finished = False
    try:
        for chunk in opening:
            yield chunk
        async for i, out in merged(streams, observe):
            for chunk in state.update(i, out):
                yield chunk
        for chunk in state.final_chunks():
            yield chunk
        finished = True
    except Exception as err:  # the engine failed mid-stream: say so in the stream
        log.exception("a streamed request failed in the engine")
        body = APIError(f"generation failed: {type(err).__name__}: {err}", status=500).body()
        yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
    finally:
        if not finished:
            for s in streams:
                s.abort()
