"""Hybrid linear attention (phase 17): decode cost vs context length, hybrid beside dense.

    # CPU: the small pair (8 layers, hidden 512; the hybrid has 6 Gated DeltaNet + 2 attention layers)
    python benchmarks/hybrid.py --device cpu --contexts 256 1024 4096 8192
    # GPU (H100/H200): Qwen3.5-4B shapes beside Qwen3-4B, bf16, random weights generated on the device
    python benchmarks/hybrid.py --device cuda --hybrid qwen3.5-4b --dense qwen3-4b \\
        --contexts 1024 8192 32768 --engine-args attention_backend=triton --kernels --out /tmp/phase17-gpu
    # the Gated DeltaNet kernels alone (no engine): infer's Triton decode step against fla's, the prefill rule
    python benchmarks/hybrid.py --device cuda --hybrid qwen3.5-4b --contexts --kernels --out /tmp/phase17-kernels

For each model (two checkpoints of ``scripts/make_synthetic_checkpoint.py`` presets, written with
``--random-weights``: config and tokenizer only, the loader generates the weights on the device) and
each context length ``L``: one request with an ``L``-token prompt runs alone; after its prefill,
``--steps`` decode steps are timed as the engine runs them (TPOT: their wall time over ``steps``;
``prefill_ms``: the prefill's steps, after a warm-up request of up to 64 tokens has compiled the
kernels). Beside it the bytes one sequence holds (K/V of ``L`` tokens in the attention layers, plus
the hybrid's recurrent state) and the batch-1 bandwidth floor (weights + that cache + the state read
and written, over the bandwidth measured in the same run: :func:`common.decode_floor_s`).

``--kernels`` (GPU) also times the Gated DeltaNet decode step alone at the hybrid's shapes, batch 1
and 16: the plain-PyTorch reference, infer's Triton kernels, and flash-linear-attention's
``fused_recurrent_gated_delta_rule`` when the ``fla`` package is importable (``pip install --no-deps
flash-linear-attention fla-core``), with infer's state bandwidth (the float32 states read and written
over its time), replayed from a CUDA graph as the engine replays them (a step of a few microseconds
timed call by call would measure its launch); and the chunked prefill form over ``--kernel-tokens``
(4,096) tokens (infer's plain PyTorch and infer's three Triton kernels against fla's
``chunk_gated_delta_rule``). With no ``--contexts`` the kernels run alone. ``--engine-args
linear_attention_backend=triton`` (or ``fla``) runs the engines' prefills through those kernels
(``EngineConfig.linear_attention_backend``).

Writes ``hybrid.json``, ``hybrid.md`` and ``hybrid.png`` into ``--out`` (default ``benchmarks/runs/hybrid``).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import (
    bench,
    bench_graphed,
    ceilings,
    decode_floor_s,
    engine_overrides,
    environment,
    free_device_memory,
    markdown_table,
    out_argument,
    print_row,
    save_figure,
    sync,
    write_report,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


def make_model_dir(preset: str, root: Path) -> Path:
    from make_synthetic_checkpoint import make_checkpoint

    return make_checkpoint(preset, root / preset, dtype="bf16", device="cpu", random_weights=True)


def prefill_and_decode(engine, prompt: list[int], steps: int) -> tuple[float, float, float, int]:
    """Seconds of one request's prefill running alone (its steps until the first token: the TTFT less the
    request's set-up), then the TPOT of ``steps`` decode steps after it, the minimum step, and how many of
    the timed steps replayed a CUDA graph.

    The decode steps run as the engine runs them, not synchronized one by one: with async scheduling the
    host prepares step ``k + 1`` while the device runs step ``k``, and a synchronization around every step
    would add that host work to each (~0.5 ms a step on an H200's host, session 73). TPOT is the wall
    time of the ``steps`` steps up to the device's end over ``steps`` (the tokens they produced); the
    minimum step (the steadier number on a shared CPU, where other processes stretch some steps) is
    the shortest call of ``engine.step()`` after the first."""
    from infer.sampling import SamplingParams

    dev = engine.runner.device
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    sync(dev)
    start = time.perf_counter()
    while engine.scheduler.running == [] or engine.scheduler.running[0].in_prefill:
        engine.step()  # the prefill (in chunks when chunked prefill is on)
    sync(dev)
    prefill = time.perf_counter() - start
    engine.step()  # the first decode: out of the timing (lazy allocations)
    times, routes = [], []
    traced = engine.runner.on_executed  # a step tracer's, if any: still called

    def note(out) -> None:
        routes.append(out.graph)
        if traced is not None:
            traced(out)

    engine.runner.on_executed = note
    sync(dev)
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    sync(dev)
    tpot = (time.perf_counter() - start) / steps
    engine.runner.on_executed = traced
    while engine.has_unfinished_requests():
        engine.step()
    return prefill, tpot, min(times[1:] or times), routes.count("decode")


def measure_model(path: Path, contexts: list[int], steps: int, device: str, dtype: str, overrides: dict[str, Any],
                  bandwidth: float) -> list[dict[str, Any]]:
    from infer.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine

    max_len = max(contexts) + steps + 8
    kw = dict(dict(max_num_seqs=1, kv_cache="paged", batching="continuous", chunked_prefill=True,
                   max_num_batched_tokens=2048), **overrides)
    engine = LLMEngine(EngineConfig(model=str(path), device=device, dtype=dtype, max_model_len=max_len, **kw),
                       progress=False)
    cfg, dt = engine.loaded.config, engine.runner.dtype
    sdt = engine.config.resolved_ssm_state_dtype()  # the state slots' dtype (ssm_state_dtype=bfloat16: 2 bytes)
    rows = []
    rng = random.Random(0)
    warm = min(64, max(contexts))  # a warm-up request (compiles)
    prefill_and_decode(engine, [rng.randrange(cfg.vocab_size - 8) for _ in range(warm)], 2)
    for n in contexts:
        prompt = [rng.randrange(cfg.vocab_size - 8) for _ in range(n)]
        prefill, tpot, best, graphed = prefill_and_decode(engine, prompt, steps)
        kv, state = cfg.kv_bytes_per_token(dt) * n, cfg.state_bytes_per_seq(dt, sdt)
        row = {"model": path.name, "layers": f"{cfg.num_layers - cfg.num_kv_layers} linear + {cfg.num_kv_layers} attn",
               "context": n, "prefill_ms": prefill * 1e3, "tpot_ms": tpot * 1e3, "min_step_ms": best * 1e3,
               "kv_mib": kv / 2**20,
               "state_mib": state / 2**20, "graph_steps": f"{graphed}/{steps}",
               "floor_ms": decode_floor_s(cfg, dt, n, bandwidth, sdt) * 1e3}
        row["floor_ratio"] = row["tpot_ms"] / row["floor_ms"]
        print_row(row)
        rows.append(row)
    del engine
    free_device_memory()
    return rows


def _fla():
    """flash-linear-attention's ``(chunk, fused_recurrent)`` gated delta rule, or ``(None, why not)``."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as e:
        return None, f"fla not importable ({e})"
    return (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule), None


def decode_kernel_row(cfg, b: int, device: torch.device, fla) -> dict[str, Any]:
    """One Gated DeltaNet layer's decode step for ``b`` sequences: plain PyTorch, infer's Triton, fla's (its
    recurrent rule alone, without the convolution). ``infer_state_gb_s``: the float32 states read and written
    (``2 b Hv Dk Dv`` x 4 bytes, what bounds the step) over infer's time."""
    from infer.kernels import gated_delta_reference as ref
    from infer.kernels import gated_delta_triton as tri

    nk, hv, dk, dv, k = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    c, dtype = 2 * nk * dk + hv * dv, torch.bfloat16
    w = torch.randn(c, k, device=device, dtype=dtype) * 0.3
    slots, has = torch.arange(b, device=device), torch.ones(b, dtype=torch.bool, device=device)
    conv = torch.zeros(64, c, k - 1, device=device, dtype=dtype)
    ssm = torch.zeros(64, hv, dk, dv, device=device)
    x = torch.randn(b, c, device=device, dtype=dtype)
    a, bb = torch.randn(b, hv, device=device, dtype=dtype), torch.randn(b, hv, device=device, dtype=dtype)
    a_log, dt_bias = torch.randn(hv, device=device), torch.randn(hv, device=device)
    g, beta = ref.gating(a, bb, a_log, dt_bias)  # fla's kernel takes them computed
    row = {"op": f"decode step, batch {b}"}

    def us(fn) -> float:  # microseconds of the device's work (CUDA graph replays); on the CPU 2 interpreted calls
        return bench_graphed(fn, device, cpu_repeats=2, cpu_warmup=1) * 1e6

    row["torch_us"] = us(lambda: ref.decode_step(x, a, bb, a_log, dt_bias, conv, ssm, slots, has, w, nk))
    row["infer_triton_us"] = us(lambda: tri.decode_step(x, a, bb, a_log, dt_bias, conv, ssm, slots, has, w, nk))
    row["infer_state_gb_s"] = 2 * b * hv * dk * dv * 4 / row["infer_triton_us"] / 1e3
    if fla is not None:  # its recurrent rule alone (the convolution done beforehand), [B, T=1, H, D] inputs
        q, kk, v = (u.to(dtype)[:, None] for u in ref.split_qkv(ref.causal_conv1d_update(x, conv[:b], w)[0],
                                                                nk, dk, hv, dv))
        state = ssm[:b]
        row["fla_us"] = us(lambda: fla[1](q, kk, v, g[:, None], beta[:, None], initial_state=state,
                                          output_final_state=True))
    return row


def kernel_rows(cfg, device: torch.device, tokens: int = 4096) -> list[dict[str, Any]]:
    """The decode step (batch 1 and 16) and a ``tokens``-token chunked prefill of one Gated DeltaNet layer."""
    from infer.kernels import gated_delta_reference as ref

    fla, why = _fla()
    rows = [decode_kernel_row(cfg, b, device, fla) for b in (1, 16)]
    hv, dk, dv, t = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, tokens
    q, kk = (ref.l2norm(torch.randn(t, hv, dk, device=device)) for _ in range(2))
    v, g, beta = torch.randn(t, hv, dv, device=device), -torch.rand(t, hv, device=device), torch.rand(t, hv, device=device)
    row = {"op": f"chunked prefill, {t} tokens"}
    # (timed with triton's do_bench on a GPU: calls queued back to back, the host's launches hidden behind the
    # device's work where that is longer, as in a prefill step; no graph: fla's chunked rule is not captured)
    row["torch_us"] = bench(lambda: ref.chunk_gated_delta_rule(q, kk, v, g, beta), device, 2, 1) * 1e6
    if device.type == "cuda":  # infer's three Triton kernels, on bf16 inputs as the engine gives them
        from infer.kernels import gated_delta_triton as tri

        low = [a.to(torch.bfloat16) for a in (q, kk, v)]
        row["infer_triton_us"] = bench(lambda: tri.chunk_gated_delta_rule_varlen(*low, g, beta, [t]), device) * 1e6
    if fla is not None:
        args = [a.to(torch.bfloat16)[None] for a in (q, kk, v)] + [g[None], beta.to(torch.bfloat16)[None]]
        row["fla_us"] = bench(lambda: fla[0](*args, output_final_state=True), device) * 1e6
    rows.append(row)
    for r in rows:
        print_row(r)
    if why:
        print(why)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        label = f"{model} ({rs[0]['layers']})"
        line = ax1.plot([r["context"] for r in rs], [r["tpot_ms"] for r in rs], "o-", label=f"{label}, TPOT")
        ax1.plot([r["context"] for r in rs], [r["min_step_ms"] for r in rs], "o--", color=line[0].get_color(), alpha=0.5,
                 label=f"{label}, shortest step")
        ax2.plot([r["context"] for r in rs], [r["kv_mib"] + r["state_mib"] for r in rs], "o-", label=label)
    for ax, what in ((ax1, "decode step, batch 1 (ms)"), (ax2, "KV + state per sequence (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--hybrid", default="small-qwen3.5", help="preset of scripts/make_synthetic_checkpoint.py")
    ap.add_argument("--dense", default="small-qwen3", help="preset of the attention-only model beside it")
    ap.add_argument("--contexts", type=int, nargs="*", default=[256, 1024, 4096],
                    help="context lengths of the engine runs (none, with --kernels: the kernels alone)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    ap.add_argument("--engine-args", nargs="*", default=[], help="EngineConfig overrides, FIELD=VALUE")
    ap.add_argument("--kernels", action="store_true", help="also time the decode step's kernels (GPU)")
    ap.add_argument("--kernel-tokens", type=int, default=4096, help="--kernels: the chunked prefill's tokens")
    out_argument(ap, "hybrid", "output folder")
    args = ap.parse_args(argv)
    if not args.contexts and not args.kernels:
        ap.error("no --contexts and no --kernels: nothing to measure")
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    overrides = engine_overrides(args.engine_args)
    bw = ceilings(device, quick=device.type != "cuda")["bandwidth_gb_s"]  # the 2 GiB copy on a GPU (decode reads GBs)
    print(f"measured bandwidth {bw:.1f} GB/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in (args.hybrid, args.dense) if args.contexts else ():
            rows += measure_model(make_model_dir(preset, Path(tmp)), args.contexts, args.steps, str(device), dtype,
                                  overrides, bw)
    hybrid = {r["context"]: r for r in rows if r["model"] == args.hybrid}
    for r in rows:  # the dense model's step over the hybrid's, at the same context (TPOT and shortest step)
        r["vs_hybrid"] = r["tpot_ms"] / hybrid[r["context"]]["tpot_ms"]
        r["min_vs_hybrid"] = r["min_step_ms"] / hybrid[r["context"]]["min_step_ms"]
    cols = ["model", "layers", "context", "tpot_ms", "vs_hybrid", "min_step_ms", "min_vs_hybrid", "floor_ms",
            "floor_ratio", "kv_mib", "state_mib", "graph_steps", "prefill_ms"]
    table = markdown_table(rows, cols) if rows else ""
    krows = []
    if args.kernels:
        from infer.loader import read_model_config

        with tempfile.TemporaryDirectory() as tmp:
            krows = kernel_rows(read_model_config(make_model_dir(args.hybrid, Path(tmp))), device, args.kernel_tokens)
        table += ("\n\n" if table else "") + markdown_table(krows, ["op", "torch_us", "infer_triton_us",
                                                                     "infer_state_gb_s", "fla_us"])
    out = Path(args.out)
    report = {"env": environment(device), "bandwidth_gb_s": bw, "args": vars(args), "rows": rows, "kernels": krows}
    write_report(report, out / "hybrid.json", table)
    if rows:
        plot(rows, out / "hybrid.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
