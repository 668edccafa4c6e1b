"""Run 28: microseconds per call of Qwen3-4B's one-row projections with PDL, as the engine launches them (norm +
QKV and norm + gate/up + SiLU with NORM 1, o and down with the residual add, the LM head), by tile and by STAGES:
0 = the kernel's own double buffer in registers (one tile ahead), S >= 2 = Triton's pipeliner on the K loop
(`tl.range(num_stages=S)`: S - 1 tiles of W in flight through shared memory). Back-to-back CUDA-graph replays over
weight copies that miss L2 (benchmarks/skinny_gemm.py's time_us). Run in the repository root, PYTHONPATH=src."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
from skinny_gemm import time_us  # noqa: E402

from infer.kernels import pdl  # noqa: E402
from infer.kernels import skinny_gemm as sg  # noqa: E402

h, i, q, kv, v = 2560, 9728, 4096, 1024, 151936
dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)


def copies(n, k):
    return [rnd(n, k, scale=0.02) for _ in range(max(2, (256 << 20) // (n * k * 2)))]


TILES = {"qkv": [(8, 256, 8), (2, 256, 2), (4, 512, 4), (8, 512, 8)],
         "o": [(2, 1024, 4), (2, 512, 2), (4, 1024, 8)],
         "gate_up": [(2, 512, 2), (1, 512, 2), (2, 1024, 4)],
         "down": [(2, 2048, 8), (2, 1024, 4), (4, 1024, 8)],
         "lm_head": [(2, 512, 2)]}
x, r, nw = rnd(1, h), rnd(1, h), rnd(h) + 1
rows = []
with pdl.scope():
    for name, n, k in (("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * i, h), ("down", h, i), ("lm_head", v, h)):
        ws = copies(n, k) if name != "lm_head" else [rnd(n, k, scale=0.02) for _ in range(2)]
        act = 1 if name == "gate_up" else 0
        nout = n // 2 if act else n
        a = rnd(1, k)
        for tile in TILES[name]:
            for st in (0, 2, 3, 4):
                sg.EXP_STAGES[None] = st
                if name in ("qkv", "gate_up"):
                    fn = lambda a_, w, t=tile, nout=nout, act=act: sg._launch(a_, w, None, nout, t, None, nw, 1e-6, False, act)[0]  # noqa: E731
                elif name == "lm_head":
                    fn = lambda a_, w, t=tile: sg._launch(a_, w, None, w.shape[0], t)[0]  # noqa: E731
                else:
                    fn = lambda a_, w, t=tile, n=n: sg._launch(a_, w, None, n, t, add=r)[0]  # noqa: E731
                try:
                    us = time_us(fn, ws, x if name in ("qkv", "gate_up", "lm_head") else a)
                except Exception as e:  # noqa: BLE001 (a tile that does not compile or launch)
                    us = float("nan")
                    print(name, tile, st, "failed:", repr(e)[:200], file=sys.stderr)
                rows.append((name, tile, st, us))
                print(f"| {name} | {tile} | {st} | {us:.2f} |", flush=True)
        del ws
sg.EXP_STAGES[None] = 0
print("\nbest per projection:")
for name in TILES:
    rs = [r_ for r_ in rows if r_[0] == name and r_[3] == r_[3]]
    base = next(r_ for r_ in rs if r_[1] == TILES[name][0] and r_[2] == 0)
    best = min(rs, key=lambda r_: r_[3])
    print(f"{name}: default {base[3]:.2f} us, best {best[3]:.2f} us at tile {best[1]} STAGES {best[2]}")
