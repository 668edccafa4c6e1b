"""Fused decoder-layer ops (phase 8): each Triton kernel vs its PyTorch reference vs the unfused code.

    python benchmarks/fused_kernels.py                                           # H100/H200, ~1-2 min
    python benchmarks/fused_kernels.py --models qwen3-4b --tokens 1 2048        # a subset
    python benchmarks/fused_kernels.py --tune --tokens 1 256 2048               # + launch-choice sweep
    TRITON_INTERPRET=1 python benchmarks/fused_kernels.py --device cpu --out /tmp/fk  # smoke test

The four operations of ``infer.kernels`` at Qwen3-0.6B (hidden 1024, 16 q / 8 kv heads, head_dim 128,
intermediate 3072) and Qwen3-4B (hidden 2560, 32 / 8 heads, head_dim 128, intermediate 9728) shapes,
bf16, for T = 1, 8, 64, 256 and 2048 tokens (T = 1 is batch-1 decode, 256 a large decode batch, 2048 a
prefill chunk):

* ``rms_norm``            the final/input norm alone            unfused: layers.rms_norm
* ``fused_add_rms_norm``  residual add + the next norm           unfused: ``h = h + x``; layers.rms_norm(h)
* ``qk_norm_rope``        Qwen3 QK-norm + RoPE (cos/sin cache)  unfused: q_norm, k_norm, cat, apply_rope
                                                                (cos/sin tables made once per step: not timed)
* ``act_and_mul``         SiLU(gate) * up                       unfused: F.silu(gate) * up (separate tensors)

Three variants per row: ``fused`` (the Triton kernel, ``infer.kernels.fused_triton``), ``reference``
(``infer.kernels.fused_reference``, what runs on the CPU) and ``unfused`` (the code of
``infer.models.layers``). Timing: ``n`` calls on ``n`` different input buffers (enough that they do not
all fit in L2, at most 32) are captured in one CUDA graph and replayed (``triton.testing.do_bench``,
median, L2 cleared before each replay); the time of one call is the replay time / ``n``. So Python's
launch overhead is left out: this is the device time a captured decode step pays. At small T the
data is tiny and the time is the kernels' latency (a few µs per launch), not bandwidth.

Bandwidth: ``fused_gb_s`` = the bytes the fused op must move (each input read once, each output
written once; per element in the table of docs/phases/08-fused-kernels.md) / its time, and
``fused_frac`` that as a fraction of the device copy bandwidth (read + write) measured in the same run
(``common.ceilings``). The reference and unfused columns are given as times and as speed-ups of the
fused kernel over them.

Writes ``fused_kernels.json`` (commit, hardware, versions, ceilings, every row) and
``fused_kernels.md`` (the table) into ``--out DIR`` (default ``benchmarks/runs/``). On the CPU (``--device cpu``, ``TRITON_INTERPRET=1``)
the same program runs at tiny float32 shapes with wall-clock timing; it checks the program, not the
speed.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import (
    capture_calls,
    ceilings,
    environment,
    markdown_table,
    out_argument,
    print_row,
    resolve_device,
    sync,
    timed,
    write_report,
)

MODELS = {
    "qwen3-0.6b": {"hidden": 1024, "hq": 16, "hkv": 8, "d": 128, "inter": 3072, "theta": 1e6},
    "qwen3-4b": {"hidden": 2560, "hq": 32, "hkv": 8, "d": 128, "inter": 9728, "theta": 1e6},
}
CPU_MODEL = {"tiny": {"hidden": 40, "hq": 2, "hkv": 1, "d": 16, "inter": 24, "theta": 1e4}}
GPU_TOKENS = [1, 8, 64, 256, 2048]
CPU_TOKENS = [1, 3]
OPS = ["rms_norm", "fused_add_rms_norm", "qk_norm_rope", "act_and_mul"]
EPS = 1e-6
ROTATE_BYTES = 256 << 20  # the n input sets of one graph span at least this much (beyond L2), if n <= 32
MAX_COPIES = 32
MAX_POSITIONS = 4096


def bench_graph(fn, n: int, device: torch.device) -> float:
    """Seconds per call of ``fn(i)``: ``fn(0) .. fn(n-1)`` captured in one CUDA graph, replayed under
    do_bench (median); wall time of the same calls on the CPU."""
    if device.type != "cuda":
        return timed(lambda: [fn(i) for i in range(n)], device, repeats=3, warmup=1) / n
    import triton.testing

    graph = capture_calls(fn, n)
    t = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / 1e3
    del graph
    return t / n


def op_bytes(op: str, t: int, m: dict, item: int) -> int:
    """Bytes the fused op must move: inputs read once, outputs written once (weights included)."""
    h, hq, hkv, d, inter = m["hidden"], m["hq"], m["hkv"], m["d"], m["inter"]
    if op == "rms_norm":
        return 2 * t * h * item + h * item
    if op == "fused_add_rms_norm":
        return 4 * t * h * item + h * item
    if op == "qk_norm_rope":  # q and k heads read and written; one float32 cache row and a position each
        return 2 * t * (hq + hkv) * d * item + t * (d * 4 + 8) + 2 * d * item
    if op == "act_and_mul":
        return 3 * t * inter * item
    raise ValueError(op)


class Case:
    """Inputs of one (op, model, T): ``n`` independent copies, plus the weights and tables."""

    def __init__(self, op: str, t: int, m: dict, n: int, dtype, device, gen) -> None:
        from infer.config import RopeConfig
        from infer.kernels import fused_reference as ref
        from infer.models import layers

        self.op, self.t, self.m, self.n = op, t, m, n
        h, hq, hkv, d, inter = m["hidden"], m["hq"], m["hkv"], m["d"], m["inter"]

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

        self.w = rnd(h, scale=0.3)
        self.qw, self.kw = rnd(d, scale=0.3), rnd(d, scale=0.3)
        inv = layers.rope_inv_freq(d, RopeConfig(m["theta"])).to(device)
        self.cache = ref.build_cos_sin_cache(inv, MAX_POSITIONS, device)
        self.inv = inv
        self.sets = []
        for _ in range(n):
            if op in ("rms_norm", "fused_add_rms_norm"):
                s = {"x": rnd(t, h), "r": rnd(t, h, scale=3)}
            elif op == "qk_norm_rope":
                pos = torch.randint(0, MAX_POSITIONS, (t,), device=device, generator=gen)
                qkv = rnd(t, (hq + 2 * hkv) * d, scale=2)
                cos, sin = layers.rope_cos_sin(pos, inv, dtype)  # once per step in the unfused model
                s = {"qkv": qkv, "pos": pos, "q": qkv[:, : hq * d].reshape(t, hq, d).clone(),
                     "k": qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d).clone(), "cos": cos, "sin": sin}
            else:
                gu = rnd(t, 2 * inter, scale=2)
                s = {"gu": gu, "g": gu[:, :inter].clone(), "u": gu[:, inter:].clone()}
            self.sets.append(s)

    def call(self, variant: str, i: int):
        """One call of ``variant`` ("fused", "reference", "unfused") on input set ``i``; returns its output."""
        from infer.kernels import fused_reference, fused_triton
        from infer.models import layers

        s, m = self.sets[i], self.m
        if variant == "unfused":
            if self.op == "rms_norm":
                return layers.rms_norm(s["x"], self.w, EPS)
            if self.op == "fused_add_rms_norm":
                h = s["r"] + s["x"]
                return layers.rms_norm(h, self.w, EPS)
            if self.op == "qk_norm_rope":
                q, k = layers.rms_norm(s["q"], self.qw, EPS), layers.rms_norm(s["k"], self.kw, EPS)
                return layers.apply_rope(torch.cat((q, k), dim=1), s["cos"], s["sin"])
            return layers.ACTIVATIONS["silu"](s["g"]) * s["u"]
        impl = fused_triton if variant == "fused" else fused_reference
        if self.op == "rms_norm":
            return impl.rms_norm(s["x"], self.w, EPS)
        if self.op == "fused_add_rms_norm":
            return impl.fused_add_rms_norm(s["x"], s["r"], self.w, EPS)[0]
        if self.op == "qk_norm_rope":
            q, k, _ = impl.qk_norm_rope(s["qkv"], s["pos"], self.cache, m["hq"], m["hkv"], m["d"], self.qw, self.kw, EPS)
            return torch.cat((q, k), dim=1)
        return impl.act_and_mul(s["gu"], "silu")

    def fresh_copy(self, i: int = 0) -> dict:
        return {k: v.clone() for k, v in self.sets[i].items()}


def max_diff_fused_vs_unfused(case: Case) -> float:
    """Largest |fused - unfused| on the same (pristine) inputs: a correctness check beside the timing."""
    pristine = case.fresh_copy()
    case.sets[0] = {k: v.clone() for k, v in pristine.items()}
    fused = case.call("fused", 0).float()
    case.sets[0] = {k: v.clone() for k, v in pristine.items()}
    unfused = case.call("unfused", 0).float()
    case.sets[0] = pristine
    return (fused - unfused).abs().max().item()


def run_row(op: str, name: str, m: dict, t: int, dtype, device, ceil: dict, gen) -> dict:
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = op_bytes(op, t, m, item)
    n = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / nbytes))) if device.type == "cuda" else 2
    case = Case(op, t, m, n, dtype, device, gen)
    diff = max_diff_fused_vs_unfused(case)
    times = {}
    for variant in ("fused", "reference", "unfused"):
        times[variant] = bench_graph(lambda i, v=variant: case.call(v, i), n, device)
    bw = ceil["bandwidth_gb_s"]
    row = {"op": op, "model": name, "tokens": t, "bytes": nbytes, "copies": n,
           "fused_us": 1e6 * times["fused"], "reference_us": 1e6 * times["reference"],
           "unfused_us": 1e6 * times["unfused"],
           "fused_gb_s": nbytes / times["fused"] / 1e9, "fused_frac": nbytes / times["fused"] / 1e9 / bw,
           "speedup_vs_unfused": times["unfused"] / times["fused"],
           "speedup_vs_reference": times["reference"] / times["fused"],
           "max_abs_diff_fused_vs_unfused": diff}
    case.sets.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def tune(name: str, m: dict, tokens: list[int], dtype, device, ceil: dict, gen, gpu: bool) -> list[dict]:
    """Sweep the launch choices of the fused kernels (how the defaults were chosen): num_warps for every
    kernel, heads per program (BLOCK_H) for qk_norm_rope, columns per program (BLOCK) for act_and_mul.
    Only the fused variant is timed; each choice compiles its own variant."""
    import triton

    from infer.kernels import fused_triton as ft

    saved = (ft.num_warps_for, ft._qk_rope_config, ft._act_block)
    warps_list = (1, 2, 4, 8, 16) if gpu else (1, 4)
    rows = []
    item = torch.empty((), dtype=dtype).element_size()
    try:
        for op in OPS:
            for t in tokens:
                nbytes = op_bytes(op, t, m, item)
                n = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / nbytes))) if gpu else 1
                case = Case(op, t, m, n, dtype, device, gen)
                extra = {"qk_norm_rope": ("block_h", (1, 2, 4, 8)), "act_and_mul": ("block", (512, 1024, 2048, 4096))}
                key, values = extra.get(op, (None, (None,)))
                for warps in warps_list:
                    for v in values:
                        ft.num_warps_for = lambda _e, w=warps: w
                        if op == "qk_norm_rope":
                            ft._qk_rope_config = lambda h, _d, bh=v, w=warps: (min(bh, triton.next_power_of_2(h)), w)
                        if op == "act_and_mul":
                            ft._act_block = lambda i, b=v: min(b, triton.next_power_of_2(i))
                        try:
                            sec = bench_graph(lambda i, c=case: c.call("fused", i), n, device)
                            row = {"op": op, "model": name, "tokens": t, "num_warps": warps, "fused_us": 1e6 * sec,
                                   "fused_frac": nbytes / sec / 1e9 / ceil["bandwidth_gb_s"]}
                        except Exception as e:  # noqa: BLE001 (a choice that does not compile: note it)
                            row = {"op": op, "model": name, "tokens": t, "num_warps": warps, "error": type(e).__name__}
                        if key:
                            row[key] = v
                        rows.append(row)
                        print_row(row)
                case.sets.clear()
    finally:
        ft.num_warps_for, ft._qk_rope_config, ft._act_block = saved
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="cuda, cpu (needs TRITON_INTERPRET=1) or auto")
    out_argument(ap, "", "directory for fused_kernels.json/.md")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS),
                    help="model shapes (default: all; ignored on the CPU, which uses one tiny shape)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help=f"numbers of tokens T (default {GPU_TOKENS} on a GPU, {CPU_TOKENS} on the CPU)")
    ap.add_argument("--ops", nargs="+", default=OPS, choices=OPS, help="operations to measure (default: all)")
    ap.add_argument("--tune", action="store_true",
                    help="also sweep num_warps / heads per program / block size of the fused kernels")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = resolve_device(args.device)

    from infer.kernels import triton_common

    if device.type == "cpu" and not triton_common.INTERPRET:
        ap.error("on the CPU the kernels run under the Triton interpreter: set TRITON_INTERPRET=1")
    gpu = device.type == "cuda"
    models = {k: MODELS[k] for k in (args.models or MODELS)} if gpu else CPU_MODEL
    tokens = args.tokens or (GPU_TOKENS if gpu else CPU_TOKENS)
    dtype = torch.bfloat16 if gpu else torch.float32
    gen = torch.Generator(device=device).manual_seed(args.seed)

    print(f"measuring ceilings on {device} ...", flush=True)
    ceil = ceilings(device, quick=not gpu)
    print(f"copy {ceil['bandwidth_gb_s']:.0f} GB/s", flush=True)
    start = time.perf_counter()
    rows = []
    with torch.inference_mode():
        for name, m in models.items():
            for op in args.ops:
                for t in tokens:
                    row = run_row(op, name, m, t, dtype, device, ceil, gen)
                    rows.append(row)
                    print_row(row)
        tuned = [r for name, m in models.items() for r in tune(name, m, tokens, dtype, device, ceil, gen, gpu)] \
            if args.tune else None
    sync(device)
    report = {
        "benchmark": "fused_kernels",
        "env": environment(device),
        "dtype": str(dtype).replace("torch.", ""),
        "models": models,
        "ceilings": ceil,
        "method": "n calls on n input copies captured in one CUDA graph, replayed under do_bench (median, L2 "
                  "cleared per replay), time / n; fused_gb_s = minimal bytes of the op / fused time; fused_frac "
                  "= that / the copy bandwidth (read + write) measured in the same run",
        "rows": rows,
        "tune": tuned,
        "seconds": time.perf_counter() - start,
    }
    table = markdown_table(rows, ["op", "model", "tokens", "bytes", "fused_us", "reference_us", "unfused_us",
                                  "fused_gb_s", "fused_frac", "speedup_vs_unfused", "speedup_vs_reference",
                                  "max_abs_diff_fused_vs_unfused"])
    table += (f"\n\n{report['dtype']}; copy bandwidth {ceil['bandwidth_gb_s']:.0f} GB/s; "
              f"{report['env'].get('gpu') or report['env']['cpu']}")
    out = Path(args.out) / "fused_kernels.json" if args.out else None
    write_report(report, out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
