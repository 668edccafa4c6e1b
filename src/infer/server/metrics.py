"""Prometheus metrics, with vLLM's names under an ``infer:`` prefix.

Served at ``GET /metrics`` (prometheus-client's text format). Each server has its own
registry, so tests can start several.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

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
            self.generation_tokens.labels(m).inc(c.num_generated_tokens)
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        t = out.metrics
        if "first_token" in t:
            self.ttft.labels(m).observe(t["first_token"] - t["arrival"])
            n = max(c.num_generated_tokens for c in out.outputs) if out.outputs else 0
            if n > 1 and "finished" in t:
                self.tpot.labels(m).observe((t["finished"] - t["first_token"]) / (n - 1))
        if "finished" in t:
            self.e2e.labels(m).observe(t["finished"] - t["arrival"])

    def render(self, running: int, waiting: int, kv_usage: float, num_preemptions: int = 0,
               scheduler=None) -> bytes:
        """The text exposition; ``num_preemptions`` is the engine's cumulative count of preempted
        requests (``LLMEngine.num_preemptions``): the counter advances by what is new since the
        last scrape. With the engine's ``scheduler``, its per-step prefill statistics are exposed
        too (:class:`SchedulerCollector`)."""
        m = self.model_name
        if scheduler is not None and not hasattr(self, "_scheduler_collector"):
            self._scheduler_collector = SchedulerCollector(scheduler, m)
            self.registry.register(self._scheduler_collector)
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.kv_usage.labels(m).set(kv_usage)
        if num_preemptions > self._preemptions_seen:
            self.preemptions.labels(m).inc(num_preemptions - self._preemptions_seen)
            self._preemptions_seen = num_preemptions
        return generate_latest(self.registry)


class SchedulerCollector:
    """Chunked prefill (phase 6), read from a :class:`~infer.engine.scheduler.Scheduler` at scrape time.

    * ``infer:iteration_prefill_tokens``: histogram of prefill tokens per engine step (steps that
      ran any; vLLM's ``vllm:iteration_tokens_total`` counts all tokens of a step the same way);
    * ``infer:num_chunked_prefill_steps_total``: steps that ran a prefill chunk leaving part of
      its sequence for a later step;
    * ``infer:prefix_cache_queries_total`` / ``infer:prefix_cache_hits_total`` (phase 7): prompt
      tokens looked up in the prefix cache at admission, and found there (vLLM's names);
    * with ``kv_offload`` (phase 10): :func:`offload_metrics`.
    """

    def __init__(self, scheduler, model_name: str) -> None:
        self.scheduler, self.model_name = scheduler, model_name

    def collect(self):
        from infer.engine.scheduler import PREFILL_TOKEN_BUCKETS

        s = self.scheduler
        counts = list(s.prefill_tokens_buckets)  # a copy: the engine thread may add a step meanwhile
        cum, buckets = 0, []
        for bound, c in zip([*map(float, PREFILL_TOKEN_BUCKETS), "+Inf"], counts):
            cum += c
            buckets.append((str(bound), cum))
        h = HistogramMetricFamily("infer:iteration_prefill_tokens", "Prefill tokens per engine step (steps with any)",
                                  labels=["model_name"])
        h.add_metric([self.model_name], buckets, sum_value=s.num_prefill_tokens)
        yield h
        c = CounterMetricFamily("infer:num_chunked_prefill_steps", "Steps that ran a partial prefill chunk",
                                labels=["model_name"])
        c.add_metric([self.model_name], s.num_chunked_steps)
        yield c
        kv = s.kv  # prefix caching (phase 7): vLLM's counters, in prompt tokens
        for name, value, doc in (("infer:prefix_cache_queries", kv.prefix_cache_queries,
                                  "Prompt tokens looked up in the prefix cache"),
                                 ("infer:prefix_cache_hits", kv.prefix_cache_hits,
                                  "Prompt tokens found in the prefix cache (prefill skipped)")):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        if kv.offloader is not None:  # KV offload (phase 10): per-tier hits, bytes, copy time
            yield from offload_metrics(kv.offloader.stats(), kv.offload_hit_tokens, self.model_name)


def offload_metrics(stats: dict, hit_tokens: int, model_name: str):
    """KV offload (phase 10) as Prometheus families: ``infer:kv_offload_hits_total{tier}`` (blocks
    restored from the host or disk tier), ``infer:kv_offload_restored_bytes_total{tier}``,
    ``infer:kv_offload_hit_tokens_total`` (prompt tokens not prefilled), ``infer:kv_offload_stored_
    blocks_total`` and ``_bytes_total`` (device -> host), ``infer:kv_offload_spilled_bytes_total``
    (host -> disk), ``infer:kv_offload_evictions_total{tier}`` (blocks a full tier pushed down or
    out), ``infer:kv_offload_blocks{tier}`` (held now), and ``infer:kv_offload_seconds_total{op}``
    (host seconds issuing offloads and restores; on the CPU the copies themselves)."""
    def family(cls, name, doc, labels, rows):
        f = cls(name, doc, labels=["model_name", *labels])
        for label_values, value in rows:
            f.add_metric([model_name, *label_values], value)
        return f

    tiers = ("host", "disk")
    yield family(CounterMetricFamily, "infer:kv_offload_hits", "Blocks restored from an offload tier", ["tier"],
                 [((t,), stats[f"kv_offload_{t}_hits"]) for t in tiers])
    yield family(CounterMetricFamily, "infer:kv_offload_restored_bytes", "Bytes restored from an offload tier",
                 ["tier"], [((t,), stats[f"kv_offload_{t}_bytes_restored"]) for t in tiers])
    yield family(CounterMetricFamily, "infer:kv_offload_hit_tokens", "Prompt tokens restored instead of prefilled",
                 [], [((), hit_tokens)])
    yield family(CounterMetricFamily, "infer:kv_offload_stored_blocks", "Blocks copied from the device to the host",
                 [], [((), stats["kv_offload_stored_blocks"])])
    yield family(CounterMetricFamily, "infer:kv_offload_stored_bytes", "Bytes copied from the device to the host",
                 [], [((), stats["kv_offload_bytes_offloaded"])])
    yield family(CounterMetricFamily, "infer:kv_offload_spilled_bytes", "Bytes written from the host to the disk",
                 [], [((), stats["kv_offload_bytes_spilled"])])
    yield family(CounterMetricFamily, "infer:kv_offload_evictions", "Blocks a full tier evicted", ["tier"],
                 [((t,), stats[f"kv_offload_{t}_evictions"]) for t in tiers])
    yield family(GaugeMetricFamily, "infer:kv_offload_blocks", "Blocks held by an offload tier", ["tier"],
                 [((t,), stats[f"kv_offload_{t}_blocks"]) for t in tiers])
    yield family(CounterMetricFamily, "infer:kv_offload_seconds", "Seconds spent on offload copies", ["op"],
                 [(("offload",), stats["kv_offload_time_s"]), (("restore",), stats["kv_offload_restore_time_s"])])
