"""Load test of ``chunklocal serve``: N concurrent streaming clients on localhost.

Each client sends /v1/completions requests one after another (token-id prompts, greedy,
``ignore_eos``, ``stream: true`` with vLLM's ``continuous_usage_stats`` so every chunk says
how many tokens it carries) until the request count (``--requests``) or the time
(``--duration``) runs out.  Lengths as vLLM's random dataset (``vllm bench serve
--random-range-ratio``, RandomDataset.get_sampling_params in vllm/benchmarks/datasets.py):
with ``--random-range-ratio`` r (default 0) each request draws its prompt length and its
own ``max_tokens`` uniformly from the integers of [floor(L * (1 - r)), ceil(L * (1 + r))]
around ``--prompt-tokens`` and ``--max-tokens`` (max_tokens at least 1; r in [0, 1)); r = 0
sends every request with exactly those two lengths.  Arrivals as ``vllm bench serve``'s
too: ``--request-rate`` R (default inf: every client sends again as soon as its request
ends) spaces the requests' arrivals by gamma gaps of shape ``--burstiness`` (1: Poisson) and
mean 1 / R, and ``--clients`` caps how many are in flight (vLLM's ``--max-concurrency``);
fixed lengths at an infinite rate keep the clients in step, in waves.  For each level of
``--clients`` it reports requests/s, output tokens/s, time to first token (TTFT: request
sent -> first chunk with a token) and inter-token latency (ITL: gap between chunks, divided
by the tokens the later chunk carries) at p50 and p99.

Nothing lost: every request must end with finish_reason "length" after exactly its own
``max_tokens`` tokens, counted chunk by chunk and in the final usage (output tokens/s counts
each completed request's own); ``--verify K``
re-sends K of the prompts without streaming and requires the same text (exact on the CPU in
float32; on a GPU a batch-dependent bf16 tie may differ, so use --verify 0 there).  Any
failure makes the exit status 1.

``--launch DIR`` starts the server itself (``chunklocal serve DIR`` plus ``--serve-args``),
waits for /health, runs the load and stops it with SIGTERM; each level then also reports
the CPU the server's process tree used, per process and its busiest threads
(benchmarks/proc_cpu.py: a thread near 1.0 core is the bottleneck).  ``--offline-floor``
then runs the same requests through ``LLM.generate`` on the same engine flags: the floor
the server's throughput is compared with.  ``--make-tiny DIR`` writes the tiny CPU
checkpoint (random Llama-4 + byte-level BPE tokenizer with a chat template);
``--make-scout DIR`` writes benchmarks/engine.py's Scout-shaped random bf16 checkpoint (4
layers, no tokenizer: texts are empty, tokens are counted) for the GPU;
``--make-scout-fp8 DIR`` full-size Scout FP8's config.json alone (benchmarks/decode_floor.py's
model: serve it with ``--load-format dummy``).  ``--routing balanced`` (or
``uniform_random``) spreads the experts' tokens as a trained router would, where dummy and
random weights send most tokens of a layer to one expert: it sets
``CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY`` (models/moe.py) for the launched server and
the offline floor.

Every row -- the warm-up, each server level, each offline row -- sends prompts of its own
(:func:`prompt_set`), so no row prefills from what an earlier row left in the prefix cache
(on by default, as in vLLM); each server level reports the prompt tokens the cache served
(``cached_prompt_tokens``, from the usage).  Until 2026-12-04 every row re-sent one set: the
first server level prefilled most of its prompts and every later row, offline included,
read them from the cache, which made the first level look slower than offline by a
prefill per request (BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import proc_cpu
from benchmarks.common import base_parser, format_table, write_json
from benchmarks.serve_client import Connection

_SERVE = "import sys; from chunklocal.cli import main; sys.exit(main())"


#: ``--routing`` -> CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY (models/moe.py).
ROUTING = {"model": "", "balanced": "balanced", "uniform_random": "uniform_random"}


def use_routing(strategy: str) -> None:
    """The routing strategy for the server this script launches (its environment) and for
    the offline floor's engine in this process (set again where routing is already loaded)."""
    os.environ["CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY"] = strategy
    routing = sys.modules.get("chunklocal.models.routing")
    if routing is not None:
        routing.ROUTING_SIMULATION = strategy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(model_dir, port: int, args=(), env=None, log=None) -> subprocess.Popen:
    """``chunklocal serve model_dir --port port *args`` as a child process."""
    cmd = [sys.executable, "-c", _SERVE, "serve", str(model_dir), "--port", str(port), *args]
    return subprocess.Popen(cmd, env=env, stdout=log or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if log else subprocess.DEVNULL)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before /health")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}/health not 200 after {timeout} s")


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout)


def make_tiny(path: Path, vocab_size: int = 384) -> None:
    """The tests' tiny model and tokenizer (tests/llama4_tiny.py, tests/tiny_tokenizer.py)."""
    from tests.llama4_tiny import write_tiny_llama4
    from tests.tiny_tokenizer import write_tiny_tokenizer

    write_tiny_llama4(path, vocab_size=vocab_size)
    write_tiny_tokenizer(path, vocab_size=vocab_size)


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _one(conn, body: dict, progress: dict | None = None) -> dict:
    """Send one streaming request on ``conn`` (benchmarks/serve_client.py); return its
    timings, text and token counts. ``progress["tokens"]``, if given, counts every
    streamed token as it arrives (the level's running figure)."""
    rec = {"ttft": None, "gaps": [], "chunk_tokens": [], "tokens": 0, "text": "",
           "finish": None, "usage": None, "cached": None, "error": None}
    start = last = time.perf_counter()
    try:
        async for chunk in conn.stream_events("/v1/completions", body):
            if "error" in chunk:
                rec["error"] = chunk["error"]["message"]
                continue
            now = time.perf_counter()
            if not chunk["choices"]:  # the include_usage chunk
                rec["usage"] = chunk["usage"]["completion_tokens"]
                details = chunk["usage"].get("prompt_tokens_details") or {}
                rec["cached"] = details.get("cached_tokens", 0)
                continue
            choice = chunk["choices"][0]
            new = chunk["usage"]["completion_tokens"] - rec["tokens"]
            if new > 0:
                if rec["tokens"] == 0:
                    rec["ttft"] = now - start
                else:
                    rec["gaps"].append(now - last)  # one per chunk, as vLLM's benchmark
                    rec["chunk_tokens"].append(new)
                rec["tokens"] += new
                if progress is not None:
                    progress["tokens"] += new
                last = now
            rec["text"] += choice["text"]
            rec["finish"] = choice["finish_reason"] or rec["finish"]
    except Exception as err:  # noqa: BLE001 - recorded as a failed request
        rec["error"] = f"{type(err).__name__}: {err}"
    rec["e2e"] = time.perf_counter() - start
    return rec


def _problem(rec: dict, max_tokens: int) -> str | None:
    if rec["error"]:
        return rec["error"]
    if rec["finish"] != "length" or rec["tokens"] != max_tokens or rec["usage"] != max_tokens:
        return (f"incomplete: finish_reason {rec['finish']}, {rec['tokens']} streamed tokens, "
                f"usage {rec['usage']}, expected {max_tokens}")
    return None


def _problems(level: str, records, max_tokens: list[int]) -> list[str]:
    """``level, prompt i: problem`` for each record that is not a complete request
    (``max_tokens[i]``: what prompt i asked for)."""
    return [f"{level}, prompt {i}: {problem}" for i, r in records
            if (problem := _problem(r, max_tokens[i])) is not None]


async def report_progress(progress: dict, start: float, every: float, print_=print) -> None:
    """Every ``every`` seconds, one line: requests finished, tokens streamed so far and the
    output rate over the last interval, so a run cut short by a time limit still shows its
    steady-state rate."""
    last_t, last_tokens = start, 0
    while True:
        await asyncio.sleep(every)
        now, tokens = time.perf_counter(), progress["tokens"]
        print_(f"  {now - start:7.1f} s: {progress['finished']} requests finished, {tokens} "
               f"tokens streamed, {(tokens - last_tokens) / (now - last_t):,.0f} tok/s over "
               f"the last {now - last_t:.1f} s", flush=True)
        last_t, last_tokens = now, tokens


def arrival_times(count: int, rate: float, burstiness: float, seed: str) -> list[float]:
    """Seconds after a level's start before which request i is not sent, as vLLM's
    benchmark draws them (``--request-rate``, ``--burstiness``): the first at 0, then gaps
    from a gamma distribution of shape ``burstiness`` and mean ``1 / rate`` (Poisson
    arrivals at burstiness 1; below 1 burstier, above steadier); all 0 at an infinite
    rate.  ``seed``: the same times for the same seed and level."""
    if math.isinf(rate):
        return [0.0] * count
    rng, theta, at, times = random.Random(seed), 1.0 / (rate * burstiness), 0.0, []
    for i in range(count):
        if i:
            at += rng.gammavariate(burstiness, theta)
        times.append(at)
    return times


async def run_level(url, model, headers, prompts, clients, max_tokens, duration, timeout,
                    progress_every: float = 0.0, send_at: list[float] | None = None):
    """Prompt i asks for ``max_tokens[i]`` tokens. ``progress_every`` > 0: a progress line
    that often (:func:`report_progress`).  ``send_at``: request i waits for its arrival
    time (:func:`arrival_times`) and then for a free client of the ``clients`` (vLLM's
    ``--max-concurrency``); its TTFT counts from when it is sent."""
    bodies = [{"model": model, "prompt": p, "max_tokens": m, "temperature": 0.0,
               "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
              for p, m in zip(prompts, max_tokens, strict=True)]
    records: list[tuple[int, dict]] = []
    next_index = iter(range(len(bodies)))
    start = time.perf_counter()
    progress = {"tokens": 0, "finished": 0}

    async def worker():
        conn = Connection(url, headers)  # one keep-alive connection per client
        try:
            for i in next_index:
                if send_at is not None:
                    if send_at[i] > duration:  # arrives after the level's end: not sent
                        return
                    await asyncio.sleep(max(0.0, start + send_at[i] - time.perf_counter()))
                if time.perf_counter() - start > duration:
                    return
                try:
                    rec = await asyncio.wait_for(_one(conn, bodies[i], progress), timeout)
                except asyncio.TimeoutError:
                    await conn.close()
                    rec = {"error": f"no answer within {timeout} s (--timeout)"}
                records.append((i, rec))
                progress["finished"] += 1
        finally:
            await conn.close()

    reporter = (asyncio.create_task(report_progress(progress, start, progress_every))
                if progress_every > 0 else None)
    try:
        await asyncio.gather(*(worker() for _ in range(clients)))
    finally:
        if reporter is not None:
            reporter.cancel()
    return records, time.perf_counter() - start


async def verify(url, model, headers, prompts, records, max_tokens, k) -> list[str]:
    """Re-send k of the streamed prompts without streaming: the texts must match."""
    import httpx

    problems = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        for i, rec in records[:k]:
            body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens[i],
                    "temperature": 0.0, "ignore_eos": True}
            got = (await client.post("/v1/completions", json=body)).json()
            text = got["choices"][0]["text"] if "choices" in got else got
            if text != rec["text"]:
                problems.append(f"prompt {i}: streamed {rec['text'][:60]!r} != "
                                f"non-streamed {str(text)[:60]!r}")
    return problems


def summarize(clients, records, wall, max_tokens) -> dict:
    """A level's row; output tokens are each completed request's own ``max_tokens[i]``."""
    done_at = [(i, r) for i, r in records if _problem(r, max_tokens[i]) is None]
    done = [r for _, r in done_at]
    ttft = [r["ttft"] for r in done]
    gaps = [g for r in done for g in r["gaps"]]
    sizes = [n for r in done for n in r["chunk_tokens"]]
    # ITL: each chunk's gap divided by the tokens it carries, once per token
    itl = [g / n for g, n in zip(gaps, sizes, strict=True) for _ in range(n)]
    itl_p50 = percentile(itl, 50)
    return {"clients": clients, "requests": len(records), "completed": len(done),
            "failed": len(records) - len(done), "wall_s": wall,
            "requests_per_s": len(done) / wall,
            "output_tokens_per_s": sum(max_tokens[i] for i, _ in done_at) / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * itl_p50, "itl_p90_ms": 1e3 * percentile(itl, 90),
            "itl_p99_ms": 1e3 * percentile(itl, 99),
            "itl_max_ms": 1e3 * max(itl, default=float("nan")),
            # issue 24's ITL target is p99 <= 2 x p50: the share of gaps past 2 x p50
            "itl_over_2x_p50": sum(g > 2 * itl_p50 for g in itl) / max(len(itl), 1),
            # vLLM's benchmark keeps one gap per chunk, not split; chunks of several tokens
            # mean steps' outputs arrive together.
            "chunk_gap_p50_ms": 1e3 * percentile(gaps, 50),
            "chunk_gap_p99_ms": 1e3 * percentile(gaps, 99),
            "multi_token_chunks": sum(n > 1 for n in sizes) / max(len(sizes), 1),
            "e2e_p50_s": percentile([r["e2e"] for r in done], 50),
            "cached_prompt_tokens": sum(r.get("cached") or 0 for r in done)}


def length_range(mean: int, ratio: float) -> tuple[int, int]:
    """vLLM's interval for ``--random-range-ratio`` (RandomDataset.get_sampling_params,
    vllm/benchmarks/datasets.py): [floor(mean * (1 - ratio)), ceil(mean * (1 + ratio))],
    both ends drawn; ``ratio`` 0 gives ``mean`` alone."""
    return math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))


def request_lengths(args, tag: str, count: int) -> tuple[list[int], list[int]]:
    """Each request's prompt length and ``max_tokens`` for the row named ``tag``, drawn
    uniformly from :func:`length_range` of ``--prompt-tokens`` and ``--max-tokens`` (the
    latter at least 1, as vLLM's) with ``--random-range-ratio``; the same for the same seed
    and tag (a generator of their own: the prompts' ids are drawn as before)."""
    ratio = args.random_range_ratio
    rng = random.Random(f"{args.seed}/{tag}/lengths")
    (p_lo, p_hi), (m_lo, m_hi) = (length_range(args.prompt_tokens, ratio),
                                  length_range(args.max_tokens, ratio))
    m_lo, m_hi = max(m_lo, 1), max(m_hi, 1)
    prompt_lens = [rng.randint(p_lo, p_hi) for _ in range(count)]
    return prompt_lens, [rng.randint(m_lo, m_hi) for _ in range(count)]


def prompt_set(args, tag: str, count: int) -> tuple[list[list[int]], list[int]]:
    """``count`` random token-id prompts for the row named ``tag`` and each one's own
    ``max_tokens`` (:func:`request_lengths`: ``--prompt-tokens`` and ``--max-tokens`` each,
    unless ``--random-range-ratio``): the same for the same seed and tag, and (ids drawn
    from ``--max-token-id + 1`` values) with no first block in common with another tag's,
    so nothing is a prefix-cache hit."""
    prompt_lens, max_tokens = request_lengths(args, tag, count)
    rng = random.Random(f"{args.seed}/{tag}")
    return [[rng.randint(0, args.max_token_id) for _ in range(n)] for n in prompt_lens], \
        max_tokens


def per_request(params, count: int) -> list:
    """One ``SamplingParams`` per prompt: ``params`` itself if a list, else ``count`` of it."""
    return list(params) if isinstance(params, (list, tuple)) else [params] * count


def closed_loop(llm, prompts, params, clients: int) -> dict:
    """The clients' arrival pattern without HTTP: ``clients`` threads, each calling
    ``LLM.generate`` on one prompt after another (``generate`` is safe from several
    threads), so a request enters the engine when an earlier one ends, as over HTTP.  What
    the server loses against this row is the HTTP path's; what this row loses against the
    all-at-once row is the engine's, on staggered arrivals (most steps then mix a prefill
    with the decodes).  ``params``: one SamplingParams, or one per prompt."""
    import threading

    params = per_request(params, len(prompts))
    next_index = iter(range(len(prompts)))
    lock, done, ttft, tpot = threading.Lock(), [], [], []

    def worker():
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            out = llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0]
            if len(out.outputs[0].token_ids) == params[i].max_tokens:
                done.append(params[i].max_tokens)
            if out.metrics is not None and out.metrics.time_to_first_token is not None:
                ttft.append(out.metrics.time_to_first_token)
            if out.metrics is not None and out.metrics.time_per_output_token is not None:
                tpot.append(out.metrics.time_per_output_token)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    # The engine's own clocks (arrival to first token; mean gap after it): beside the
    # server's TTFT they show where its requests wait.
    return offline_row(f"{clients}, in process (closed loop)", len(prompts),
                       len(done), wall, sum(done)) | {
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "tpot_p50_ms": 1e3 * percentile(tpot, 50)}


def offline_row(label: str, requests: int, done: int, wall: float, tokens: int) -> dict:
    """A row of an in-process run, in the load test's columns (``done`` requests complete,
    with ``tokens`` output tokens together -- each its own max_tokens -- in ``wall``
    seconds)."""
    return {"clients": label, "requests": requests, "completed": done,
            "failed": requests - done, "wall_s": wall, "requests_per_s": done / wall,
            "output_tokens_per_s": tokens / wall}


def offline_floor(args) -> list[dict]:
    """The same requests through ``LLM.generate`` in this process on the engine the server
    had (its flags parsed by the serve CLI): all at once, then per client level in waves of
    that many requests (:func:`waves`: offline at the level's concurrency, the floor the
    server at that level is measured against) and in a closed loop (:func:`closed_loop`),
    which splits the gap between the HTTP path and the engine's arrival pattern."""
    import argparse

    from chunklocal.engine.llm import LLM
    from chunklocal.engine.sampling import SamplingParams
    from chunklocal.server import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    served = parser.parse_args([str(args.launch), *shlex.split(args.serve_args)])
    llm = LLM(args.launch, **serve_cli.llm_kwargs(served))

    def requests(tag):  # the prompts and a SamplingParams each (its own max_tokens)
        prompts, max_tokens = prompt_set(args, tag, args.requests)
        return prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                         for m in max_tokens]

    # Warm-up: as many requests of the same shape (prompts of their own). Two prompts left
    # first-use costs (kernels compiled for new row counts) in the timed call on the H200,
    # where the server had been warmed by its earlier client levels (2026-12-02).
    n = args.requests
    llm.generate(*requests("offline warm-up"), use_tqdm=False)
    rows = [waves(llm, *requests("offline all"), n, label="offline LLM.generate")]
    for clients in args.clients:
        rows += [waves(llm, *requests(f"waves {clients}"), clients),
                 closed_loop(llm, *requests(f"closed loop {clients}"), clients)]
    llm.core.shutdown()
    return rows


def waves(llm, prompts, params, clients: int, label: str | None = None) -> dict:
    """Offline at the level's concurrency: ``LLM.generate`` on ``clients`` prompts at a time,
    one wave after another.  The all-at-once row batches up to ``--max-num-seqs``, which a
    level of fewer clients can never reach; this row is the floor a server with that many
    clients can be held to.  ``params``: one SamplingParams, or one per prompt."""
    params = per_request(params, len(prompts))
    start, ok, tokens = time.perf_counter(), 0, 0
    for i in range(0, len(prompts), clients):
        wave = params[i:i + clients]
        outs = llm.generate(prompts[i:i + clients], wave, use_tqdm=False)
        for o, p in zip(outs, wave, strict=True):
            if len(o.outputs[0].token_ids) == p.max_tokens:
                ok, tokens = ok + 1, tokens + p.max_tokens
    return offline_row(label or f"{clients}, offline in waves of {clients}", len(prompts), ok,
                       time.perf_counter() - start, tokens)


def main(argv=None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="running server (default: the launched one)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32],
                   help="concurrency levels, run one after another")
    p.add_argument("--requests", type=int, default=64, help="requests per level")
    p.add_argument("--duration", type=float, default=120.0,
                   help="seconds per level after which no new request starts")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="as vLLM's: each request draws its prompt length and max_tokens "
                   "uniformly from [floor(L * (1 - r)), ceil(L * (1 + r))] around "
                   "--prompt-tokens and --max-tokens; r in [0, 1), 0: those lengths exactly. "
                   "The longest request (both upper ends) must fit the server's "
                   "--max-model-len, or the server refuses it and it counts as failed")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="as vLLM's: requests per second arriving at each level (Poisson at "
                   "--burstiness 1), each then waiting for one of --clients (vLLM's "
                   "--max-concurrency); inf (the default): all at once, the clients as busy "
                   "as they can be")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="as vLLM's: the shape of the gamma distribution of the gaps between "
                   "arrivals (1: Poisson; below 1 burstier, above steadier)")
    p.add_argument("--max-token-id", type=int, default=255,
                   help="prompt ids are drawn from [0, this] (any vocabulary has them)")
    p.add_argument("--verify", type=int, default=4,
                   help="re-send this many prompts without streaming and compare texts")
    p.add_argument("--launch", type=Path, default=None, help="start `chunklocal serve DIR`")
    p.add_argument("--serve-args", default="", help="more flags for the launched server")
    p.add_argument("--make-tiny", type=Path, default=None,
                   help="write the tiny CPU checkpoint to this directory first")
    p.add_argument("--make-scout", type=Path, default=None,
                   help="write the Scout-shaped random checkpoint (GPU) to this directory "
                   "first: 4 layers with Scout's attention and its dense MLP (no experts, so "
                   "--routing changes nothing; --make-dummy scout4 has the experts)")
    p.add_argument("--scout-max-len", type=int, default=8192,
                   help="max_position_embeddings of --make-scout")
    p.add_argument("--make-scout-fp8", type=Path, default=None,
                   help="write full-size Scout FP8's config.json (no weights: serve it with "
                   "--load-format dummy) to this directory first")
    p.add_argument("--make-dummy", nargs=2, metavar=("MODEL", "DIR"), default=None,
                   help="write the config.json of a benchmarks.decode_floor geometry (scout4, "
                   "maverick4: 4 MoE layers; scout-fp8, scout-fp8-12: full-size FP8 layers) "
                   "to DIR first; serve it with --load-format dummy")
    p.add_argument("--routing", choices=sorted(ROUTING), default="model",
                   help="the experts' routing in the server and the offline floor: the "
                   "weights' own (model) or a simulated spread (models/moe.py)")
    p.add_argument("--offline-floor", action="store_true",
                   help="after the levels, stop the launched server and run the same requests "
                   "offline on the same engine flags: all at once (LLM.generate), then per "
                   "level from as many threads in a closed loop, without HTTP")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="send this many of the prompts first, at the first level's client "
                   "count, untimed: the first level then meets a warm server (kernels for "
                   "new row counts compiled, as the offline floor's own warm-up does)")
    p.add_argument("--progress", type=float, default=0.0,
                   help="print the level's running output rate every this many seconds "
                   "(0: never); a run cut short still shows its steady state")
    p.add_argument("--server-log", type=Path, default=None,
                   help="the launched server's stdout and stderr go to this file (start-up "
                   "time, the KV pool summary, errors)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        # prompts of 2 cacheable blocks (16 tokens each): a prefix-cache hit would show
        args.clients, args.requests, args.prompt_tokens, args.max_tokens = [1, 4], 8, 40, 8
    if not args.request_rate > 0:
        p.error(f"--request-rate {args.request_rate}: must be > 0 requests per second (inf: "
                "all at once)")
    if not 0 < args.burstiness < math.inf:
        p.error(f"--burstiness {args.burstiness}: must be a finite number > 0 (1: Poisson)")
    if not 0.0 <= args.random_range_ratio < 1.0:
        p.error(f"--random-range-ratio {args.random_range_ratio}: must be in [0, 1) (vLLM's)")
    if length_range(args.prompt_tokens, args.random_range_ratio)[0] < 1:
        p.error(f"--prompt-tokens {args.prompt_tokens} with --random-range-ratio "
                f"{args.random_range_ratio} can draw an empty prompt")
    if args.routing != "model" and args.verify > 0:
        p.error(f"--verify {args.verify} compares texts of two runs of a prompt, which "
                f"--routing {args.routing} routes differently (each call moves the experts): "
                "give --verify 0")
    # --make-scout-fp8 DIR is --make-dummy scout-fp8 DIR (kept for the runbook's commands)
    dummies = [("scout-fp8", args.make_scout_fp8)] if args.make_scout_fp8 is not None else []
    dummies += [tuple(args.make_dummy)] if args.make_dummy is not None else []
    if dummies:  # decode_floor imports torch: only when a geometry is written
        from benchmarks.decode_floor import MODELS, write_config

        unknown = [model for model, _ in dummies if model not in MODELS]
        if unknown:
            p.error(f"--make-dummy {unknown[0]}: not one of {', '.join(sorted(MODELS))}")
    if args.make_tiny is not None:
        make_tiny(args.make_tiny)
    if args.make_scout is not None:
        from benchmarks.engine import SCOUT, write_random_checkpoint

        write_random_checkpoint(args.make_scout, SCOUT, args.scout_max_len, "cuda")
    for model, path in dummies:
        write_config(Path(path), model)
    use_routing(ROUTING[args.routing])
    proc = None
    if args.launch is not None:
        port = free_port()
        args.url = f"http://127.0.0.1:{port}"
        log = None
        if args.server_log is not None:
            args.server_log.parent.mkdir(parents=True, exist_ok=True)
            log = open(args.server_log, "w")  # noqa: SIM115 - the child writes it till it stops
        proc = launch_server(args.launch, port, ["--disable-uvicorn-access-log",
                                                 *shlex.split(args.serve_args)], log=log)
    if args.url is None:
        p.error("give --url of a running server, or --launch DIR")
    if proc is not None:  # a time limit's SIGTERM stops the launched server too (finally)
        signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        return _run(args, headers, proc)
    finally:
        if proc is not None and proc.poll() is None:
            print(f"server stopped with status {stop_server(proc)}", flush=True)


def _run(args, headers, proc) -> int:
    import httpx

    started = time.perf_counter()
    wait_healthy(args.url, proc, timeout=900)
    print(f"server healthy after {time.perf_counter() - started:.1f} s", flush=True)
    model = args.model or httpx.get(f"{args.url}/v1/models", headers=headers).json()[
        "data"][0]["id"]
    n = args.requests
    rows, problems, cpu = [], [], {}
    if args.random_range_ratio > 0:
        print("each request's prompt tokens from [{}, {}], max_tokens from [{}, {}]".format(
            *length_range(args.prompt_tokens, args.random_range_ratio),
            *(max(m, 1) for m in length_range(args.max_tokens, args.random_range_ratio))),
            flush=True)
    if args.warmup_requests > 0:
        prompts, max_tokens = prompt_set(args, "warm-up", args.warmup_requests)
        records, _ = asyncio.run(run_level(
            args.url, model, headers, prompts, args.clients[0], max_tokens, args.duration,
            args.timeout))
        problems += _problems("warm-up", records, max_tokens)
    for clients in args.clients:
        prompts, max_tokens = prompt_set(args, f"server {clients}", n)
        before = proc_cpu.sample(proc.pid) if proc is not None else {}
        send_at = arrival_times(n, args.request_rate, args.burstiness,
                                f"{args.seed}/server {clients}")
        records, wall = asyncio.run(run_level(args.url, model, headers, prompts, clients,
                                              max_tokens, args.duration, args.timeout,
                                              args.progress, send_at))
        rows.append(summarize(clients, records, wall, max_tokens))
        if before:  # which thread of the server or the engine process was saturated
            cpu[clients] = proc_cpu.usage(before, proc_cpu.sample(proc.pid), wall, proc.pid)
            print(f"{clients} clients, CPU: {proc_cpu.summary(cpu[clients])}", flush=True)
        problems += _problems(f"{clients} clients", records, max_tokens)
        problems += asyncio.run(verify(args.url, model, headers, prompts, records,
                                       max_tokens, args.verify))
        print(format_table([rows[-1]]), flush=True)
    if args.offline_floor:
        if proc is None:
            raise SystemExit("--offline-floor needs --launch (it builds the same engine)")
        print(f"server stopped with status {stop_server(proc)}; offline floor", flush=True)
        rows += offline_floor(args)
    print(format_table(rows))
    for line in problems[:20]:
        print("FAILED", line)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = write_json("serve_smoke" if args.smoke else "serve",
                      {"config": config, "rows": rows, "cpu": cpu, "errors": problems},
                      args.out)
    print(f"wrote {path}; {'FAILED' if problems else 'all'} requests complete"
          + (f" ({len(problems)} problems)" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
