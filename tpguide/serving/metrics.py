"""Prometheus metrics of the server (``GET /metrics``), names after vLLM's ``vllm:*`` metrics.

One private :class:`prometheus_client.CollectorRegistry` per server, so
several servers (tests) in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)


class ServerMetrics:
    """The metrics: running/waiting, tokens, TTFT/ITL/E2E, grammar compile, outcomes."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        self.running = Gauge("tpguide:num_requests_running", "Requests in the engine's batch", registry=r)
        self.waiting = Gauge("tpguide:num_requests_waiting", "Requests admitted but waiting for a batch slot",
                             registry=r)
        self.prompt_tokens = Counter("tpguide:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("tpguide:generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("tpguide:time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tpguide:inter_token_latency_seconds", "Time between a request's output steps "
                             "per generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tpguide:e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.grammar_compile = Histogram("tpguide:grammar_compile_seconds", "Grammar compile time (cache misses)",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.grammar_cache_hits = Counter("tpguide:grammar_cache_hits", "Guides found compiled in the cache",
                                          registry=r)
        self.grammar_cache_misses = Counter("tpguide:grammar_cache_misses", "Guides compiled", registry=r)
        self.finished = Counter("tpguide:request_success", "Requests finished, by finish reason",
                                ["finished_reason"], registry=r)
        self.failed = Counter("tpguide:request_failure", "Requests failed, by error kind", ["error_kind"],
                              registry=r)
        self.kv_blocks_used = Gauge("tpguide:kv_cache_blocks_used", "KV blocks referenced by running requests",
                                    registry=r)
        self.kv_blocks_free = Gauge("tpguide:kv_cache_blocks_free", "KV blocks free (cached ones included: "
                                    "evictable)", registry=r)
        self.prefix_queries = Counter("tpguide:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache", registry=r)
        self.prefix_hits = Counter("tpguide:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=r)
        self.preemptions = Counter("tpguide:num_preemptions", "Requests preempted (recomputed later) when the KV "
                                   "cache ran out of blocks", registry=r)
        self._kv_last = (0, 0, 0)
        self.info = Gauge("tpguide:model_info", "The served model", list(labels), registry=r)
        self.info.labels(**labels).set(1)

    def observe_kv_cache(self, stats) -> None:
        """Update the KV-cache metrics from the engine's :class:`~tpguide.engine.driver.KVCacheStats`."""
        self.kv_blocks_used.set(stats.num_used_blocks)
        self.kv_blocks_free.set(stats.num_blocks - stats.num_used_blocks)
        now = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)
        for counter, new, old in zip((self.prefix_queries, self.prefix_hits, self.preemptions), now, self._kv_last):
            if new > old:
                counter.inc(new - old)
        self._kv_last = now

    def render(self) -> tuple:
        """(body bytes, content type) of ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
