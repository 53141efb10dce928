"""Prometheus metrics of the server (prometheus_client, one registry per app).

What vLLM measures has vLLM's name (``vllm:`` prefix, a ``model_name`` label with the first
served model name), so vLLM's dashboards and alerts read this server as they read vLLM;
``chunklocal_`` names are kept only for what vLLM has no name for.  Engine gauges and token
counters are read from ``core.stats()`` when /metrics is scraped; latency histograms are
observed per request as its outputs arrive at the server, and a request that ends without
a final output (its client went away) counts as ``finished_reason="abort"``.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_VLLM = "vllm:"
_OWN = "chunklocal_"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_FINISH_REASONS = ("stop", "length", "abort")


class _EngineCollector:
    """Reads the engine's counters at scrape time (no polling thread)."""

    def __init__(self, state, model_name: str):
        self.state, self.model_name = state, model_name

    def _family(self, cls, name, doc, value):
        fam = cls(name, doc, labels=["model_name"])
        fam.add_metric([self.model_name], float(value))
        return fam

    def collect(self):
        core = self.state.core
        stats = core.stats() if core is not None else {}
        for name, doc, key in (
                ("num_requests_running", "sequences in the running batch", "num_running"),
                ("num_requests_waiting", "sequences waiting for a slot or KV pages",
                 "num_waiting"),
                ("kv_cache_usage_perc", "fraction of KV pages in use (0..1)", "kv_usage")):
            yield self._family(GaugeMetricFamily, _VLLM + name, doc, stats.get(key, 0))
        for name, doc, key in (("prompt_tokens", "prompt tokens computed", "prompt_tokens_total"),
                               ("generation_tokens", "tokens generated",
                                "generation_tokens_total"),
                               ("num_preemptions", "requests preempted (KV dropped, to be "
                                "recomputed)", "num_preemptions_total"),
                               ("prefix_cache_queries", "prompt tokens looked up in the prefix "
                                "cache", "prefix_cache_queries_total"),
                               ("prefix_cache_hits", "prompt tokens the prefix cache served",
                                "prefix_cache_hits_total")):
            yield self._family(CounterMetricFamily, _VLLM + name, doc, stats.get(key, 0))
        yield GaugeMetricFamily(_OWN + "peak_virtual_batches",
                                "most virtual batches in one step so far",
                                value=float(stats.get("peak_virtual_batches", 0)))
        yield GaugeMetricFamily(_OWN + "model_loaded", "1 once the model is loaded",
                                value=float(core is not None))


class ServerMetrics:
    def __init__(self, state, model_name: str = ""):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(state, model_name))
        r, label = self.registry, ["model_name"]
        self.ttft = Histogram(_VLLM + "time_to_first_token_seconds",
                              "arrival to first generated token", label,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(_VLLM + "inter_token_latency_seconds",
                             "time between generated tokens of a request", label,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(_VLLM + "e2e_request_latency_seconds",
                             "arrival to the last token", label, buckets=_E2E_BUCKETS,
                             registry=r).labels(model_name)
        success = Counter(_VLLM + "request_success", "finished requests by finish reason",
                          ["model_name", "finished_reason"], registry=r)
        self._success = {reason: success.labels(model_name, reason)
                         for reason in _FINISH_REASONS}
        self._success_family, self._model_name = success, model_name
        self.http_errors = Counter(_OWN + "http_errors", "error answers by status",
                                   ["status"], registry=r)

    def finished(self, reason: str | None) -> None:
        counter = self._success.get(reason or "none")
        if counter is None:
            counter = self._success_family.labels(self._model_name, reason or "none")
        counter.inc()

    def observe(self, stream):
        """Wrap one request's async output iterator, observing its latencies."""
        return _observed(self, stream)


async def _observed(metrics: ServerMetrics, stream):
    start = last = time.perf_counter()
    seen = 0
    out = None
    try:
        async for out in stream:
            now = time.perf_counter()
            total = sum(len(o.token_ids) for o in out.outputs)
            new = total - seen
            if new > 0:
                if seen == 0:
                    metrics.ttft.observe(now - start)
                else:
                    # Several tokens in one snapshot (speculative decoding): one gap each.
                    for _ in range(new):
                        metrics.itl.observe((now - last) / new)
                seen, last = total, now
            yield out
    except BaseException as err:
        if not isinstance(err, Exception) and not (out is not None and out.finished):
            # Cancelled: the client went away and the request is aborted unfinished.
            for _ in (out.outputs if out is not None else (None,)):
                metrics.finished("abort")
        raise
    if out is not None and out.finished:
        metrics.e2e.observe(time.perf_counter() - start)
        for o in out.outputs:
            metrics.finished(o.finish_reason)
