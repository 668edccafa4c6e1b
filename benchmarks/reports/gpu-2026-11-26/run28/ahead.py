"""Run 28 call 4: microseconds per call of the one-row projections that keep the register loop (Qwen3-4B's norm +
QKV, o + add, down + add; Qwen3-0.6B's norm + QKV, o + add, norm + gate/up + SiLU, down + add), with AHEAD = 1, 2, 3
weight tiles in flight beyond the current one (call4_experiment.patch; AHEAD tiles are loaded before the PDL wait).
PDL, back-to-back CUDA-graph replays over weight copies that miss L2. Run in the repository root, PYTHONPATH=src."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
from skinny_gemm import time_us  # noqa: E402

from infer.kernels import pdl  # noqa: E402
from infer.kernels import skinny_gemm as sg  # noqa: E402

dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)


CASES = [("4b norm+qkv", 6144, 2560, "norm"), ("4b o+add", 2560, 4096, "add"), ("4b down+add", 2560, 9728, "add"),
         ("0.6b norm+qkv", 4096, 1024, "norm"), ("0.6b o+add", 1024, 2048, "add"),
         ("0.6b norm+gate_up+silu", 6144, 1024, "act"), ("0.6b down+add", 1024, 3072, "add")]
print("| shape | AHEAD 1 | AHEAD 2 | AHEAD 3 |\n|---|---|---|---|")
with pdl.scope():
    for label, n, k, kind in CASES:
        ws = [rnd(n, k, scale=0.02) for _ in range(max(2, (256 << 20) // (n * k * 2)))]
        x, nw, r = rnd(1, k), rnd(k) + 1, rnd(1, n)
        out = []
        for ahead in (1, 2, 3):
            sg.EXP_AHEAD[None] = ahead
            if kind == "norm":
                def fn(a, w, n=n, nw=nw):
                    return sg._launch(a, w, None, n, None, None, nw, 1e-6, False, 0)[0]
            elif kind == "act":
                def fn(a, w, n=n, nw=nw):
                    return sg._launch(a, w, None, n // 2, None, None, nw, 1e-6, False, 1)[0]
            else:
                def fn(a, w, n=n, r=r):
                    return sg._launch(a, w, None, n, None, add=r)[0]
            out.append(time_us(fn, ws, x))
        sg.EXP_AHEAD[None] = 1
        print(f"| {label} | " + " | ".join(f"{t:.2f}" for t in out) + " |", flush=True)
        del ws
