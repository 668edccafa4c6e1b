"""Run 27: microseconds per call of Qwen3-4B's one-row projections with PDL, back to back (CUDA-graph replays
over weight copies that miss L2; benchmarks/skinny_gemm.py's time_us), by what each kernel does around its product:

  qkv, gate_up (+ SiLU): the norm in the kernel with the residual add (NORM 2, before this run), without it (NORM 1,
    the residual added by the projection before: this run), or no norm at all (NORM 0: what a kernel whose input
    arrives normalized would cost);
  o, down: the product alone, or with the residual add in its epilogue (this run).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
from skinny_gemm import time_us  # noqa: E402

from infer.kernels import pdl  # noqa: E402
from infer.kernels import skinny_gemm as sg  # noqa: E402

h, i, q, kv = 2560, 9728, 4096, 1024
dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)


def copies(n, k):
    return [rnd(n, k, scale=0.02) for _ in range(max(2, (256 << 20) // (n * k * 2)))]


x, r, nw = rnd(1, h), rnd(1, h), rnd(h) + 1
rows = []
with pdl.scope():
    for name, n, k, act in (("qkv", q + 2 * kv, h, 0), ("gate_up+silu", 2 * i, h, 1)):
        ws = copies(n, k)
        nout = n // 2 if act else n
        for norm in (2, 1, 0):
            t = time_us(lambda a, w, nout=nout, norm=norm, act=act: sg._launch(
                a, w, None, nout, None, r if norm == 2 else None, nw if norm else None, 1e-6, False, act)[0], ws, x)
            rows.append((name, f"NORM {norm}", t))
        del ws
    for name, n, k in (("o", h, q), ("down", h, i)):
        ws = copies(n, k)
        a = rnd(1, k)
        for add in (False, True):
            t = time_us(lambda a_, w, n=n, add=add: sg._launch(a_, w, None, n, None, add=r if add else None)[0], ws, a)
            rows.append((name, "ADD" if add else "plain", t))
        del ws
print("| projection | variant | us per call (PDL) |\n|---|---|---|")
for name, v, t in rows:
    print(f"| {name} | {v} | {t:.2f} |")
