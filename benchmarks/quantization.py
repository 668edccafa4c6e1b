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
   (``none``) and of the quantized product (on CUDA :func:`infer.kernels.quant_triton.quantized_linear`;
   on the CPU :func:`infer.kernels.quant_cpu.quantized_linear_cpu`, PyTorch's weight-only kernels on the
   layout made at load), and the weight bytes each call reads over that time (GB/s).
2. **decode**: the engine (``infer.LLM`` with ``quantization=METHOD`` and ``--engine-args``), a batch of
   ``B`` requests of ``--prompt-len`` random tokens decoding ``--output-len`` tokens each: ms per decode
   step (steps after every request's first token, median of ``--repeats`` runs; on the CPU the runs of
   all methods interleaved, ``--interleave``, so load from other jobs falls on each alike), output tok/s, the
   weight bytes one step reads (quantized projections + everything else; the input embedding counts
   one row) and the floor those bytes set at the copy bandwidth measured in the same run. With ``--hf``
   (the default), HF transformers on the same weights, unquantized, in the same run (``generate``, eager):
   its ms per step, and every method's speed-up over it.
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
import functools
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

METHODS = ("none", "int8", "fp8", "int4", "int4_asym")
#: ``METHOD+head``: the method with ``quantize_lm_head`` (the LM head quantized too)
HEAD_METHODS = tuple(f"{m}+head" for m in METHODS[1:])
#: ``int4-triton``: int4 decode on our Triton GEMV instead of PyTorch's tinygemm (``QuantizedLinear.tinygemm``);
#: ``fp8_w8a8``: fp8 weights with per-token fp8 activations on the FP8 tensor cores (CUDA; the reference on the CPU)
TRITON_METHODS = ("int4-triton", "int4_asym-triton", "fp8_w8a8")


def method_args(method: str) -> dict:
    """``load_model`` / ``EngineConfig`` arguments of a method name (``int8``, ``int8+head``, ``int4-triton``...)."""
    base, _, head = method.partition("+")
    return {"quantization": base.removesuffix("-triton"), "quantize_lm_head": head == "head"}


def use_kernels(method: str) -> None:
    """Set the CUDA int4 kernel a method name asks for (``-triton``: our GEMV; else tinygemm) before its runs."""
    from infer.models.quant import QuantizedLinear

    QuantizedLinear.tinygemm = "-triton" not in method


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """``{name: (out_features, in_features)}`` of one decoder layer's projections, QKV and gate/up merged."""
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o": (h, cfg.num_heads * d),
            "gate_up": (2 * cfg.intermediate_size, h), "down": (h, cfg.intermediate_size)}


# -------------------------------------------------------------------------------- 1. kernels


def bench_kernels(cfg, methods, batch_sizes, device, dtype, repeats: int) -> list[dict]:
    from infer.kernels import quant_reference as qref
    from infer.kernels.quant_cpu import pack_for_cpu, quantized_linear_cpu
    from infer.kernels.quant_triton import quantized_linear
    from infer.kernels.quant_w8a8 import W8A8_MIN_ROWS, w8a8_linear

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
                    kind = {"int4_asym": "int4", "fp8_w8a8": "fp8"}.get(method, method)  # the weight's format
                    block = qref.default_block(kind, k)
                    q, s, *z = (qref.quantize(w, kind, block) if method != "int4_asym" else
                                qref.quantize_asymmetric(w, block))
                    z = z[0] if z else None
                    nbytes = q.numel() * q.element_size() + s.numel() * s.element_size() + (z.numel() if z is not None else 0)
                    if device.type == "cpu":
                        packed = pack_for_cpu(q, s, kind, block, z)
                        args, nbytes = (quantized_linear_cpu, x, packed, q, s, kind, block, None, z), packed.nbytes()
                    elif method == "fp8_w8a8" and m >= W8A8_MIN_ROWS:
                        args = (w8a8_linear, x, q, s)
                    else:
                        args = (quantized_linear, x, q, s, kind, block, None, z)
                us = 1e6 * timed(lambda a=args: a[0](*a[1:]), device, repeats=repeats, warmup=2)
                base_us = us if method == "none" else base_us
                row = {"projection": name, "shape": f"{n}x{k}", "rows": m, "method": method, "us": us,
                       "weight_gb_s": nbytes / us / 1e3, "speedup": base_us / us if base_us else None}
                rows.append(row)
                print_row(row)
    return rows


# -------------------------------------------------------------------------------- tune (GPU)


TUNE_BLOCK_N = (1, 2, 4, 8)
TUNE_BLOCK_K = (256, 512, 1024, 2048)
TUNE_WARPS = (1, 2, 4, 8)
TUNE_STAGES = (1, 2, 3, 4)  # the one-row GEMV's pipeline


def graph_us(calls, device) -> float:
    """Microseconds per call of ``calls`` (a list of functions), timed as one CUDA graph that runs them all
    (launch gaps hidden as in the engine's graphs; each call on its own copy of the weight, so the weights
    stream from memory, not from L2): the best of 5 replays. On the CPU: each call timed, the median."""
    if device.type != "cuda":
        return 1e6 * statistics.median(timed(f, device, repeats=3, warmup=1, stat=min) for f in calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    best = float("inf")
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, 1e3 * start.elapsed_time(end) / len(calls))
    return best


def _copies(nbytes: int) -> int:
    """Copies of a weight of ``nbytes`` that together pass 200 MB (four times an H100's or H200's L2)."""
    return max(2, -(-(200 << 20) // nbytes))


def bench_tune(cfg, methods, batch_sizes, device, dtype) -> list[dict]:
    """The quantized kernels' tiles (:func:`infer.kernels.quant_triton.default_config`) searched: for each projection,
    method and row count, every ``(BLOCK_N, BLOCK_K, num_warps)`` of the
    TUNE_* grids whose float32 accumulator takes 8-64 registers a thread, timed in a CUDA graph over copies
    of the weight (:func:`graph_us`); the default tile's time, the best tile and the bf16 ``F.linear`` beside
    them."""
    from infer.kernels import quant_reference as qref
    from infer.kernels import quant_triton as qt

    rows = []
    for name, (n, k) in projection_shapes(cfg).items():
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        ws = [w] + [w.clone() for _ in range(_copies(w.numel() * w.element_size()) - 1)]
        for m in batch_sizes:
            x = torch.randn(m, k, device=device, dtype=dtype)
            bf16_us = graph_us([functools.partial(F.linear, x, wi) for wi in ws], device)
            for method in [mt for mt in methods if mt in qref.QDTYPES]:  # (not int4_asym)
                block = qref.default_block(method, k)
                q, s = qref.quantize(w, method, block)
                nbytes = q.numel() * q.element_size() + s.numel() * s.element_size()
                qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(_copies(nbytes) - 1)]

                def run(config, qs=qs, x=x, method=method, block=block):
                    return graph_us([functools.partial(qt.quantized_linear_triton, x, qi, si, method, block,
                                                       config=config) for qi, si in qs], device)

                default = qt.default_config(m, n, k, block[1], method)
                times = {}
                for tile in tune_tiles(m, k, block[1], method):
                    times[tile] = run(tile)
                default_us = times.get(default) or run(default)
                best = min(times, key=times.get)
                row = {"projection": name, "shape": f"{n}x{k}", "rows": m, "method": method,
                       "default_tile": tile_name(default), "default_us": default_us,
                       "best_tile": tile_name(best), "best_us": times[best],
                       "best_gb_s": nbytes / times[best] / 1e3, "bf16_us": bf16_us,
                       "best_vs_bf16": bf16_us / times[best],
                       "top5": sorted((round(v, 2), tile_name(t)) for t, v in times.items())[:5]}
                rows.append(row)
                print_row(row)
    return rows


def tune_tiles(m: int, k: int, bc: int, method: str = "int8") -> list[tuple[int, int, int, int, bool]]:
    """The configs :func:`bench_tune` tries for ``m`` rows. One row: the one-row GEMV's tiles (BLOCK_N up to 16,
    BLOCK_K, warps from the TUNE_* grids, 4-64 int32 words of the weight a thread per step). More rows: GEMV tiles
    (an accumulator of 8-64 registers a thread; at most 512 columns a step) and tl.dot GEMM tiles (BLOCK_M 16 or
    the rows padded, BLOCK_N 16-128, BLOCK_K 64 or 128 inside one scale column, 2-8 warps)."""
    from infer.kernels.quant_triton import GEMV_ROWS_LIMIT

    m_pad = triton_next_pow2(m)
    if m == 1:
        per = 8 if method == "int4" else 4  # codes a word
        return [(1, bn, bk, warps, False, stages) for bn in TUNE_BLOCK_N + (16,) for bk in TUNE_BLOCK_K
                for warps in TUNE_WARPS for stages in TUNE_STAGES
                if 4 <= bn * bk // per // (32 * warps) <= 64 and bk <= max(256, k)]
    tiles = []
    for bn in TUNE_BLOCK_N if m <= GEMV_ROWS_LIMIT else ():
        for bk in TUNE_BLOCK_K:
            for warps in TUNE_WARPS:
                regs = m_pad * bn * bk // (32 * warps)
                if 8 <= regs <= 64 and bk <= max(256, k) and bk <= 512:
                    tiles.append((m_pad, bn, bk, warps, False))
    if m > 1:
        for bn in (16, 32, 64, 128):
            for bk in (64, 128):
                if bc < k and bc % bk:
                    continue
                for warps in (2, 4, 8):
                    tiles.append((max(16, m_pad), bn, bk, warps, True))
    return tiles


def tile_name(tile) -> str:
    """``BLOCK_NxBLOCK_KxWARPS`` of a GEMV tile (``...xsSTAGES`` for the one-row GEMV's);
    ``dot:BLOCK_MxBLOCK_NxBLOCK_KxWARPS`` of a GEMM tile."""
    if tile[4]:
        return "dot:" + "x".join(map(str, tile[:4]))
    return "x".join(map(str, tile[1:4])) + (f"xs{tile[5]}" if len(tile) > 5 else "")


def triton_next_pow2(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


# -------------------------------------------------------------------------------- 2. decode


def weight_bytes_per_step(model) -> int:
    """Bytes of the weights one decode step reads: every parameter once (storages shared by merged
    projections and their parts counted once; a quantized layer on the CPU: its kernel's layout instead),
    the input embedding one row unless the LM head is it."""
    from infer.models.quant import QuantizedLinear

    seen, total = set(), 0
    for m in model.modules():  # on the CPU a quantized layer reads its kernel's layout (infer.kernels.quant_cpu)
        packed = m.__dict__.get("_cpu_packed") if isinstance(m, QuantizedLinear) else None
        if packed is not None:
            seen.update(t.untyped_storage().data_ptr() for t in (m.qweight, m.weight_scale))
            total += packed[1].nbytes()
    emb = model.model.embed_tokens.weight
    tied = getattr(model.lm_head, "weight", None) is not None and model.lm_head.weight.data_ptr() == emb.data_ptr()
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += p.untyped_storage().nbytes()
    if not tied:
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


class DecodeRun:
    """One method's engine, ready to time: ``run()`` decodes ``batch`` requests of ``prompt_len`` random
    tokens to ``output_len`` tokens and returns ms per decode step (steps after every request's first
    token)."""

    def __init__(self, model: str, method: str, batch: int, prompt_len: int, output_len: int,
                 engine_args: dict, kv_cache_dtype: str | None = None) -> None:
        from infer import LLM
        from infer.sampling import SamplingParams

        # kv_cache_dtype (an FP8 KV cache row, KV_LABELS): the method's weights with that cache
        self.method = KV_LABELS[kv_cache_dtype] if kv_cache_dtype else method
        self.batch, self.prompt_len = batch, prompt_len
        kv = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}
        use_kernels(method)  # (the graphs captured now call the kernel it picks)
        self.llm = LLM(model, progress=False, **method_args(method), max_num_seqs=max(batch, 1),
                       max_model_len=prompt_len + output_len + 8, **engine_args, **kv)
        self.engine = self.llm.engine
        self.gen = torch.Generator().manual_seed(0)
        self.params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        self.run()  # warm-up (Triton compiles, graphs)

    def run(self) -> float:
        use_kernels(self.method)
        engine, device = self.engine, self.engine.runner.device
        vocab = engine.vocab_size
        for _ in range(self.batch):
            engine.add_request(torch.randint(100, vocab - 100, (self.prompt_len,), generator=self.gen).tolist(),
                               self.params)
        while any(len(s.token_ids) == s.num_prompt_tokens for req in engine.requests.values() for s in req.seqs):
            engine.step()
        sync(device)
        t, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        sync(device)
        return 1e3 * (time.perf_counter() - t) / max(steps, 1)

    def row(self, step_ms: list[float], bandwidth_gb_s: float) -> dict:
        nbytes = weight_bytes_per_step(self.engine.loaded.model)
        kvc = self.engine.runner.kv_cache  # the pool's bytes per token: half with an FP8 cache (2x the blocks)
        ms = statistics.median(step_ms)
        return {"method": self.method, "batch": self.batch, "step_ms": ms, "tok_s": self.batch * 1e3 / ms,
                "kv_blocks": kvc.num_blocks, "kv_bytes_per_token": kvc.nbytes // (kvc.num_blocks * kvc.block_size),
                "weight_mb_per_step": nbytes / 1e6, "floor_ms": nbytes / (bandwidth_gb_s * 1e6),
                "floor_frac": nbytes / (bandwidth_gb_s * 1e6) / ms}

    def close(self) -> None:
        del self.llm, self.engine
        free_device_memory()


class HFDecodeRun:
    """HF transformers on the same weights, unquantized (the peer of the CPU goal): ``run()`` returns ms per
    decode step of ``generate`` (eager, its default), ``(generate(N) - generate(1)) / (N - 1)`` on ``batch``
    rows of ``prompt_len`` random tokens."""

    method = "hf-transformers"

    def __init__(self, path, batch: int, prompt_len: int, output_len: int, device, dtype) -> None:
        from common import load_hf

        self.hf = load_hf(path, str(device), dtype)
        self.batch, self.output_len, self.device = batch, output_len, device
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(100, self.hf.config.vocab_size - 100, (batch, prompt_len), generator=gen).to(device)
        self.generate(4)  # warm-up

    def generate(self, n: int) -> float:
        from transformers import GenerationConfig

        cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        sync(self.device)
        t = time.perf_counter()
        with torch.no_grad():
            self.hf.generate(self.ids, attention_mask=torch.ones_like(self.ids), generation_config=cfg)
        sync(self.device)
        return time.perf_counter() - t

    def run(self) -> float:
        t1 = self.generate(1)
        return 1e3 * (self.generate(self.output_len) - t1) / (self.output_len - 1)

    def row(self, step_ms: list[float], bandwidth_gb_s: float) -> dict:
        ms = statistics.median(step_ms)
        return {"method": self.method, "batch": self.batch, "step_ms": ms, "tok_s": self.batch * 1e3 / ms}

    def close(self) -> None:
        del self.hf
        free_device_memory()


def hf_checkpoint(model: str):
    """The checkpoint HF transformers can read for ``model``, or None (weights generated at load)."""
    from infer.loader import resolve_model
    from infer.loader.synthetic import random_weights_spec

    path = resolve_model(model)
    return None if path.is_dir() and random_weights_spec(path) is not None else path


def bench_decode(args, batch: int, engine_args: dict, device, dtype, bandwidth_gb_s: float) -> list[dict]:
    """Rows of every method (and HF transformers with ``--hf``) at ``batch``. ``--interleave``: every engine is
    built first and the timed runs go round-robin (run r of every method, then run r + 1), so a change in
    the machine's load falls on all of them alike (a shared CPU); otherwise one method after the other (a
    GPU, whose memory holds one engine at a time)."""
    make = [lambda m=m: DecodeRun(args.model, m, batch, args.prompt_len, args.output_len, engine_args)
            for m in args.methods]
    if args.kv_cache_dtypes:  # unquantized weights through an FP8 KV cache (the scales: engine_args)
        make.append(lambda: DecodeRun(args.model, "none", batch, args.prompt_len, args.output_len, engine_args, "fp8"))
    path = hf_checkpoint(args.model) if args.hf else None
    if args.hf and path is None:
        print("skipping HF transformers: the model's weights are generated at load time")
    if path is not None:
        make.append(lambda: HFDecodeRun(path, batch, args.prompt_len, args.output_len, device, dtype))
    rows = []
    if args.interleave:
        runs = [f() for f in make]
        times = [[] for _ in runs]
        for _ in range(args.repeats):
            for run, ts in zip(runs, times):
                ts.append(run.run())
        rows = [run.row(ts, bandwidth_gb_s) for run, ts in zip(runs, times)]
        for run in runs:
            run.close()
    else:
        for f in make:
            run = f()
            rows.append(run.row([run.run() for _ in range(args.repeats)], bandwidth_gb_s))
            run.close()
    base = rows[0]["step_ms"]  # none
    hf = rows[-1]["step_ms"] if path is not None else None
    for row in rows:
        row["speedup"] = base / row["step_ms"]
        if hf is not None:
            row["speedup_vs_hf"] = hf / row["step_ms"]
        print_row(row)
    return rows


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
    for method, kv_mode in [*((m, None) for m in methods), *(("none", k) for k in kv_dtypes)]:
        loaded = load_model(model, device=device, dtype=dtype, progress=False, **method_args(method))
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
        row = {"method": KV_LABELS[kv_mode] if kv_mode else method, "tokens": n, "perplexity": float(torch.tensor(nll / n).exp()),
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
        if part == "decode":  # a group of bars per method, one bar per batch size: speed-up, share of the floor
            short = {v: f"{k} KV" for k, v in KV_LABELS.items()}
            batches = sorted({r["batch"] for r in rows})
            methods = list(dict.fromkeys(r["method"] for r in rows))
            width = 0.8 / len(batches)
            for i, b in enumerate(batches):
                rs = {r["method"]: r for r in rows if r["batch"] == b}
                base = rs["none"]["step_ms"]
                xs = [j + (i - (len(batches) - 1) / 2) * width for j, m in enumerate(methods) if m in rs]
                bars = ax.bar(xs, [base / rs[m]["step_ms"] for m in methods if m in rs], width, label=f"batch {b}")
                for bar, m in zip(bars, [m for m in methods if m in rs]):
                    ax.annotate(f"{bar.get_height():.2f}x\n{rs[m]['floor_frac']:.0%}", (bar.get_x() + bar.get_width() / 2,
                                bar.get_height()), ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(methods)), [short.get(m, m) for m in methods], rotation=30, ha="right")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
            ax.set_ylabel("decode speed-up over none (x)")
            ax.set_title(f"decode, {Path(str(report['model'])).name}\n(labels: speed-up, share of the bytes' floor)",
                         fontsize=10)
            ax.legend(loc="lower right")
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
                    choices=["kernels", "tune", "decode", "quality"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + HEAD_METHODS + TRITON_METHODS,
                    help="METHOD+head: with quantize_lm_head (decode and quality parts)")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quality-tokens", type=int, default=20000)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                    help="decode: also time HF transformers (eager, unquantized) on the same weights")
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                    help="decode: build every engine first and time them round-robin (default: on the CPU)")
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
    if args.interleave is None:
        args.interleave = device.type == "cpu"
    from infer.config import parse_dtype

    dtype = parse_dtype(args.dtype, device)
    ceil = ceilings(device, quick=device.type == "cpu") if "decode" in args.parts else None  # the decode floor
    report = {"environment": environment(device), "ceilings": ceil, "model": args.model,
              "quality_model": args.quality_model, "args": vars(args), "python": platform.python_version()}
    tables = []
    if "kernels" in args.parts:
        _, cfg = model_info(args.model)
        report["kernels"] = bench_kernels(cfg, [m for m in args.methods if "+" not in m], args.batch_sizes, device,
                                          dtype, args.repeats * 5)
        tables.append("## kernels\n\n" + markdown_table(report["kernels"], ["projection", "shape", "rows", "method",
                                                                            "us", "weight_gb_s", "speedup"]))
    if "tune" in args.parts:
        _, cfg = model_info(args.model)
        report["tune"] = bench_tune(cfg, args.methods, args.batch_sizes, device, dtype)
        tables.append("## tune\n\n" + markdown_table(report["tune"], [
            "projection", "shape", "rows", "method", "default_tile", "default_us", "best_tile", "best_us",
            "best_gb_s", "bf16_us", "best_vs_bf16"]))
    if "decode" in args.parts:
        kw = engine_overrides(args.engine_args)
        kw.setdefault("device", str(device))
        report["decode"] = []
        for b in args.batch_sizes:  # the copy rate (bytes read + written) as the read rate
            report["decode"] += bench_decode(args, b, kw, device, dtype, ceil["bandwidth_gb_s"])
        tables.append("## decode\n\n" + markdown_table(report["decode"], [
            "method", "batch", "step_ms", "tok_s", "speedup", "speedup_vs_hf", "kv_blocks", "kv_bytes_per_token",
            "weight_mb_per_step", "floor_ms",
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
