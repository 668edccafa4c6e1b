"""Weight-only quantization (phase 11): what int8 / fp8 / int4 buy in decode speed and cost in quality.

    # GPU: Qwen3-4B shapes (a synthetic checkpoint: scripts/make_synthetic_checkpoint.py qwen3-4b DIR
    # --random-weights), every phase 5-9 flag on, batch 1 and 16
    python benchmarks/quantization.py --device cuda --model /tmp/ck/qwen3-4b --parts kernels decode \\
        --batch-sizes 1 16 --engine-args optimize=true --out benchmarks/runs/quantization-gpu
    # CPU: quality of each method on the shipped SmolLM2-135M (real weights)
    python benchmarks/quantization.py --device cpu --parts quality --quality-model smollm2-135m \\
        --quality-tokens 20000 --out benchmarks/runs/quantization-cpu
    # GPU: the FP8 KV cache at batch 32 and 16k context, Qwen3-4B shapes (an H200: the bf16 cache of 32 x
    # 16k tokens is 77 GB), both caches in the same kv_cache_memory_bytes (kv_blocks: how many each holds)
    python benchmarks/quantization.py --device cuda --model /tmp/ck/qwen3-4b --parts decode --methods none \
        --kv-cache-dtypes fp8 --batch-sizes 32 --prompt-len 16384 --output-len 64 --repeats 1 \
        --engine-args optimize=true kv_cache_memory_bytes=90000000000

Three parts, each for ``--methods`` (``none`` first: the baseline every ratio is against):

1. **kernels**: each decoder projection of ``--model``'s shapes (merged QKV, o, merged gate/up, down),
   random weights, ``--batch-sizes`` rows: microseconds per call of ``F.linear`` on the model-dtype weight
   (``none``) and of :func:`infer.kernels.quant_triton.quantized_linear` (the Triton kernel on CUDA; on the
   CPU the plain-PyTorch reference, which dequantizes per call and so is *slower* than ``none``), and the
   weight bytes each call reads over that time (GB/s).
2. **decode**: the engine (``infer.LLM`` with ``quantization=METHOD`` and ``--engine-args``), a batch of
   ``B`` requests of ``--prompt-len`` random tokens decoding ``--output-len`` tokens each: ms per decode
   step (steps after every request's first token, median of ``--repeats`` runs), output tok/s, the
   weight bytes one step reads (quantized projections + everything else; the input embedding counts
   one row) and the floor those bytes set at the copy bandwidth measured in the same run.
3. **quality**: ``--quality-model`` (real weights), teacher-forced on the first ``--quality-tokens``
   tokens of a fixed English text, in windows of ``--window`` tokens: perplexity, and top-1
   agreement with ``none`` (the share of positions whose argmax is the same). The weight methods run
   each window as one cache-less forward; the ``--kv-cache-dtypes`` rows (unquantized weights, an FP8
   KV cache: ``fp8`` with scales 1.0, ``fp8-calibrated`` with ``calculate_kv_scales``' scales, set by
   the first window) run it through a paged KV cache instead, whose prefill writes every K/V to the
   cache and attends over what it reads back, so every score uses the stored e4m3 values. The text: the Python
   reference manual's topics shipped with CPython (``pydoc_data.topics``, PSF License), in key order;
   the report records the Python version, since the text is that version's.

Writes ``quantization.json`` (environment, ceilings, every row), ``quantization.md`` (the tables) and
``quantization.png`` (decode speed-up over ``none`` per batch size; perplexity per method) into ``--out DIR``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
import torch.nn.functional as F
from common import (
    ceilings,
    engine_overrides,
    environment,
    free_device_memory,
    markdown_table,
    model_info,
    out_argument,
    print_row,
    resolve_device,
    save_figure,
    sync,
    timed,
)

METHODS = ("none", "int8", "fp8", "int4")


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """``{name: (out_features, in_features)}`` of one decoder layer's projections, QKV and gate/up merged."""
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o": (h, cfg.num_heads * d),
            "gate_up": (2 * cfg.intermediate_size, h), "down": (h, cfg.intermediate_size)}


# -------------------------------------------------------------------------------- 1. kernels


def bench_kernels(cfg, methods, batch_sizes, device, dtype, repeats: int) -> list[dict]:
    from infer.kernels import quant_reference as qref
    from infer.kernels.quant_triton import quantized_linear

    rows = []
    for name, (n, k) in projection_shapes(cfg).items():
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        for m in batch_sizes:
            x = torch.randn(m, k, device=device, dtype=dtype)
            base_us = None
            for method in methods:
                if method == "none":
                    args, nbytes = (F.linear, x, w), w.numel() * w.element_size()
                else:
                    q, s = qref.quantize(w, method)
                    args = (quantized_linear, x, q, s, method, qref.default_block(method, k))
                    nbytes = q.numel() * q.element_size() + s.numel() * s.element_size()
                us = 1e6 * timed(lambda a=args: a[0](*a[1:]), device, repeats=repeats, warmup=2)
                base_us = us if method == "none" else base_us
                row = {"projection": name, "shape": f"{n}x{k}", "rows": m, "method": method, "us": us,
                       "weight_gb_s": nbytes / us / 1e3, "speedup": base_us / us if base_us else None}
                rows.append(row)
                print_row(row)
    return rows


# -------------------------------------------------------------------------------- 2. decode


def weight_bytes_per_step(model) -> int:
    """Bytes of the weights one decode step reads: every parameter once (storages shared by merged
    projections and their parts counted once), the input embedding one row unless the LM head is it."""
    seen, total = set(), 0
    emb = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == emb.data_ptr()
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += p.untyped_storage().nbytes()
    if not tied:
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


def bench_decode(model: str, method: str, batch: int, prompt_len: int, output_len: int, repeats: int,
                 engine_args: dict, bandwidth_gb_s: float) -> dict:
    from infer import LLM
    from infer.sampling import SamplingParams

    kv = KV_LABELS.get(method) and "fp8"  # an FP8 KV cache row: unquantized weights
    kw = {**engine_args, **({"kv_cache_dtype": kv} if kv else {})}
    llm = LLM(model, progress=False, quantization="none" if kv else method, max_num_seqs=max(batch, 1),
              max_model_len=prompt_len + output_len + 8, **kw)
    engine = llm.engine
    device = engine.runner.device
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    step_ms = []
    for r in range(repeats + 1):  # the first run warms up (Triton compiles, graphs)
        for _ in range(batch):
            engine.add_request(torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist(), params)
        while any(len(s.token_ids) == s.num_prompt_tokens for req in engine.requests.values() for s in req.seqs):
            engine.step()
        sync(device)
        t, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        sync(device)
        if r:
            step_ms.append(1e3 * (time.perf_counter() - t) / max(steps, 1))
    nbytes = weight_bytes_per_step(engine.loaded.model)
    kvc = engine.runner.kv_cache  # the pool's bytes per token: half with an FP8 cache (2x the blocks per byte)
    num_blocks, kv_bytes_per_token = kvc.num_blocks, kvc.nbytes // (kvc.num_blocks * kvc.block_size)
    ms = statistics.median(step_ms)
    del llm, engine
    free_device_memory()
    return {"method": KV_LABELS.get(method, method), "batch": batch, "step_ms": ms, "tok_s": batch * 1e3 / ms,
            "kv_blocks": num_blocks, "kv_bytes_per_token": kv_bytes_per_token,
            "weight_mb_per_step": nbytes / 1e6, "floor_ms": nbytes / (bandwidth_gb_s * 1e6),
            "floor_frac": nbytes / (bandwidth_gb_s * 1e6) / ms}


# -------------------------------------------------------------------------------- 3. quality


def quality_text() -> str:
    """The fixed English text: CPython's ``pydoc_data.topics`` (the reference manual's topics), key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@torch.inference_mode()
def window_logits(model, ids: list[int], device, kv=None) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of one window (a fresh sequence): no cache, or with ``kv`` (a
    :class:`~infer.attention.KVCache` of at least ``len(ids)`` slots) prefilled through its blocks
    ``0, 1, ...``, as the engine prefills a prompt: K/V written to the cache, attention over what is read back."""
    from infer.attention import AttentionMetadata, TorchAttentionBackend

    if getattr(model, "attn_backend", None) is None:
        model.set_attention_backend(TorchAttentionBackend())
    n = len(ids)
    t = torch.tensor(ids, device=device)
    meta = AttentionMetadata.for_prefill([n], device)
    if kv is not None:
        table = list(range(-(-n // kv.block_size)))
        meta.kv_cache, meta.block_tables_cpu = kv, [table]
        meta.slot_mapping = torch.arange(n, device=device)
        meta.block_tables = torch.tensor([table], dtype=torch.int32, device=device)
    return model.compute_logits(model(t, torch.arange(n, device=device), meta)).float()


KV_LABELS = {"fp8": "none + fp8 e4m3 KV cache (scales 1.0)",
             "fp8-calibrated": "none + fp8 e4m3 KV cache (calculate_kv_scales)"}


def fp8_kv_cache(loaded, window: int, device, calibrate: bool):
    """A paged FP8 KV cache (block size 16) for one window of ``loaded``'s model."""
    from infer.attention import KVCache
    from infer.kernels.attention_reference import FP8_KV_DTYPE

    cfg = loaded.config
    p = next(loaded.model.parameters())
    return KVCache(cfg.num_kv_layers, -(-window // 16), 16, cfg.num_kv_heads, cfg.head_dim, p.dtype, device,
                   cache_dtype=FP8_KV_DTYPE, calibrate=calibrate)


def bench_quality(model: str, methods, tokens: int, window: int, device, dtype, kv_dtypes=()) -> list[dict]:
    from infer.loader import load_model

    rows, base_argmax, ids = [], None, None
    for method in [*methods, *kv_dtypes]:
        kv_mode = method if method in KV_LABELS else None
        loaded = load_model(model, device=device, dtype=dtype, progress=False,
                            quantization="none" if kv_mode else method)
        kv = fp8_kv_cache(loaded, window, device, kv_mode == "fp8-calibrated") if kv_mode else None
        if ids is None:
            ids = loaded.tokenizer.encode(quality_text())[:tokens]
            if len(ids) < tokens:
                raise SystemExit(f"the text has only {len(ids)} tokens")
        nll, n, argmax = 0.0, 0, []
        for start in range(0, len(ids) - 1, window):
            w = ids[start:start + window + 1]
            logits = window_logits(loaded.model, w[:-1], device, kv)
            target = torch.tensor(w[1:], device=device)
            nll += F.cross_entropy(logits, target, reduction="sum").item()
            n += len(w) - 1
            argmax.append(logits.argmax(-1).cpu())
        argmax = torch.cat(argmax)
        base_argmax = argmax if base_argmax is None else base_argmax
        row = {"method": KV_LABELS.get(method, method), "tokens": n, "perplexity": float(torch.tensor(nll / n).exp()),
               "top1_agreement": float((argmax == base_argmax).float().mean())}
        if kv is not None:  # the scales the rows used (calibrated: from the first window)
            row["k_scale_range"] = [float(kv.k_scale.min()), float(kv.k_scale.max())]
            row["v_scale_range"] = [float(kv.v_scale.min()), float(kv.v_scale.max())]
        rows.append(row)
        print_row(row)
        del loaded
        if torch.device(device).type == "cuda":
            free_device_memory()
    base = rows[0]["perplexity"]
    for r in rows:
        r["ppl_change_pct"] = 100 * (r["perplexity"] / base - 1)
    return rows


# -------------------------------------------------------------------------------- report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("decode", "quality") if report.get(p)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, part in zip(axes[0], panels):
        rows = report[part]
        if part == "decode":
            for b in sorted({r["batch"] for r in rows}):
                rs = [r for r in rows if r["batch"] == b]
                base = next(r["step_ms"] for r in rs if r["method"] == "none")
                short = {v: f"{k} KV" for k, v in KV_LABELS.items()}
                ax.plot([short.get(r["method"], r["method"]) for r in rs], [base / r["step_ms"] for r in rs], "o-",
                        label=f"batch {b}")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_ylabel("decode speed-up over none (x)")
            ax.set_title(f"decode, {report['model']}")
            ax.legend()
        else:
            short = {v: f"{k} KV" for k, v in KV_LABELS.items()}
            bars = ax.bar([short.get(r["method"], r["method"]) for r in rows], [r["perplexity"] for r in rows])
            for b, r in zip(bars, rows):
                ax.annotate(f"{r['perplexity']:.2f}\n{r['top1_agreement']:.1%} top-1",
                            (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
            ax.set_ylabel("perplexity")
            ax.set_title(f"quality, {report['quality_model']} ({rows[0]['tokens']} tokens)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="kernels and decode: a short name, .gguf or HF "
                    "directory (a synthetic one with random weights is fine)")
    ap.add_argument("--quality-model", default="smollm2-135m", help="quality: a model with real weights")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--parts", nargs="+", default=["kernels", "decode", "quality"],
                    choices=["kernels", "decode", "quality"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quality-tokens", type=int, default=20000)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--kv-cache-dtypes", nargs="*", default=[], choices=list(KV_LABELS),
                    help="quality: also score the unquantized model through an FP8 KV cache (scales 1.0, or "
                    "calibrated on the first window); decode: also run the unquantized model with an FP8 KV cache")
    ap.add_argument("--engine-args", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="EngineConfig fields for the decode part (e.g. optimize=true)")
    out_argument(ap, "", "output directory")
    args = ap.parse_args(argv)
    if args.methods[0] != "none":
        args.methods = ["none"] + [m for m in args.methods if m != "none"]
    device = resolve_device(args.device)
    from infer.config import parse_dtype

    dtype = parse_dtype(args.dtype, device)
    ceil = ceilings(device, quick=device.type == "cpu") if "decode" in args.parts else None  # the decode floor
    report = {"environment": environment(device), "ceilings": ceil, "model": args.model,
              "quality_model": args.quality_model, "args": vars(args), "python": platform.python_version()}
    tables = []
    if "kernels" in args.parts:
        _, cfg = model_info(args.model)
        report["kernels"] = bench_kernels(cfg, args.methods, args.batch_sizes, device, dtype, args.repeats * 5)
        tables.append("## kernels\n\n" + markdown_table(report["kernels"], ["projection", "shape", "rows", "method",
                                                                            "us", "weight_gb_s", "speedup"]))
    if "decode" in args.parts:
        kw = engine_overrides(args.engine_args)
        kw.setdefault("device", str(device))
        report["decode"] = []
        for b in args.batch_sizes:
            for method in [*args.methods, *(["fp8"] if args.kv_cache_dtypes else [])]:
                row = bench_decode(args.model, method, b, args.prompt_len, args.output_len, args.repeats, kw,
                                   ceil["bandwidth_gb_s"])  # the copy rate (bytes read + written) as the read rate
                base = next((r for r in report["decode"] if r["batch"] == b and r["method"] == "none"), row)
                row["speedup"] = base["step_ms"] / row["step_ms"]
                report["decode"].append(row)
                print_row(row)
        tables.append("## decode\n\n" + markdown_table(report["decode"], [
            "method", "batch", "step_ms", "tok_s", "speedup", "kv_blocks", "kv_bytes_per_token", "weight_mb_per_step", "floor_ms",
            "floor_frac"]))
    if "quality" in args.parts:
        report["quality"] = bench_quality(args.quality_model, args.methods, args.quality_tokens, args.window,
                                          device, dtype, args.kv_cache_dtypes)
        tables.append("## quality\n\n" + markdown_table(report["quality"], [
            "method", "tokens", "perplexity", "ppl_change_pct", "top1_agreement"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quantization.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "quantization.md").write_text("\n\n".join(tables) + "\n")
    print("\n\n".join(tables))
    plot(report, out / "quantization.png")
    print(f"wrote {out / 'quantization.json'}, {out / 'quantization.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
