"""Prometheus metrics, with vLLM's names under an ``infer:`` prefix.

Served at ``GET /metrics`` (prometheus-client's text format), so a dashboard written for vLLM
works with ``vllm:`` replaced by ``infer:``. Each server has its own registry (tests start
several in one process), which holds:

* the engine's metrics (:class:`Metrics`): gauges set at each scrape, counters and per-request
  histograms recorded when a request finishes (``request_finished``, on the engine thread), and
  the per-step histograms the engine keeps itself, read at scrape time (:class:`SchedulerCollector`,
  :class:`OutputCollector`);
* the HTTP requests, recorded by prometheus-fastapi-instrumentator's middleware (``build_app``):
  ``http_requests_total`` by route template, method and status, ``http_request_duration_seconds``
  (and ``http_request_duration_highr_seconds``, finer buckets, no labels), and the body sizes
  ``http_request_size_bytes`` and ``http_response_size_bytes``;
* the process' own, prometheus-client's default collectors: CPU and memory
  (``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ``process_virtual_memory_bytes``,
  ``process_open_fds``, ``process_max_fds``, ``process_start_time_seconds``), the garbage collector
  (``python_gc_objects_collected_total``, ``python_gc_objects_uncollectable_total``,
  ``python_gc_collections_total``) and ``python_info``.

The text leaves out the ``*_created`` samples prometheus-client adds to every counter, histogram
and summary (the Unix time the series was created): vLLM's exposition has none, and they would
double the lines of every counter (:class:`WithoutCreated`).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from infer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
# vLLM's buckets of the request-phase histograms (queue, prefill, decode, inference), in seconds
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets of token counts per request."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def cache_config_labels(engine) -> dict[str, str]:
    """The labels of ``infer:cache_config_info`` for ``engine`` (an ``LLMEngine``): vLLM's
    ``CacheConfig`` fields that infer has (``block_size``; ``num_gpu_blocks``: the KV cache's blocks,
    on whatever device; ``num_cpu_blocks``: the host tier of KV offload; ``cache_dtype``;
    ``enable_prefix_caching``; ``gpu_memory_utilization``) and infer's own ``kv_cache`` and
    ``kv_offload``."""
    c, kv = engine.config, engine.kv_manager
    offloader = getattr(engine, "offloader", None)
    info = {
        "block_size": kv.block_size,
        "num_gpu_blocks": kv.num_blocks,
        "num_cpu_blocks": offloader.host.num_slots if offloader is not None else 0,
        "cache_dtype": str(engine.runner.kv_cache.k.dtype).removeprefix("torch."),
        "enable_prefix_caching": c.prefix_caching,
        "gpu_memory_utilization": c.gpu_memory_utilization,
        "kv_cache": c.kv_cache,
        "kv_offload": c.kv_offload,
    }
    return {k: str(v) for k, v in info.items()}


class Metrics:
    """Counters, gauges and histograms of one server, in a registry of its own.

    Args:
        model_name: the served name (every ``infer:`` series' ``model_name`` label).
        max_model_len: the largest token count the per-request token histograms bucket.
        cache_config: the labels of ``infer:cache_config_info`` (:func:`cache_config_labels`);
            None leaves that gauge out.
    """

    def __init__(self, model_name: str, max_model_len: int = 131072, cache_config: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.model_name = model_name
        self.running = Gauge("infer:num_requests_running", "Requests being generated", labels, registry=r)
        self.waiting = Gauge("infer:num_requests_waiting", "Requests waiting for admission", labels, registry=r)
        self.kv_usage = Gauge("infer:kv_cache_usage_perc", "Fraction of the KV cache in use (0-1)", labels,
                              registry=r)
        self.success = Counter("infer:request_success", "Finished requests (sequences) by finish reason",
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
        # a request's phases (vLLM's): waiting, then running = prefill (to the first token) + decode
        phase = {name: Histogram(f"infer:request_{name}_time_seconds", doc, labels, buckets=_REQUEST_LATENCY_BUCKETS,
                                 registry=r)
                 for name, doc in (("queue", "Arrival to first scheduled (time waiting)"),
                                   ("prefill", "First scheduled to first token"),
                                   ("decode", "First token to finished"),
                                   ("inference", "First scheduled to finished (time running)"))}
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = Histogram("infer:request_prompt_tokens", "Prompt tokens per request", labels,
                                               buckets=token_buckets, registry=r)
        self.request_generation_tokens = Histogram("infer:request_generation_tokens",
                                                   "Generated tokens per request (all its n sequences)", labels,
                                                   buckets=token_buckets, registry=r)
        # (histogram, from, to): observed when a request finishes, if both timestamps exist
        self._spans = ((self.ttft, "arrival", "first_token"), (self.e2e, "arrival", "finished"),
                       (phase["queue"], "arrival", "first_scheduled"), (phase["prefill"], "first_scheduled", "first_token"),
                       (phase["decode"], "first_token", "finished"), (phase["inference"], "first_scheduled", "finished"))
        if cache_config is not None:
            Gauge("infer:cache_config_info", "Information of the KV cache's configuration (vLLM's CacheConfig)",
                  list(cache_config), registry=r).labels(**cache_config).set(1)
        # the process: CPU, memory, file descriptors (Linux), the garbage collector, the Python version
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        PlatformCollector(registry=r)

    def request_finished(self, out: RequestOutput) -> None:
        """Record a finished request (called on the engine thread)."""
        m = self.model_name
        generated = 0
        for c in out.outputs:
            self.success.labels(m, c.finish_reason or "abort").inc()
            generated += c.num_generated_tokens
        self.generation_tokens.labels(m).inc(generated)
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.request_prompt_tokens.labels(m).observe(len(out.prompt_token_ids))
        self.request_generation_tokens.labels(m).observe(generated)
        t = out.metrics
        for histogram, start, end in self._spans:
            if start in t and end in t:
                histogram.labels(m).observe(t[end] - t[start])
        n = max(c.num_generated_tokens for c in out.outputs) if out.outputs else 0
        if n > 1 and "first_token" in t and "finished" in t:
            self.tpot.labels(m).observe((t["finished"] - t["first_token"]) / (n - 1))

    def render(self, running: int, waiting: int, kv_usage: float, num_preemptions: int = 0,
               scheduler=None, output_processor=None) -> bytes:
        """The text exposition; ``num_preemptions`` is the engine's cumulative count of preempted
        requests (``LLMEngine.num_preemptions``): the counter advances by what is new since the
        last scrape. With the engine's ``scheduler`` and ``output_processor``, the statistics they
        keep per step are exposed too (:class:`SchedulerCollector`, :class:`OutputCollector`)."""
        m = self.model_name
        if scheduler is not None:  # registered at the first scrape; later ones read the latest (a snapshot
            if not hasattr(self, "_scheduler_collector"):  # each time when the engine runs in another process)
                self._scheduler_collector = SchedulerCollector(scheduler, m)
                self.registry.register(self._scheduler_collector)
            self._scheduler_collector.scheduler = scheduler
        if output_processor is not None:
            if not hasattr(self, "_output_collector"):
                self._output_collector = OutputCollector(output_processor, m)
                self.registry.register(self._output_collector)
            self._output_collector.output_processor = output_processor
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.kv_usage.labels(m).set(kv_usage)
        if num_preemptions > self._preemptions_seen:
            self.preemptions.labels(m).inc(num_preemptions - self._preemptions_seen)
            self._preemptions_seen = num_preemptions
        return generate_latest(WithoutCreated(self.registry))


class WithoutCreated:
    """A registry's families without their ``<name>_created`` samples.

    prometheus-client adds one to each counter, histogram and summary series (its creation time).
    Its switch, ``prometheus_client.disable_created_metrics()``, is global to the process, so a
    server (or a test) turning it off would change every other registry of the process too; this
    view filters one registry's exposition instead, at scrape time.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            created = family.name + "_created"
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [s for s in family.samples if s.name != created]
            yield copy


def histogram_family(name: str, doc: str, counts, model_name: str) -> HistogramMetricFamily:
    """A Prometheus histogram of an engine-kept :class:`~infer.engine.histogram.BucketCounts`."""
    h = HistogramMetricFamily(name, doc, labels=["model_name"])
    h.add_metric([model_name], counts.cumulative(), sum_value=counts.sum)
    return h


class OutputCollector:
    """Token timing, read from the engine's :class:`~infer.engine.output_processor.OutputProcessor`
    at scrape time: ``infer:inter_token_latency_seconds``, a histogram of the time between a
    request's consecutive tokens (one value per request per step that gave it a token after its
    first; vLLM's name and buckets). With speculative decoding (phase 12), vLLM's counters:
    ``infer:spec_decode_num_drafts_total`` (verify rounds), ``infer:spec_decode_num_draft_tokens_total``,
    ``infer:spec_decode_num_accepted_tokens_total`` and ``infer:spec_decode_num_accepted_tokens_per_pos_total``
    (label ``position``, 0-based); the acceptance rate is accepted / draft tokens, the mean acceptance
    length 1 + accepted / drafts."""

    def __init__(self, output_processor, model_name: str) -> None:
        self.output_processor, self.model_name = output_processor, model_name

    def collect(self):
        yield histogram_family("infer:inter_token_latency_seconds", "Time between a request's consecutive tokens",
                               self.output_processor.inter_token_latency, self.model_name)
        spec = self.output_processor.spec_stats
        if spec is None:
            return
        for name, value, doc in (("num_drafts", spec.num_drafts, "Speculative decoding: verify rounds"),
                                 ("num_draft_tokens", spec.num_draft_tokens, "Draft tokens verified"),
                                 ("num_accepted_tokens", spec.num_accepted_tokens, "Draft tokens accepted")):
            c = CounterMetricFamily(f"infer:spec_decode_{name}", doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        c = CounterMetricFamily("infer:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position",
                                labels=["model_name", "position"])
        for pos, value in enumerate(list(spec.accepted_per_pos)):
            c.add_metric([self.model_name, str(pos)], value)
        yield c


class SchedulerCollector:
    """Per-step statistics, read from a :class:`~infer.engine.scheduler.Scheduler` at scrape time.

    * ``infer:iteration_tokens_total``: histogram of the tokens (prefill and decode) each engine
      step ran (vLLM's name and buckets);
    * chunked prefill (phase 6): ``infer:iteration_prefill_tokens``: histogram of prefill tokens per engine step (steps that
      ran any; vLLM's ``vllm:iteration_tokens_total`` counts all tokens of a step the same way);
    * ``infer:num_chunked_prefill_steps_total``: steps that ran a prefill chunk leaving part of
      its sequence for a later step;
    * ``infer:prefix_cache_queries_total`` / ``infer:prefix_cache_hits_total`` (phase 7): prompt
      tokens looked up in the prefix cache at admission, and found there (vLLM's names);
    * hybrid models (phase 17): ``infer:prefix_cache_snapshot_hits_total``, ``_snapshots_stored_total``,
      ``_snapshots_evicted_total``: hits started from a state snapshot, snapshots taken and dropped;
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
        yield histogram_family("infer:iteration_tokens_total", "Tokens (prefill and decode) per engine step",
                               s.iteration_tokens, self.model_name)
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
        if kv.snapshots is not None:  # hybrid prefix caching (phase 17): the state snapshots
            sn = kv.snapshots
            for name, value, doc in (("infer:prefix_cache_snapshot_hits", sn.num_hits,
                                      "Prefix hits that started the linear layers from a state snapshot"),
                                     ("infer:prefix_cache_snapshots_stored", sn.num_stored,
                                      "Linear-attention state snapshots taken"),
                                     ("infer:prefix_cache_snapshots_evicted", sn.num_evicted,
                                      "State snapshots dropped (with their block, or for room)")):
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
