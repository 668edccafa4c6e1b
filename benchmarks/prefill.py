"""Where a long prefill's time goes: TTFT against the matmul peak, per kernel, and attention against SDPA.

    python benchmarks/prefill.py                                           # smollm2-135m on this CPU, tiny lengths
    python benchmarks/prefill.py --model /tmp/ck/qwen3-4b --device cuda --prompt-lens 2048 8192 32768 \\
        --engine-args optimize=true --out benchmarks/runs/prefill.json --plot benchmarks/runs/prefill.png
    TRITON_INTERPRET=1 python benchmarks/prefill.py --device cpu --prompt-lens 32 64   # also the Triton kernel, CPU

A prefill is compute-bound: ``2 x (linear weights) x T`` FLOPs for the projections plus the causal
attention's ``4 x heads x head_dim x (visible query-key pairs)``; at 2k tokens on Qwen3-4B that is
~17 TFLOP, ~20 ms at an H100's matmul rate. So its time is judged against the matmul rate, measured in
the same run. For each prompt length ``T`` (``--prompt-lens``) the program measures:

1. **Ceilings.** The bf16 rate of an 8192^3 matmul (``common.ceilings``: the *peak*), and the *GEMM
   ceiling* of this model at ``M = T``: every ``nn.Linear`` of the decoder (q/k/v/o or the fused qkv,
   gate/up or gate_up, down; the LM head is left out, a prefill runs it on one row), each distinct
   shape timed alone with ``F.linear`` on its own weight, summed over the layers: what cuBLAS reaches on
   exactly these products, the best the projections of a prefill can do.
2. **TTFT alone** through the engine (``common.ttft_alone``: one greedy request, ``max_tokens=1``, the
   device idle before it; a fresh random prompt each time, so a prefix cache never hits), median of
   ``--repeats`` after one warm-up, with the prefill's model FLOPs (:func:`prefill_flops`, from the
   engine's ``ModelConfig``): achieved TFLOP/s and its fraction of the peak (``ttft_mfu``; the issue's
   criterion is >= 0.65 at 2,048 tokens on Qwen3-4B). ``max_num_batched_tokens`` is raised to the
   longest prompt unless ``--engine-args`` sets it, so each prompt is ONE prefill step; the report
   says how many steps it took (more than one: chunked by the user's budget, whose steps run their GEMMs
   at ``M`` = the budget, not at the GEMM ceiling's ``M = T``). Beside it, from a step
   trace (``LLMEngine.set_tracer``, :mod:`infer.engine.step_trace`): the prefill step's host work
   (``host_ms``: schedule + outputs; ``launch_ms``: inputs built and the forward and sampling launched,
   on a CPU run) and its span on the device (``device_ms``, CUDA events); ``ttft_minus_device_ms``, what
   the TTFT adds to that span (host work not overlapped, the token's way back; under async scheduling the
   prefill's token is processed in the next step, whose host work this includes); and ``device_mfu``,
   the FLOP rate over the device span: what the kernels reach when the host is left out.
3. **Per-kernel breakdown** of one prefill step under ``torch.profiler`` (CUDA kernels on a GPU, CPU
   ops by self time on a CPU), grouped by :func:`kernel_category` into gemm / attention / norm, rope,
   activation / other Triton / other: each category's ms and share, and for the GEMMs and the attention
   their TFLOP/s and fraction of the peak (GEMMs against the GEMM ceiling too).
4. **Attention alone**, one layer at the model's heads, KV heads and head_dim: the Triton prefill
   kernel as the engine calls it (``paged_prefill_attention`` over a paged cache,
   ``benchmarks/paged_attention.py``'s ``prefill_row``) against PyTorch's
   ``scaled_dot_product_attention(is_causal=True)`` on contiguous inputs (FlashAttention on a GPU):
   ms, TFLOP/s and their ratio. Then the extend (suffix-after-prefix) case: 512 new tokens after a
   cached prefix of ``T - 512``, against SDPA with a lower-right causal mask
   (``torch.nn.attention.bias.causal_lower_right``: PyTorch runs it with its memory-efficient kernel;
   FlashAttention takes only ``q_len == kv_len`` there). On a CPU this part needs
   ``TRITON_INTERPRET=1`` (else it is left out, and the report says so).

Only dense attention models (Llama, Qwen3, Gemma 3 with its sliding windows): an MoE or a hybrid
model is refused with a ValueError (their FLOPs per token depend on routing or on a recurrence).
Writes the JSON report (commit, hardware, versions, EngineConfig, ceilings, every row) to ``--out``
(default ``benchmarks/runs/prefill.json``) and the Markdown tables beside it; ``--plot PNG`` draws, per
prompt length, the device time of the profiled step stacked by category, with the fraction of the
peak reached. On the CPU the numbers check the program, not the speed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
import torch.nn.functional as F
from common import (
    ceilings,
    engine_overrides,
    environment,
    make_llm,
    markdown_table,
    out_argument,
    print_row,
    resolve_device,
    sync,
    ttft_alone,
    write_report,
)

#: the kernel categories of the breakdown, in the plot's stacking order
CATEGORIES = ("gemm", "attention", "norm/rope/act", "other triton", "other")
#: extend case: new tokens after a cached prefix (``--extend-tokens``), on CUDA and on a CPU
GPU_EXTEND, CPU_EXTEND = 512, 16
GPU_LENS, CPU_LENS = [2048, 8192, 32768], [32, 64]


# ---------------------------------------------------------------------------------- FLOPs


def visible_pairs(num_tokens: int, prefix: int = 0, window: int | None = None) -> int:
    """(query, key) pairs a causal attention computes for ``num_tokens`` new queries after ``prefix``
    cached tokens: the query at position ``p`` (from 0) sees ``p + 1`` keys, or ``window`` of them in a
    sliding-window layer (the query's own included, as :class:`~infer.model_config.ModelConfig` says).

    Raises:
        ValueError: a negative count, or a window < 1.
    """
    if num_tokens < 0 or prefix < 0 or (window is not None and window < 1):
        raise ValueError(f"visible_pairs: num_tokens={num_tokens}, prefix={prefix}, window={window}")

    def upto(n: int) -> int:  # sum over p < n of min(p + 1, window)
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window

    return upto(prefix + num_tokens) - upto(prefix)


def linear_shapes(cfg) -> list[tuple[str, int, int]]:
    """The projections of one decoder layer as ``(name, in_features, out_features)``, unfused: q, k, v,
    o, gate, up, down (``ModelConfig`` of a dense attention model; q is twice as wide with
    ``attn_output_gate``).

    Raises:
        ValueError: an MoE or a hybrid (linear-attention) model.
    """
    if cfg.num_experts or cfg.is_hybrid:
        raise ValueError(f"prefill.py counts dense attention models only; {cfg.architecture} is "
                         f"{'an MoE' if cfg.num_experts else 'a hybrid'} model")
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q = cfg.num_heads * d * (2 if cfg.attn_output_gate else 1)
    kv = cfg.num_kv_heads * d
    return [("q", h, q), ("k", h, kv), ("v", h, kv), ("o", cfg.num_heads * d, h),
            ("gate", h, i), ("up", h, i), ("down", i, h)]


def prefill_flops(cfg, num_tokens: int, prefix: int = 0) -> dict[str, int]:
    """Model FLOPs of one sequence's prefill of ``num_tokens`` tokens after ``prefix`` cached ones.

    ``linear``: 2 x (every layer's projection weights) x ``num_tokens`` (a multiply-add is 2 FLOPs);
    ``attention``: per layer, QK^T and PV over the visible pairs (:func:`visible_pairs`, its window in
    a sliding layer): 2 matmuls x 2 FLOPs x ``num_heads x head_dim`` per pair; ``lm_head``: the last row
    only (2 x hidden x vocab); ``total``: their sum. Norms, RoPE, activations and the softmax's
    exponentials are left out (PaLM's MFU convention counts matmuls only).

    Raises:
        ValueError: :func:`linear_shapes`'s.
    """
    per_layer = sum(k * n for _, k, n in linear_shapes(cfg))
    linear = 2 * num_tokens * per_layer * cfg.num_layers
    attention = sum(4 * cfg.num_heads * cfg.head_dim * visible_pairs(num_tokens, prefix, cfg.window_of(layer))
                    for layer in range(cfg.num_layers))
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    return {"linear": linear, "attention": attention, "lm_head": lm_head, "total": linear + attention + lm_head}


def model_linears(model) -> list[tuple[str, torch.nn.Linear]]:
    """The decoder's ``nn.Linear`` modules as ``(qualified name, module)``, in order: every projection
    a prefill runs on all its rows (the LM head left out). After ``fused_kernels`` merged q/k/v and
    gate/up (``qkv_proj``, ``gate_up_proj``, whose ``part_rows`` list the parts, kept as views into
    the merged weight), the merged modules, not their parts: the products the fused forward runs."""
    parts = {id(p) for m in model.modules() for p, _, _ in getattr(m, "part_rows", ())}
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.split(".")[-1] != "lm_head" and id(m) not in parts]


# ---------------------------------------------------------------------------------- kernels


_ATTENTION = ("_paged_prefill_kernel", "_prefill_combine_kernel", "_paged_decode_kernel", "_merge_splits", "flash",
              "fmha", "attention", "sdpa")
_GEMM = ("gemm", "gemv", "cutlass", "sm90", "sm80", "nvjet", "ampere", "matmul", "cublas", "_quantized_",
         "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")
_NORM = ("rms_norm", "layer_norm", "rope", "rotary", "act_and_mul", "silu", "gelu", "aten::mul", "aten::rsqrt",
         "aten::pow", "aten::mean")


def kernel_category(name: str) -> str:
    """The category of a profiled kernel (CUDA) or op (CPU) by its name, first match wins: ``attention``
    (our Triton prefill/decode kernels, FlashAttention, SDPA; checked first, as FlashAttention's
    template names contain ``cutlass``), ``gemm`` (cuBLAS/cuBLASLt/CUTLASS: ``sm90_xmma_gemm_*``,
    ``nvjet_*``, ``ampere_*``; ``aten::mm``/``addmm`` on a CPU), ``norm/rope/act`` (our fused Triton
    RMSNorm, QK-norm + RoPE and SiLU-and-mul kernels, or the ops they replace), ``other triton`` (any
    other ``_..._kernel``: the KV-cache write, sampling, ...) and ``other`` (elementwise, copies)."""
    low = name.lower()
    for cat, keys in (("attention", _ATTENTION), ("gemm", _GEMM), ("norm/rope/act", _NORM)):
        if any(k in low for k in keys):
            return cat
    if low.startswith("_") and low.endswith("_kernel") or low.startswith("triton_"):
        return "other triton"
    return "other"


def kernel_times(prof, cuda: bool) -> list[dict[str, Any]]:
    """``[{name, category, calls, ms}]`` of a finished profiler, longest first: CUDA kernels by device
    time, or on a CPU the ops by self CPU time (which never counts a nested op twice)."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    if not events:
        return []
    if cuda:
        attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        chosen = [e for e in events if e.device_type == DeviceType.CUDA and getattr(e, attr, 0.0) > 0]
    else:
        attr = "self_cpu_time_total"
        chosen = [e for e in events if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0]
    rows = [{"name": e.key, "category": kernel_category(e.key), "calls": e.count, "ms": getattr(e, attr) / 1e3}
            for e in chosen if not e.key.startswith(("ProfilerStep", "## "))]
    return sorted(rows, key=lambda r: -r["ms"])


def breakdown(kernels: list[dict[str, Any]], flops: dict[str, int], peak: float, gemm_tflops: float | None) -> dict:
    """Per category: ms, share of the busy time; for ``gemm`` (the projections + the LM head's row) and
    ``attention``, TFLOP/s and the fraction of ``peak`` (and of the GEMM ceiling ``gemm_tflops``)."""
    busy = sum(k["ms"] for k in kernels)
    out: dict[str, Any] = {"busy_ms": busy}
    for cat in CATEGORIES:
        ms = sum(k["ms"] for k in kernels if k["category"] == cat)
        out[f"{cat}_ms"] = ms
        out[f"{cat}_share"] = ms / busy if busy else None
    for cat, f in (("gemm", flops["linear"] + flops["lm_head"]), ("attention", flops["attention"])):
        ms = out[f"{cat}_ms"]
        tflops = f / (ms / 1e3) / 1e12 if ms else None
        out[f"{cat}_tflops"] = tflops
        out[f"{cat}_frac_peak"] = tflops / peak if tflops else None
    if gemm_tflops and out["gemm_tflops"]:
        out["gemm_frac_ceiling"] = out["gemm_tflops"] / gemm_tflops
    return out


# ---------------------------------------------------------------------------------- measurements


def bench(fn, device: torch.device) -> float:
    """:func:`common.bench`; on the CPU the median of 3 calls after one warm-up."""
    return common.bench(fn, device, cpu_repeats=3, cpu_warmup=1)


def gemm_ceiling(model, num_tokens: int, device: torch.device) -> dict[str, Any]:
    """The rate cuBLAS reaches on this model's projections at ``M = num_tokens``: each distinct
    ``(in, out, weight layout)`` of :func:`model_linears` timed alone with ``F.linear`` on a random
    ``[M, in]`` input and the module's own weight and bias, times the modules of that shape."""
    groups: dict[tuple, list] = {}
    for name, lin in model_linears(model):
        key = (lin.in_features, lin.out_features, tuple(lin.weight.stride()), lin.bias is not None)
        groups.setdefault(key, [0, lin, name.split(".")[-1]])[0] += 1
    shapes, total_s, total_flops = [], 0.0, 0
    for (k, n, _, _), (count, lin, name) in groups.items():
        x = torch.randn(num_tokens, k, device=device, dtype=lin.weight.dtype)
        t = bench(lambda x=x, lin=lin: F.linear(x, lin.weight, lin.bias), device)
        flops = 2 * num_tokens * k * n
        shapes.append({"name": name, "m": num_tokens, "k": k, "n": n, "count": count, "ms": 1e3 * t,
                       "tflops": flops / t / 1e12})
        total_s += count * t
        total_flops += count * flops
    return {"ms": 1e3 * total_s, "tflops": total_flops / total_s / 1e12 if total_s else None,
            "flops": total_flops, "shapes": shapes}


def prefill_steps(tracer) -> list[dict[str, Any]]:
    """The prefill steps of a step trace (``args`` of its ``prefill``/``mixed`` step events)."""
    return [e["args"] for e in tracer.trace_events()
            if e.get("ph") == "X" and "prefill_tokens" in e.get("args", {}) and e["args"]["prefill_tokens"] > 0]


def measure_ttft(engine, num_tokens: int, repeats: int, vocab: int, rng: random.Random) -> dict[str, Any]:
    """Median TTFT of a ``num_tokens`` prompt alone (after one untimed warm-up), each repeat a fresh
    random prompt, and its prefill steps' host and device times from a step trace."""
    from infer.engine.step_trace import StepRecorder

    def prompt():
        return [rng.randrange(100, vocab - 100) for _ in range(num_tokens)]

    ttft_alone(engine, prompt())  # compiles/loads what this shape needs
    tracer = StepRecorder(None, cuda=engine.runner.device.type == "cuda", budget=engine.scheduler.max_num_batched_tokens)
    engine.set_tracer(tracer)
    ttfts, steps = [], []
    try:
        for _ in range(repeats):
            tracer.clear()
            ttfts.append(ttft_alone(engine, prompt()))
            steps.append(prefill_steps(tracer))
    finally:
        engine.set_tracer(None)

    def med(key):
        vals = [sum(s[key] for s in rep) for rep in steps if rep and all(s.get(key) is not None for s in rep)]
        return statistics.median(vals) if vals else None

    first = steps[0][0] if steps and steps[0] else {}
    return {"ttft_ms": 1e3 * statistics.median(ttfts), "ttft_min_ms": 1e3 * min(ttfts),
            "prefill_steps": statistics.median(len(s) for s in steps), "graph": first.get("graph"),
            "host_ms": med("host_ms"), "launch_ms": med("forward_ms"), "device_ms": med("device_ms")}


def profile_prefill(engine, num_tokens: int, vocab: int, rng: random.Random) -> list[dict[str, Any]]:
    """The kernels (CUDA) or ops (CPU) of one prompt's prefill under ``torch.profiler``: the steps
    that schedule its chunks (one, unless chunked), the device synchronized before the profiler stops;
    the rest (under async scheduling, a decode step already launched) runs afterwards, unprofiled."""
    from infer.sampling import SamplingParams

    device = engine.runner.device
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    budget = engine.scheduler.max_num_batched_tokens
    prompt = [rng.randrange(100, vocab - 100) for _ in range(num_tokens)]
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        for _ in range(-(-num_tokens // budget)):
            engine.step()
        sync(device)
    while engine.has_unfinished_requests():
        engine.step()
    sync(device)
    return kernel_times(prof, cuda)


def attention_rows(cfg, num_tokens: int, device: torch.device, dtype: torch.dtype, peak: float,
                   gen: torch.Generator, extend: int, block_size: int = 16) -> list[dict[str, Any]]:
    """One layer's attention at this model's heads, over a paged cache of ``block_size``-token
    blocks: the Triton prefill kernel against SDPA (causal),
    then, when ``num_tokens > extend``, an extend of ``extend`` new tokens after ``num_tokens - extend``
    cached, against SDPA with a lower-right causal mask."""
    import paged_attention as pa

    from infer.kernels import prefill_attention

    shape = {"num_q_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
             "block_size": block_size, "dtype": str(dtype).replace("torch.", "")}
    ceil = {"matmul_tflops": peak}
    rows = []
    r = pa.prefill_row(prefill_attention, 1, num_tokens, 0, shape, device, ceil, gen, max_context=num_tokens)
    rows.append(_attention_row(r, num_tokens, 0))
    if 0 < extend < num_tokens:
        prefix = num_tokens - extend
        r = pa.prefill_row(prefill_attention, 1, extend, prefix, shape, device, ceil, gen, max_context=num_tokens)
        r.update(sdpa_extend(shape, extend, prefix, device, peak, gen))
        rows.append(_attention_row(r, extend, prefix))
    return rows


def _attention_row(r: dict, new: int, prefix: int) -> dict[str, Any]:
    row = {"case": "prefill" if prefix == 0 else "extend", "new_tokens": new, "prefix": prefix,
           "triton_ms": r["triton_ms"], "triton_tflops": r["triton_tflops"], "triton_frac_peak": r["triton_mfu"]}
    if "sdpa_ms" in r:
        row.update({"sdpa_ms": r["sdpa_ms"], "sdpa_tflops": r["sdpa_tflops"], "sdpa_frac_peak": r["sdpa_mfu"],
                    "triton_over_sdpa": r["triton_ms"] / r["sdpa_ms"]})
    if "max_abs_diff_vs_sdpa" in r:
        row["max_abs_diff_vs_sdpa"] = r["max_abs_diff_vs_sdpa"]
    return row


def sdpa_extend(shape: dict, new: int, prefix: int, device: torch.device, peak: float,
                gen: torch.Generator) -> dict[str, float]:
    """SDPA over ``new`` queries after ``prefix`` keys, each query seeing the prefix and the new keys up
    to itself (``causal_lower_right``), K/V repeated to the query heads beforehand (untimed: the
    lower-right mask's kernels take no grouped K/V)."""
    import paged_attention as pa
    from torch.nn.attention.bias import causal_lower_right

    hq, hkv, d = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]
    dtype = getattr(torch, shape["dtype"])
    ctx = prefix + new
    q = torch.randn(1, hq, new, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(1, hkv, ctx, d, device=device, dtype=dtype, generator=gen).repeat_interleave(hq // hkv, dim=1)
    v = torch.randn(1, hkv, ctx, d, device=device, dtype=dtype, generator=gen).repeat_interleave(hq // hkv, dim=1)
    mask = causal_lower_right(new, ctx)
    with pa.sdpa_backend(device):
        t = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5), device)
    flops = 4 * hq * d * visible_pairs(new, prefix)
    return {"sdpa_ms": 1e3 * t, "sdpa_tflops": flops / t / 1e12, "sdpa_mfu": flops / t / 1e12 / peak}


def measure_length(engine, cfg, num_tokens: int, args, peak: float, rng: random.Random, gen: torch.Generator,
                   with_attention: bool) -> dict[str, Any]:
    """Every measurement of one prompt length (module docstring, parts 1-4)."""
    device = engine.runner.device
    flops = prefill_flops(cfg, num_tokens)
    print(f"[{num_tokens} tokens] GEMM ceiling: {len(model_linears(engine.runner.model))} projections ...", flush=True)
    gemm = gemm_ceiling(engine.runner.model, num_tokens, device)
    print(f"[{num_tokens} tokens] TTFT: 1 warm-up + {args.repeats} repeats ...", flush=True)
    tt = measure_ttft(engine, num_tokens, args.repeats, cfg.vocab_size, rng)
    print(f"[{num_tokens} tokens] profiling one prefill ...", flush=True)
    kernels = profile_prefill(engine, num_tokens, cfg.vocab_size, rng)
    parts = breakdown(kernels, flops, peak, gemm["tflops"])
    ttft_tflops = flops["total"] / (tt["ttft_ms"] / 1e3) / 1e12
    row = {"prompt_tokens": num_tokens, **tt, "model_tflop": flops["total"] / 1e12,
           "attention_flop_share": flops["attention"] / flops["total"], "floor_ms": flops["total"] / (peak * 1e9),
           "ttft_tflops": ttft_tflops, "ttft_mfu": ttft_tflops / peak,
           "device_mfu": (flops["total"] / (tt["device_ms"] / 1e3) / 1e12 / peak) if tt["device_ms"] else None,
           "ttft_minus_device_ms": tt["ttft_ms"] - tt["device_ms"] if tt["device_ms"] is not None else None,
           "gemm_ceiling_tflops": gemm["tflops"], "gemm_ceiling_ms": gemm["ms"],
           "gemm_ceiling_frac_peak": gemm["tflops"] / peak if gemm["tflops"] else None}
    print_row(row)
    attention = []
    if with_attention:
        print(f"[{num_tokens} tokens] attention alone: Triton prefill kernel vs SDPA ...", flush=True)
        rows = attention_rows(cfg, num_tokens, device, engine.runner.dtype, peak, gen, args.extend_tokens,
                              engine.config.block_size)
        attention = [{"prompt_tokens": num_tokens, **r} for r in rows]
        for r in attention:
            print_row(r)
    return {"row": row, "flops": flops, "breakdown": {"prompt_tokens": num_tokens, **parts},
            "gemm_shapes": [{"prompt_tokens": num_tokens, **s, "frac_peak": s["tflops"] / peak}
                            for s in gemm["shapes"]],
            "top_kernels": kernels[:args.top], "attention": attention}


def plot(report: dict, path: str | Path) -> None:
    """Left: per prompt length, the profiled prefill's device time stacked by kernel category (share
    of the busy time), its ms and the fraction of the peak the TTFT reached on top. Right: TFLOP/s of
    the whole prefill (TTFT, device span), its GEMMs against their ceiling, and the attention kernel
    against SDPA, with the matmul peak as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from common import save_figure

    rows, parts = report["rows"], report["breakdown"]
    lens = [r["prompt_tokens"] for r in rows]
    x = np.arange(len(lens))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    bottom = np.zeros(len(lens))
    for cat in CATEGORIES:
        share = np.array([p[f"{cat}_share"] or 0.0 for p in parts])
        ax.bar(x, share, 0.6, bottom=bottom, label=cat)
        bottom += share
    for i, (r, p) in enumerate(zip(rows, parts)):
        ax.annotate(f"{p['busy_ms']:.3g} ms busy\nTTFT {r['ttft_mfu']:.0%} of peak", (i, 1.0), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(x, [f"{n:,}" for n in lens])
    ax.set_xlabel("prompt tokens (one prefill)")
    ax.set_ylabel("share of the kernels' time")
    ax.set_ylim(0, 1.4)
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    series = [("TTFT", [r["ttft_tflops"] for r in rows]),
              ("device span", [r["ttft_tflops"] * r["ttft_ms"] / r["device_ms"] if r["device_ms"] else None
                               for r in rows]),
              ("GEMM kernels", [p["gemm_tflops"] for p in parts]),
              ("GEMM ceiling", [r["gemm_ceiling_tflops"] for r in rows])]
    att = {a["prompt_tokens"]: a for a in report["attention"] if a["case"] == "prefill"}
    if att:
        series += [("attention (Triton)", [att[n]["triton_tflops"] if n in att else None for n in lens]),
                   ("attention (SDPA)", [att[n].get("sdpa_tflops") if n in att else None for n in lens])]
    w = 0.8 / len(series)
    for j, (name, vals) in enumerate(series):
        bx.bar(x - 0.4 + w * (j + 0.5), [v or 0.0 for v in vals], w, label=name)
    peak = report["ceilings"]["matmul_tflops"]
    bx.axhline(peak, color="black", lw=1, ls="--", label=f"matmul peak {peak:.3g}")
    bx.axhline(0.65 * peak, color="gray", lw=0.8, ls=":", label="65% of peak")
    bx.set_xticks(x, [f"{n:,}" for n in lens])
    bx.set_xlabel("prompt tokens")
    bx.set_ylabel("TFLOP/s")
    bx.legend(fontsize=7)
    env = report["env"]
    fig.suptitle(f"prefill of {Path(report['model']).name}, {report['dtype']}, "
                 f"{env.get('gpu') or env['cpu']}", fontsize=9)
    save_figure(fig, path)


def tables(report: dict) -> str:
    """The report's Markdown tables."""
    t = "### Prefill, one prompt alone\n\n" + markdown_table(report["rows"], [
        "prompt_tokens", "prefill_steps", "graph", "ttft_ms", "host_ms", "launch_ms", "device_ms",
        "ttft_minus_device_ms", "model_tflop",
        "attention_flop_share", "floor_ms", "ttft_tflops", "ttft_mfu", "device_mfu", "gemm_ceiling_tflops",
        "gemm_ceiling_frac_peak"])
    t += "\n\n### Kernels of one prefill step, by category\n\n" + markdown_table(report["breakdown"], [
        "prompt_tokens", "busy_ms", *[f"{c}_ms" for c in CATEGORIES], "gemm_share", "attention_share",
        "gemm_tflops", "gemm_frac_peak", "gemm_frac_ceiling", "attention_tflops", "attention_frac_peak"])
    t += "\n\n### GEMM ceiling: each projection shape alone (F.linear)\n\n" + markdown_table(report["gemm_shapes"], [
        "prompt_tokens", "name", "m", "k", "n", "count", "ms", "tflops", "frac_peak"])
    if report["attention"]:
        t += "\n\n### Attention alone, one layer: Triton prefill kernel vs SDPA\n\n" + markdown_table(
            report["attention"], ["prompt_tokens", "case", "new_tokens", "prefix", "triton_ms", "triton_tflops",
                                  "triton_frac_peak", "sdpa_ms", "sdpa_tflops", "sdpa_frac_peak", "triton_over_sdpa"])
    else:
        t += f"\n\nAttention alone: not measured ({report['attention_note']})."
    for n, ks in report["top_kernels"].items():
        t += f"\n\n### Top kernels, {n} tokens\n\n" + markdown_table(
            [{**k, "name": k["name"][:80]} for k in ks], ["name", "category", "calls", "ms"])
    c = report["ceilings"]
    t += (f"\n\nmatmul peak {c['matmul_tflops']:.1f} TFLOP/s ({c['matmul_dtype']}, measured in this run); "
          f"{report['prefill_note']}; {report['env'].get('gpu') or report['env']['cpu']}, commit "
          f"{report['env']['commit']}")
    return t


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="short name, .gguf or HF directory [smollm2-135m]")
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto [auto]")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=None,
                    help=f"prompt lengths (default {' '.join(map(str, GPU_LENS))} on CUDA, "
                         f"{' '.join(map(str, CPU_LENS))} on CPU)")
    ap.add_argument("--engine-args", nargs="*", default=None, metavar="FIELD=VALUE",
                    help="EngineConfig overrides (default: optimize=true); max_num_batched_tokens defaults to the "
                         "longest prompt + 8 (one prefill step), max_num_seqs to 1 (a KV cache of one sequence)")
    ap.add_argument("--repeats", type=int, default=None, help="timed TTFTs per length (default 5 on CUDA, 2 on CPU)")
    ap.add_argument("--extend-tokens", type=int, default=None,
                    help=f"attention alone: new tokens of the extend case (default {GPU_EXTEND} on CUDA, "
                         f"{CPU_EXTEND} on CPU; 0: none)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per length [12]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw the figure here")
    out_argument(ap, "prefill.json", "write the JSON report here (and a .md beside it)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    lens = sorted(set(args.prompt_lens or (GPU_LENS if gpu else CPU_LENS)))
    if lens[0] < 1:
        raise SystemExit("--prompt-lens: every length must be >= 1")
    args.repeats = args.repeats or (5 if gpu else 2)
    if args.extend_tokens is None:
        args.extend_tokens = GPU_EXTEND if gpu else CPU_EXTEND
    overrides = engine_overrides(args.engine_args if args.engine_args is not None else ["optimize=true"])
    longest = max(lens) + 8
    kw = {"device": str(device), "dtype": args.dtype, **overrides}
    user_budget = kw.get("max_num_batched_tokens")
    kw.setdefault("max_num_batched_tokens", max(longest, kw.get("max_model_len") or 0))
    kw.setdefault("max_num_seqs", 1)
    from common import model_info

    _, cfg = model_info(args.model)
    linear_shapes(cfg)  # refuses an MoE or hybrid model before any weight is loaded
    from infer.kernels.triton_common import INTERPRET

    with_attention = gpu or INTERPRET
    print("measuring the matmul peak ...", flush=True)
    ceil = ceilings(device, quick=not gpu)
    peak = ceil["matmul_tflops"]
    print(f"loading {args.model} on {device} ...", flush=True)
    llm = make_llm(args.model, kw, longest, progress=False)
    engine = llm.engine
    cfg = engine.runner.config
    print(f"matmul peak {peak:.1f} TFLOP/s ({ceil['matmul_dtype']}); {engine.config.optimization_summary()}",
          flush=True)
    rng = random.Random(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    start = time.perf_counter()
    results = [measure_length(engine, cfg, n, args, peak, rng, gen, with_attention) for n in lens]
    budget = engine.scheduler.max_num_batched_tokens
    chunked = any(r["row"]["prefill_steps"] > 1 for r in results)
    report = {
        "benchmark": "prefill", "env": environment(device), "model": args.model,
        "dtype": str(engine.runner.dtype).replace("torch.", ""),
        "engine_config": engine.config.to_dict(), "ceilings": ceil, "prompt_lens": lens, "repeats": args.repeats,
        "seed": args.seed, "max_num_batched_tokens": budget,
        "prefill_note": (f"chunked: max_num_batched_tokens={budget} (set by the user: {user_budget})" if chunked
                         else f"one prefill step per prompt (max_num_batched_tokens={budget})"),
        "attention_note": None if with_attention else "on the CPU the Triton kernel needs TRITON_INTERPRET=1",
        "method": "TTFT: common.ttft_alone, median of repeats after a warm-up, fresh random prompts; FLOPs: "
                  "prefill_flops (2 x linear weights x T + causal attention + the LM head on one row); peak: "
                  "common.ceilings' 8192^3 bf16 matmul (2048^3 fp32 on a CPU); kernels: torch.profiler of one "
                  "prefill; GEMM ceiling: each projection shape alone, F.linear, do_bench",
        "flops": {str(n): r["flops"] for n, r in zip(lens, results)},
        # the projections the FLOP count assumes (ModelConfig) and the nn.Linear weights the model holds:
        # equal unless some are not nn.Linear (quantized), which the GEMM ceiling then leaves out
        "linear_params": {"config": cfg.num_layers * sum(k * n for _, k, n in linear_shapes(cfg)),
                          "model": sum(m.in_features * m.out_features for _, m in model_linears(engine.runner.model))},
        "rows": [r["row"] for r in results], "breakdown": [r["breakdown"] for r in results],
        "gemm_shapes": [s for r in results for s in r["gemm_shapes"]],
        "attention": [a for r in results for a in r["attention"]],
        "top_kernels": {str(n): r["top_kernels"] for n, r in zip(lens, results)},
        "seconds": time.perf_counter() - start,
    }
    llm.close()
    write_report(report, args.out, tables(report))
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
