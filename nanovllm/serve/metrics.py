"""Prometheus metrics, named like vLLM's (`vllm:` -> `nanovllm:`).

Gauges and token counters are read from the engine's own counters at scrape time (a collector);
latency histograms are observed by the server when a request finishes.
"""
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                         0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class EngineStatsCollector(Collector):
    """Running/waiting requests, KV usage and cumulative token counters, from engine.stats()."""

    def __init__(self, stats: Callable[[], dict], model_name: str):
        self.stats = stats
        self.labels = {"model_name": model_name}

    def collect(self):
        stats = self.stats()
        gauges = [("num_requests_running", "Requests in the running batch.", "num_running"),
                  ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
                  ("kv_cache_usage_perc", "Share of the KV cache blocks in use (1 = full).", "kv_cache_usage"),
                  ("kv_offload_usage_perc", "Share of the host tier's KV blocks holding a prefix block (1 = full).",
                   "kv_offload_usage")]
        counters = [("prompt_tokens", "Prompt tokens processed.", "prompt_tokens"),
                    ("generation_tokens", "Tokens generated.", "generation_tokens"),
                    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
                    ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", "prefix_cache_hits"),
                    ("spec_decode_num_drafts", "Sequence steps that verified proposed tokens.", "spec_decode_num_drafts"),
                    ("spec_decode_num_draft_tokens", "Proposed tokens verified.", "spec_decode_num_draft_tokens"),
                    ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                     "spec_decode_num_accepted_tokens"),
                    ("prefix_cache_host_hits", "Prompt tokens served from the prefix cache's host tier.",
                     "prefix_cache_host_hits"),
                    ("kv_offload_blocks_offloaded", "KV blocks copied from the GPU to the host tier.",
                     "kv_offload_blocks_offloaded"),
                    ("kv_offload_blocks_loaded", "KV blocks copied from the host tier back to the GPU.",
                     "kv_offload_blocks_loaded")]
        for name, doc, key in gauges:
            metric = GaugeMetricFamily(f"nanovllm:{name}", doc, labels=list(self.labels))
            metric.add_metric(list(self.labels.values()), float(stats.get(key, 0)))
            yield metric
        for name, doc, key in counters:
            metric = CounterMetricFamily(f"nanovllm:{name}", doc, labels=list(self.labels))
            metric.add_metric(list(self.labels.values()), float(stats.get(key, 0)))
            yield metric
        queries = stats.get("prefix_cache_queries", 0)
        hit_rate = GaugeMetricFamily("nanovllm:prefix_cache_hit_rate",
                                     "Prefix-cache hits / queries since start (0 before any query).",
                                     labels=list(self.labels))
        hit_rate.add_metric(list(self.labels.values()), stats.get("prefix_cache_hits", 0) / queries if queries else 0.0)
        yield hit_rate


class ServerMetrics:
    """One registry per app, so that several apps (tests) in one process do not collide."""

    def __init__(self, stats: Callable[[], dict], model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("nanovllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram("nanovllm:time_per_output_token_seconds", "Time per output token after the first.",
                              labels, buckets=TOKEN_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("nanovllm:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.finished = Counter("nanovllm:request_success", "Requests finished, by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self.model_name = model_name

    def observe_finished(self, output: dict) -> None:
        """Record one finished engine request (its final output)."""
        metrics = output.get("metrics") or {}
        self.ttft.observe(metrics.get("time_to_first_token", 0.0))
        if len(output.get("token_ids", ())) > 1:
            self.tpot.observe(metrics.get("time_per_output_token", 0.0))
        self.e2e.observe(metrics.get("latency", 0.0))
        self.finished.labels(self.model_name, output.get("finish_reason") or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
