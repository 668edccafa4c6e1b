"""Prometheus metrics, with vLLM's names under an ``infer:`` prefix.

Served at ``GET /metrics`` (prometheus-client's text format). Each server has its own
registry, so tests can start several.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from infer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class Metrics:
    """Counters, gauges and histograms of one server."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.model_name = model_name
        self.running = Gauge("infer:num_requests_running", "Requests being generated", labels, registry=r)
        self.waiting = Gauge("infer:num_requests_waiting", "Requests waiting for admission", labels, registry=r)
        self.kv_usage = Gauge("infer:kv_cache_usage_perc", "Fraction of the KV cache in use (0-1)", labels,
                              registry=r)
        self.success = Counter("infer:request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("infer:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("infer:generation_tokens", "Tokens generated", labels, registry=r)
        self.preemptions = Counter("infer:num_preemptions", "Preempted requests (blocks freed, recomputed later)",
                                   labels, registry=r)
        self.preemptions.labels(model_name)  # exposed as 0 before the first preemption
        self._preemptions_seen = 0
        self.ttft = Histogram("infer:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("infer:time_per_output_token_seconds", "Time per output token after the first",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("infer:e2e_request_latency_seconds", "Arrival to last token", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)

    def request_finished(self, out: RequestOutput) -> None:
        """Record a finished request (called on the engine thread)."""
        m = self.model_name
        for c in out.outputs:
            self.success.labels(m, c.finish_reason or "abort").inc()
            self.generation_tokens.labels(m).inc(len(c.token_ids))
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        t = out.metrics
        if "first_token" in t:
            self.ttft.labels(m).observe(t["first_token"] - t["arrival"])
            n = max(len(c.token_ids) for c in out.outputs) if out.outputs else 0
            if n > 1 and "finished" in t:
                self.tpot.labels(m).observe((t["finished"] - t["first_token"]) / (n - 1))
        if "finished" in t:
            self.e2e.labels(m).observe(t["finished"] - t["arrival"])

    def render(self, running: int, waiting: int, kv_usage: float, num_preemptions: int = 0) -> bytes:
        """The text exposition; ``num_preemptions`` is the engine's cumulative count of preempted
        requests (``LLMEngine.num_preemptions``): the counter advances by what is new since the
        last scrape."""
        m = self.model_name
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.kv_usage.labels(m).set(kv_usage)
        if num_preemptions > self._preemptions_seen:
            self.preemptions.labels(m).inc(num_preemptions - self._preemptions_seen)
            self._preemptions_seen = num_preemptions
        return generate_latest(self.registry)
