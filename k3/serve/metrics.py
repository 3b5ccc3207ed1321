"""Prometheus metrics of one server (own CollectorRegistry), with vLLM-style names under the `k3:` prefix.

Gauges and counters owned by the engine (running / waiting requests, pool usage, prefix-cache queries and
hits, preemptions) are read from the latest `engine.stats()` snapshot at scrape time; per-request latencies
are histograms observed by the engine driver as tokens come out.

    k3:num_requests_running, k3:num_requests_waiting       gauges
    k3:kv_cache_usage_perc                                  gauge, pool pages held by requests / total (0–1)
    k3:pool_pages_total, k3:pool_pages_cached               gauges
    k3:prefix_cache_queries_total, k3:prefix_cache_hits_total  counters, prompt tokens looked up / served
    k3:num_preemptions_total                                counter
    k3:prompt_tokens_total, k3:generation_tokens_total      counters
    k3:request_success_total{finished_reason}               counter
    k3:time_to_first_token_seconds, k3:inter_token_latency_seconds, k3:e2e_request_latency_seconds
                                                            histograms
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


def _stat(stats: dict, key: str) -> float:
    v = stats.get(key)
    return 0.0 if v is None else float(v)


class _EngineCollector(Collector):
    """Engine-owned values, read from a stats snapshot when scraped."""

    def __init__(self, stats: Callable[[], dict[str, Any]], labels: dict[str, str]):
        self.stats = stats
        self.labels = labels

    def collect(self):
        s = self.stats() or {}
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name, doc, v):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, v)
            return c

        yield gauge("k3:num_requests_running", "Requests in the running batch.", _stat(s, "running"))
        yield gauge("k3:num_requests_waiting", "Requests waiting to be scheduled.", _stat(s, "waiting"))
        yield gauge("k3:kv_cache_usage_perc", "Fraction of pool pages held by requests (MLA pages and KDA state "
                    "slots; evictable prefix-cache pages count as free).", _stat(s, "kv_cache_usage"))
        yield gauge("k3:pool_pages_total", "Pages in the unified pool.", _stat(s, "pool_pages_total"))
        yield gauge("k3:pool_pages_cached", "Pool pages held by the prefix cache.", _stat(s, "pool_pages_cached"))
        yield counter("k3:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      _stat(s, "prefix_cache_queries"))
        yield counter("k3:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      _stat(s, "prefix_cache_hits"))
        yield counter("k3:num_preemptions", "Requests preempted (recomputed) for lack of pool pages.",
                      _stat(s, "preemptions"))


class ServerMetrics:
    """All metrics of one server; `render()` is the /metrics body."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self.registry.register(_EngineCollector(stats, labels))
        ln = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("k3:prompt_tokens", "Prompt tokens processed.", ln, registry=r).labels(model_name)
        self.generation_tokens = Counter("k3:generation_tokens", "Tokens generated.", ln,
                                         registry=r).labels(model_name)
        self._success = Counter("k3:request_success", "Finished requests by finish reason.",
                                ln + ["finished_reason"], registry=r)
        self.ttft = Histogram("k3:time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              ln, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("k3:inter_token_latency_seconds", "Time between consecutive generated tokens.", ln,
                             buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("k3:e2e_request_latency_seconds", "Time from arrival to the last token.", ln,
                             buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.model_name = model_name

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
