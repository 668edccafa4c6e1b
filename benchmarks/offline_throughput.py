"""Offline throughput (the nano-vllm workload): many requests submitted at once, tokens per second.

    python benchmarks/offline_throughput.py --scale 0.05                       # CPU: 13 requests, lengths 5-51
    python benchmarks/offline_throughput.py --engines infer,hf --scale 0.05 --out /tmp/ot
    python benchmarks/offline_throughput.py --model /path/qwen3-0.6b --device cuda --max-num-seqs 256 \\
        --engines infer,hf,hf-compiled,hf-cb --infer-configs "batching=none;batching=continuous" \\
        --out benchmarks/runs/offline_qwen3-0.6b.json --plot benchmarks/runs/offline_qwen3-0.6b.png

Workload (nano-vllm's ``bench.py``): ``--num-requests`` requests (256); request i has a prompt
of ``randint(min_len, max_len)`` random token ids, each ``randint(0, token_max)`` (0-10000,
capped at vocab - 1), and asks for ``randint(min_output_len, max_output_len)`` tokens
(lengths 100-1024 both) with ``ignore_eos``. The draws come from ``random.Random(seed)`` in
nano-vllm's order (every prompt, then every output length), so at scale 1 and seed 0 the
requests are exactly nano-vllm's. ``--scale S`` multiplies the request count and all four
length bounds by S (``--scale 0.1``: 26 requests, lengths 10-102); explicit
``--num-requests``/``--min-len``/``--max-len``/``--min-output-len``/``--max-output-len``
override the scaled values. Sampling: ``--temperature`` 0.6 as in nano-vllm (0 = greedy);
with ``ignore_eos`` the token counts, hence the work, do not depend on it.

All requests are submitted at once and the wall time runs from the submission to the last
answer. Output tok/s = generated tokens asked for / wall time; total tok/s = (prompt +
output tokens) / wall time (nano-vllm's "Throughput" is the output figure). Per request:
TTFT (submission to first token), E2E (submission to its result), TPOT ((E2E - TTFT) /
(tokens - 1), or the batch's step time for padded HF batches). MFU = 2 x matmul params x
(prompt + output tokens) + causal attention FLOPs, over wall time x the measured matmul rate.
A warm-up (the first 4 requests cut to 16 prompt and 4 output tokens; untimed) runs first for every
engine.

Engines (``--engines``, comma separated; several in one run so ratios come from one run):

* ``infer``: ``LLM.generate`` on all requests. Every EngineConfig field is a flag (below);
  ``--infer-configs "batching=none;batching=continuous"`` runs one infer per ``;``-separated
  item, each a ``,``-separated list of ``field=value`` applied on top of the flags (``none``
  means None for a non-string field; ``true``/``false`` for booleans). ``max_model_len``
  defaults to the workload's longest prompt + output (not the model's context), so the KV
  cache is sized for the workload.
* ``hf``: HF transformers ``generate`` (default config: dynamic cache, eager) on the same
  weights and dtype, in order, in left-padded batches of ``--hf-batch-size`` requests (default:
  ``--max-num-seqs``, the same concurrency as infer). A batch runs until its longest output
  (``max_new_tokens = min_new_tokens`` = the batch's largest ask); only each request's own
  asked tokens count as output, the rest is reported as ``padding_waste_tokens``.
* ``hf-compiled`` (or ``--hf-compile``): the same with ``cache_implementation="static"``, with
  which transformers compiles its decode step (GPU only; skipped on the CPU). The static
  cache is sized once for the whole workload and the last batch is padded to full size with
  dummy rows (not counted), so one compile serves every batch.
* ``hf-cb``: transformers' continuous batching (the manager behind ``generate_batch``; per-request
  ``max_new_tokens``, EOS disabled), when the installed version has it.

Output: the Markdown table on stdout; the JSON report (commit, every EngineConfig, model, dtype,
hardware, versions, workload and seed, ceilings, every figure and every request) in ``--out X.json``
(default ``benchmarks/runs/offline_throughput.json``) and the table in ``X.md`` beside it; ``--out DIR``
(no ``.json``) writes ``DIR/offline_throughput.{json,md,png}``; ``--plot X.png`` a bar chart of output
tok/s per engine/config. Method: docs/contributing.md.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import (
    ceilings,
    environment,
    free_device_memory,
    infer_label,
    load_hf,
    make_llm,
    markdown_table,
    model_info,
    out_argument,
    parse_infer_configs,
    percentiles_ms,
    plot_throughput,
    sync,
    write_report,
)
from tqdm.auto import tqdm
from workloads import DEFAULT_TOKEN_MAX, Workload, build_workload, scaled_sizes, warmup_workload

ENGINES = ("infer", "hf", "hf-compiled", "hf-cb")

# ---------------------------------------------------------------------------------- model facts


def workload_flops(model_config, wl: Workload) -> float:
    """FLOPs the workload needs at least: 2 x matmul params per token + causal attention (QK and PV).
    For an MoE model the params are a token's *active* ones (its top-k experts, the router)."""
    params = model_config.num_params(active=True)
    if not model_config.tie_word_embeddings:
        params -= model_config.vocab_size * model_config.hidden_size  # input embeddings: a lookup
    dense = 2 * params * (wl.prompt_tokens + wl.output_tokens)
    per_pair = 4 * model_config.num_layers * model_config.num_heads * model_config.head_dim
    attn = sum(per_pair * t * (t + 1) / 2 for t in (len(p) + o for p, o in zip(wl.prompts, wl.output_lens)))
    return float(dense + attn)


# ---------------------------------------------------------------------------------- results


def summarize(engine: str, label: str, wl: Workload, wall: float, tokens: list[int], ttft: list[float | None],
              e2e: list[float | None], tpot: list[float | None], generated: int | None = None,
              extra: dict | None = None) -> dict[str, Any]:
    """One engine's figures: throughputs, latency percentiles, per-request records."""
    useful = sum(min(t, o) for t, o in zip(tokens, wl.output_lens))
    mismatched = [i for i, (t, o) in enumerate(zip(tokens, wl.output_lens)) if t != o]
    res: dict[str, Any] = {
        "engine": engine,
        "label": label,
        "wall_s": wall,
        "num_requests": wl.num_requests,
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": useful,
        "generated_tokens": useful if generated is None else generated,
        "padding_waste_tokens": 0 if generated is None else generated - useful,
        "output_tok_per_s": useful / wall,
        "total_tok_per_s": (wl.prompt_tokens + useful) / wall,
        "req_per_s": wl.num_requests / wall,
        "tokens_ok": not mismatched,
        "mismatched_requests": mismatched,
    }
    res.update(percentiles_ms(ttft, "ttft"))
    res.update(percentiles_ms(tpot, "tpot"))
    res.update(percentiles_ms(e2e, "e2e"))
    res.update(extra or {})
    res["requests"] = [
        {"prompt_len": len(p), "output_len": o, "tokens": t,
         "ttft_ms": None if a is None else 1e3 * a, "tpot_ms": None if c is None else 1e3 * c,
         "e2e_ms": None if b is None else 1e3 * b}
        for p, o, t, a, b, c in zip(wl.prompts, wl.output_lens, tokens, ttft, e2e, tpot)
    ]
    return res


# ---------------------------------------------------------------------------------- infer


class _AnnouncingList(list):
    """A list of results that prints each one's headline as it lands (a run cut short by a time
    limit still leaves its finished numbers in the log)."""

    def append(self, r: dict[str, Any]) -> None:
        super().append(r)
        print(f"{r['label']}: {r['output_tok_per_s']:.1f} output tok/s, {r['total_tok_per_s']:.1f} total tok/s, "
              f"wall {r['wall_s']:.1f} s", flush=True)


def run_infer(llm, wl: Workload, temperature: float, progress: bool = True, warmup: bool = True,
              label: str = "infer") -> dict[str, Any]:
    """All of ``wl`` through ``llm.generate`` at once; per-request times from ``out.metrics``."""
    from infer import SamplingParams

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature)

    device = llm.config.resolved_device()
    if warmup:
        w = warmup_workload(wl)
        llm.generate(w.prompts, [params(o) for o in w.output_lens], use_tqdm=False)
    sps = [params(o) for o in wl.output_lens]
    llm.engine.reset_prefix_cache()  # prefix caching: the timed run must not hit the warm-up's blocks
    llm.engine.scheduler.reset_stats()
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, sps, use_tqdm=progress)
    sync(device)
    wall = time.perf_counter() - t0
    tokens, ttft, e2e, tpot = [], [], [], []
    for out in outs:
        n = len(out.outputs[0].token_ids)
        m = out.metrics
        start = m.get("arrival", t0)
        first, fin = m.get("first_token"), m.get("finished")
        tokens.append(n)
        ttft.append(None if first is None else first - start)
        e2e.append(None if fin is None else fin - start)
        tpot.append((fin - first) / (n - 1) if first is not None and fin is not None and n > 1 else None)
    # steps, preemptions, widest batch, KV utilization, cache size
    return summarize("infer", label, wl, wall, tokens, ttft, e2e, tpot, extra=llm.engine.stats())


# ---------------------------------------------------------------------------------- HF transformers


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token of a batch arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:  # the 1st call is the prompt, the 2nd the first new token (already on CPU)
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _hf_sampling(temperature: float) -> dict[str, Any]:
    """HF ``GenerationConfig`` sampling fields: greedy at temperature 0, else plain temperature sampling
    (no top-k, no top-p), as infer samples."""
    if temperature > 0:
        return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    return dict(do_sample=False)


def _hf_generation_config(temperature: float, max_new: int, pad_id: int, compiled: bool, max_cache_len: int | None):
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id,
                           **_hf_sampling(temperature))
    if compiled:
        cfg.cache_implementation = "static"
        if max_cache_len is not None:
            cfg.max_cache_len = max_cache_len  # transformers >= 5.2x: one static cache size for every call
    return cfg


def hf_static_cache_len(wl: Workload, batch_size: int) -> int:
    """The static cache length that holds every padded batch: widest prompt + largest ask, over batches."""
    n = wl.num_requests
    return max(max(len(p) for p in wl.prompts[i:i + batch_size]) + max(wl.output_lens[i:i + batch_size])
               for i in range(0, n, batch_size))


def hf_padded_batches(model, wl: Workload, batch_size: int, temperature: float = 0.0, compiled: bool = False,
                      pad_id: int = 0, progress: bool = False, label: str = "hf") -> dict[str, Any]:
    """``model.generate`` over ``wl`` in submission order, ``batch_size`` left-padded requests at a time.

    Each batch generates ``max_new_tokens = min_new_tokens =`` its largest ask; a request's
    output tokens are its own ask (the rest of its row is padding waste). With ``compiled``
    the last batch is filled with dummy rows (copies of its first request; not counted) so
    that every batch has the same shape.
    """
    device = next(model.parameters()).device
    n = wl.num_requests
    tokens, ttft, e2e, tpot = [0] * n, [None] * n, [None] * n, [None] * n
    generated = 0
    chunks = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
    max_cache_len = hf_static_cache_len(wl, batch_size) if compiled else None
    if compiled:  # older transformers ignore GenerationConfig.max_cache_len but keep the largest size seen
        model._previous_max_cache_length = max(getattr(model, "_previous_max_cache_length", -1), max_cache_len)
    bar = tqdm(total=n, desc=label, unit="req", disable=not progress)
    sync(device)
    t0 = time.perf_counter()
    for chunk in chunks:
        rows = [wl.prompts[i] for i in chunk]
        if compiled and len(rows) < batch_size:
            rows = rows + [rows[0]] * (batch_size - len(rows))
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, width - len(r):] = torch.tensor(r)
            mask[j, width - len(r):] = 1
        max_new = max(wl.output_lens[i] for i in chunk)
        cfg = _hf_generation_config(temperature, max_new, pad_id, compiled, max_cache_len)
        clock = _FirstTokenClock()
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=cfg,
                                 streamer=clock)
        sync(device)
        end = time.perf_counter()
        new = out.shape[1] - width
        generated += new * len(chunk)
        for i in chunk:
            tokens[i] = min(new, wl.output_lens[i])
            ttft[i] = None if clock.first is None else clock.first - t0
            e2e[i] = end - t0
            tpot[i] = (end - clock.first) / (new - 1) if clock.first is not None and new > 1 else None
        bar.update(len(chunk))
    bar.close()
    wall = time.perf_counter() - t0
    return summarize("hf-compiled" if compiled else "hf", label, wl, wall, tokens, ttft, e2e, tpot,
                     generated=generated, extra={"hf_batch_size": batch_size, "hf_batches": len(chunks)})


def run_hf(model, wl: Workload, batch_size: int, temperature: float, compiled: bool, pad_id: int,
           progress: bool = True, warmup: bool = True) -> dict[str, Any]:
    label = "hf-compiled" if compiled else "hf"
    if warmup:
        w = warmup_workload(wl)
        if compiled:  # the timed batches' shape: batch_size rows, the workload-wide static cache
            w = Workload((w.prompts * batch_size)[:batch_size], (w.output_lens * batch_size)[:batch_size], w.params)
            model._previous_max_cache_length = hf_static_cache_len(wl, batch_size)
        hf_padded_batches(model, w, batch_size, temperature, compiled, pad_id, progress=False)
        if compiled:  # a second pass: the first may still be compiling
            hf_padded_batches(model, w, batch_size, temperature, compiled, pad_id, progress=False)
    return hf_padded_batches(model, wl, batch_size, temperature, compiled, pad_id, progress, label)


def hf_cb_available(model) -> bool:
    """Whether this transformers has continuous batching (``generate_batch`` and a manager)."""
    return hasattr(model, "generate_batch") and (
        hasattr(model, "continuous_batching_context_manager") or hasattr(model, "init_continuous_batching"))


@contextlib.contextmanager
def hf_cb_manager(model, **kwargs):
    """transformers' continuous-batching manager, started, and stopped on exit.

    Newer transformers have ``continuous_batching_context_manager``; older ones (5.17, the GPU
    image's) only ``init_continuous_batching`` + ``start``/``stop``. Keyword arguments that the
    installed version does not accept (``workload_hints``) are dropped.
    """
    import inspect

    has_cm = hasattr(model, "continuous_batching_context_manager")
    factory = model.continuous_batching_context_manager if has_cm else model.init_continuous_batching
    accepts = set(inspect.signature(factory).parameters)
    kwargs = {k: v for k, v in kwargs.items() if k in accepts}
    if has_cm:
        with factory(**kwargs) as man:
            yield man
        return
    man = factory(**kwargs)
    man.start()
    try:
        yield man
    finally:
        man.stop(block=True)


#: tokens per page of transformers' continuous-batching cache (``ContinuousBatchingConfig.page_size``'s default)
HF_CB_PAGE_SIZE = 256


def hf_cb_blocks_for(wl: Workload, page_size: int = HF_CB_PAGE_SIZE) -> int:
    """The cache blocks (of ``page_size`` tokens, every layer) that hold all of ``wl``'s requests at once:
    each request's prompt + output tokens, rounded up to whole pages. What :func:`run_hf_cb` is given on a
    CPU, where transformers would otherwise take 60% of the free RAM."""
    return sum(-(-(len(p) + o) // page_size) for p, o in zip(wl.prompts, wl.output_lens))


def run_hf_cb(model, wl: Workload, temperature: float, progress: bool = True, warmup: bool = True,
              timeout_s: float = 3600, num_blocks: int | None = None,
              max_batch_tokens: int | None = None) -> dict[str, Any]:
    """transformers' continuous batching: one manager, every request added at once with its own ask.

    ``num_blocks`` (blocks of 256 tokens for every layer, :func:`hf_cb_blocks_for`) and ``max_batch_tokens``
    bound its paged cache; left ``None``, transformers sizes the cache from free memory: on a CPU 60% of
    the available RAM, allocated up front (about 14 GB of a 23 GB machine, even for a tiny model). They
    are passed through ``ContinuousBatchingConfig`` where the installed transformers has it and ignored
    otherwise.
    """
    import inspect

    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max(wl.output_lens), eos_token_id=-1, **_hf_sampling(temperature))
    cm_kwargs: dict[str, Any] = {"generation_config": cfg}
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        cm_kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(len(p) for p in wl.prompts),
                                                    max_generated_length=max(wl.output_lens),
                                                    num_requests=wl.num_requests)
    except ImportError:
        pass
    if num_blocks is not None or max_batch_tokens is not None:
        try:
            from transformers import ContinuousBatchingConfig

            cm_kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
                num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
        except ImportError:
            pass
    device = next(model.parameters()).device
    with hf_cb_manager(model, **cm_kwargs) as man:
        accepts = set(inspect.signature(man.add_request).parameters)
        extra = {k: v for k, v in (("eos_token_id", -1), ("record_timestamps", True)) if k in accepts}

        def run(w: Workload, bar) -> tuple[float, dict[str, Any]]:
            ids = [f"r{time.perf_counter_ns()}-{i}" for i in range(w.num_requests)]
            t0 = time.perf_counter()
            for rid, p, o in zip(ids, w.prompts, w.output_lens):
                man.add_request(list(p), request_id=rid, max_new_tokens=o, **extra)
            results: dict[str, Any] = {}
            deadline = t0 + timeout_s
            while len(results) < len(ids):
                r = man.get_result(timeout=0.5)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                    if bar is not None:
                        bar.update(1)
                elif r is None and (not man.is_running() or time.perf_counter() > deadline):
                    break
            sync(device)
            return t0, {rid: results.get(rid) for rid in ids}

        if warmup:
            run(warmup_workload(wl), None)
        bar = tqdm(total=wl.num_requests, desc="hf-cb", unit="req", disable=not progress)
        t0, results = run(wl, bar)
        wall = time.perf_counter() - t0
        bar.close()
    n = wl.num_requests
    tokens, ttft, e2e, tpot, errors = [0] * n, [None] * n, [None] * n, [None] * n, []
    for i, r in enumerate(results.values()):
        if r is None or r.error is not None:
            errors.append(f"request {i}: " + ("no result" if r is None else str(r.error)))
            continue
        k = len(r.generated_tokens)
        tokens[i] = k
        fin = r.lifespan[1] if r.lifespan and r.lifespan[1] > 0 else None
        first = r.timestamps[0] if getattr(r, "timestamps", None) else None
        ttft[i] = None if first is None else first - t0
        e2e[i] = None if fin is None else fin - t0
        tpot[i] = (fin - first) / (k - 1) if fin is not None and first is not None and k > 1 else None
    return summarize("hf-cb", "hf-cb", wl, wall, tokens, ttft, e2e, tpot, extra={"errors": errors[:20]})


# ---------------------------------------------------------------------------------- report


COLUMNS = ["label", "output_tok_per_s", "total_tok_per_s", "req_per_s", "wall_s", "ttft_p50_ms", "ttft_p99_ms",
           "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "mfu", "max_running_seqs", "mean_running_seqs", "num_preemptions",
           "mean_kv_utilization", "tokens_ok", "speedup"]


def build_parser() -> argparse.ArgumentParser:
    from infer.config import add_engine_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b = ap.add_argument_group("benchmark")
    b.add_argument("--engines", "--engine", default="infer",
                   help=f"comma-separated, from {', '.join(ENGINES)} (default: infer)")
    b.add_argument("--infer-configs", default=None,
                   help='";"-separated infer configurations, each a ","-separated list of field=value on top of '
                        'the engine flags, e.g. "batching=none;batching=continuous,max_num_seqs=64" (default: one, '
                        "the flags as given)")
    b.add_argument("--hf-batch-size", type=int, default=None,
                   help="requests per padded HF generate() batch (default: --max-num-seqs)")
    b.add_argument("--hf-compile", action="store_true", help="also run hf-compiled (same as adding it to --engines)")
    w = ap.add_argument_group("workload")
    w.add_argument("--scale", type=float, default=1.0,
                   help="multiply the request count and the length bounds (default 1: 256 requests, 100-1024)")
    w.add_argument("--num-requests", type=int, default=None, help="requests (default: 256 x scale)")
    w.add_argument("--min-len", type=int, default=None, help="shortest prompt (default: 100 x scale)")
    w.add_argument("--max-len", type=int, default=None, help="longest prompt (default: 1024 x scale)")
    w.add_argument("--min-output-len", type=int, default=None, help="smallest ask (default: --min-len)")
    w.add_argument("--max-output-len", type=int, default=None, help="largest ask (default: --max-len)")
    w.add_argument("--token-max", type=int, default=DEFAULT_TOKEN_MAX,
                   help="prompt token ids are uniform in [0, token-max] (capped at vocab - 1; default: 10000)")
    w.add_argument("--workload-seed", type=int, default=0, help="seed of the requests (default: 0, nano-vllm's)")
    w.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default: 0.6, nano-vllm's; "
                                                                  "0 = greedy)")
    r = ap.add_argument_group("run")
    r.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up")
    r.add_argument("--no-ceilings", dest="ceilings", action="store_false",
                   help="do not measure bandwidth / matmul ceilings (ablate.py measures them once instead)")
    out_argument(r, "offline_throughput.json", "report: X.json (and X.md), or a directory (offline_throughput.*)")
    r.add_argument("--plot", default=None, help="PNG bar chart of tok/s per engine/config")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_engine_args(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    from infer.config import EngineConfig, engine_config_from_args

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.hf_compile and "hf-compiled" not in engines:
        engines.append("hf-compiled")
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        ap.error(f"unknown engine(s) {bad}; choose from {', '.join(ENGINES)}")
    try:
        infer_configs = parse_infer_configs(args.infer_configs)
        sizes = scaled_sizes(args.scale, args.num_requests, args.min_len, args.max_len, args.min_output_len,
                             args.max_output_len)
    except ValueError as e:
        ap.error(str(e))
    base = engine_config_from_args(args)
    device = str(base.resolved_device())
    dtype = base.resolved_dtype()
    progress = not args.no_progress
    path, mcfg = model_info(base.model)
    wl = build_workload(sizes["num_requests"], sizes["min_len"], sizes["max_len"], mcfg.vocab_size,
                        args.workload_seed, sizes["min_output_len"], sizes["max_output_len"], args.token_max)
    wl.params.update(scale=args.scale, temperature=args.temperature, prompt_tokens=wl.prompt_tokens,
                     output_tokens=wl.output_tokens,
                     nano_vllm_identical=(args.scale == 1 and args.workload_seed == 0 and args.token_max == 10000
                                          and not any((args.num_requests, args.min_len, args.max_len,
                                                       args.min_output_len, args.max_output_len))
                                          and mcfg.vocab_size > DEFAULT_TOKEN_MAX))
    print(f"{path.name}: {wl.num_requests} requests, prompts {sizes['min_len']}-{sizes['max_len']}, outputs "
          f"{sizes['min_output_len']}-{sizes['max_output_len']} ({wl.prompt_tokens} + {wl.output_tokens} tokens), "
          f"seed {args.workload_seed}, temperature {args.temperature:g}; {device} {str(dtype).replace('torch.', '')}",
          flush=True)
    ceil = None
    if args.ceilings:
        print(f"measuring ceilings on {device} ...", flush=True)
        ceil = ceilings(device, quick=torch.device(device).type == "cpu")
        free_device_memory()  # the engines size their KV cache from the memory left
    flops = workload_flops(mcfg, wl)

    results = _AnnouncingList()
    skipped: list[dict[str, str]] = []
    engine_configs: dict[str, Any] = {}
    if "infer" in engines:
        for ov in infer_configs:
            label = infer_label(ov)
            kw = {**base.to_dict(), **ov}
            if kw.get("max_model_len") is None:
                kw["max_model_len"] = wl.max_seq_len  # the KV cache sized for the workload
            try:
                EngineConfig.from_kwargs(**kw).validate()
            except (TypeError, ValueError) as e:
                print(f"{label}: skipped: {e}", flush=True)
                skipped.append({"label": label, "reason": str(e)})
                continue
            print(f"{label}: loading ...", flush=True)
            llm = make_llm(base.model, kw, wl.max_seq_len, progress)
            engine_configs[label] = llm.config.to_dict() | {"resolved_max_model_len": llm.engine.max_model_len}
            print(f"{label}: running ...", flush=True)
            results.append(run_infer(llm, wl, args.temperature, progress, args.warmup, label))
            del llm
            free_device_memory()
    hf_engines = [e for e in engines if e.startswith("hf")]
    if hf_engines:
        batch = args.hf_batch_size or base.max_num_seqs
        print(f"HF transformers: loading {path} ...", flush=True)
        hf = load_hf(path, device, dtype)
        pad_id = 0
        for e in hf_engines:
            if e == "hf-compiled" and torch.device(device).type != "cuda":
                msg = "HF compiled (static cache + torch.compile) runs on a GPU only"
                print(f"{e}: skipped: {msg}", flush=True)
                skipped.append({"label": e, "reason": msg})
                continue
            if e == "hf-cb" and not hf_cb_available(hf):
                import transformers

                msg = f"transformers {transformers.__version__} has no continuous batching (generate_batch)"
                print(f"{e}: skipped: {msg}", flush=True)
                skipped.append({"label": e, "reason": msg})
                continue
            print(f"{e}: running ...", flush=True)
            if e == "hf-cb":  # on a CPU with a cache just big enough for the workload (else 60% of the RAM)
                blocks = hf_cb_blocks_for(wl) if torch.device(device).type == "cpu" else None
                results.append(run_hf_cb(hf, wl, args.temperature, progress, args.warmup, num_blocks=blocks))
            else:
                results.append(run_hf(hf, wl, batch, args.temperature, e == "hf-compiled", pad_id, progress,
                                      args.warmup))
            engine_configs[e] = {"batch_size": batch if e != "hf-cb" else None, "dtype": str(dtype),
                                 "attn_implementation": getattr(hf.config, "_attn_implementation", None),
                                 "cache": {"hf": "dynamic", "hf-compiled": "static + torch.compile",
                                           "hf-cb": "paged (continuous batching)"}[e]}
            free_device_memory()
        del hf
        free_device_memory()

    base_row = next((r for r in results if r["engine"] == "hf"), results[0] if results else None)
    columns = COLUMNS + (["prefix_cache_hit_rate"] if any("prefix_cache_hit_rate" in r for r in results) else [])
    columns += [c for c in ("kv_offload_hit_tokens", "kv_offload_host_hits", "kv_offload_disk_hits")
                if any(c in r for r in results)]  # phase 10: tokens and blocks restored from the tiers
    rows = []
    for r in results:
        r["mfu"] = flops / r["wall_s"] / (ceil["matmul_tflops"] * 1e12) if ceil else None
        r["speedup"] = r["output_tok_per_s"] / base_row["output_tok_per_s"]
        rows.append({c: ("" if r.get(c) is None else r.get(c)) for c in columns})
    report = {
        "benchmark": "offline_throughput",
        "env": environment(device),
        "model": str(path),
        "dtype": str(dtype),
        "device": device,
        "engine_config": base.to_dict(),
        "engine_configs": engine_configs,
        "engines": engines,
        "workload": wl.params,
        "workload_flops": flops,
        "ceilings": ceil,
        "baseline": base_row["label"] if base_row else None,
        "results": results,
        "skipped": skipped,
        "rows": rows,
    }
    head = (f"offline throughput: {path.name} ({str(dtype).replace('torch.', '')}, {device}), {wl.num_requests} "
            f"requests, prompts {sizes['min_len']}-{sizes['max_len']}, outputs {sizes['min_output_len']}-"
            f"{sizes['max_output_len']}, seed {args.workload_seed}, temperature {args.temperature:g}; speedup = "
            f"output tok/s vs {report['baseline']}\n\n")
    table = head + markdown_table(rows, columns)
    if skipped:
        table += "\n\n" + "\n".join(f"skipped {s['label']}: {s['reason']}" for s in skipped)
    if ceil:
        table += (f"\n\nceilings: {ceil['bandwidth_gb_s']:.0f} GB/s copy, {ceil['matmul_tflops']:.3g} TFLOP/s "
                  f"{ceil['matmul_dtype']} matmul; {report['env'].get('gpu') or report['env']['cpu']}")
    out, plot = args.out, args.plot
    if out and not out.endswith(".json"):
        plot = plot or str(Path(out) / "offline_throughput.png")
        out = str(Path(out) / "offline_throughput.json")
    write_report(report, out, table)
    if plot and rows:
        plot_throughput(results, plot, f"{path.name}: offline throughput, {wl.num_requests} requests "
                                       f"(commit {report['env']['commit']})")
    ok = all(r["tokens_ok"] for r in results)
    if not ok:
        print("warning: some requests did not produce the tokens asked for (see mismatched_requests)")
    return 0 if ok and results else 1


if __name__ == "__main__":
    raise SystemExit(main())
