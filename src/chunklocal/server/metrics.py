"""Prometheus metrics of the server (prometheus_client, one registry per app).

Engine gauges and token counters are read from ``core.stats()`` when /metrics is scraped;
latency histograms are observed per request as its outputs arrive at the server.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_PREFIX = "chunklocal_"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _EngineCollector:
    """Reads the engine's counters at scrape time (no polling thread)."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        core = self.state.core
        stats = core.stats() if core is not None else {}
        gauges = (("num_requests_running", "requests in the running batch", "num_running"),
                  ("num_requests_waiting", "requests waiting for a slot or KV pages",
                   "num_waiting"),
                  ("kv_cache_usage_perc", "fraction of KV pages in use (0..1)", "kv_usage"),
                  ("peak_virtual_batches", "most virtual batches in one step so far",
                   "peak_virtual_batches"))
        for name, doc, key in gauges:
            yield GaugeMetricFamily(_PREFIX + name, doc, value=float(stats.get(key, 0)))
        for name, doc, key in (("prompt_tokens", "prompt tokens computed", "prompt_tokens_total"),
                               ("generation_tokens", "tokens generated",
                                "generation_tokens_total"),
                               ("num_preemptions", "requests preempted (KV dropped, to be "
                                "recomputed)", "num_preemptions_total")):
            yield CounterMetricFamily(_PREFIX + name, doc, value=float(stats.get(key, 0)))
        yield GaugeMetricFamily(_PREFIX + "model_loaded", "1 once the model is loaded",
                                value=float(core is not None))


class ServerMetrics:
    def __init__(self, state):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(state))
        r = self.registry
        self.ttft = Histogram(_PREFIX + "time_to_first_token_seconds",
                              "arrival to first generated token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram(_PREFIX + "inter_token_latency_seconds",
                             "time between generated tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(_PREFIX + "e2e_request_latency_seconds",
                             "arrival to the last token", buckets=_E2E_BUCKETS, registry=r)
        self.finished = Counter(_PREFIX + "request_success",
                                "finished engine requests by finish reason",
                                ["finished_reason"], registry=r)
        self.http_errors = Counter(_PREFIX + "http_errors", "error answers by status",
                                   ["status"], registry=r)

    def observe(self, stream):
        """Wrap one request's async output iterator, observing its latencies."""
        return _observed(self, stream)


async def _observed(metrics: ServerMetrics, stream):
    start = last = time.perf_counter()
    seen = 0
    out = None
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
    if out is not None and out.finished:
        metrics.e2e.observe(time.perf_counter() - start)
        for o in out.outputs:
            metrics.finished.labels(o.finish_reason or "none").inc()
