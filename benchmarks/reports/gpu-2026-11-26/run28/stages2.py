"""Run 28 call 3: the pipelined K loop (STAGES 3/4) against the register loop (0) on the shapes the default rule
(skinny_gemm.default_config: STAGES 3 from 40 M weight elements) newly covers or leaves out: the LM heads of
Qwen3-4B and 0.6B, Qwen3-0.6B's gate/up, Qwen3-8B's gate/up and down. One row, PDL, back-to-back CUDA-graph replays
over weight copies that miss L2. Run in the repository root, PYTHONPATH=src."""
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


CASES = [  # label, weight rows, K, kind, tiles
    ("4b lm_head", 151936, 2560, "plain", [(2, 512, 2), (4, 512, 4), (1, 512, 2)]),
    ("0.6b lm_head", 151936, 1024, "plain", [(2, 512, 2), (4, 512, 4)]),
    ("0.6b norm+gate_up+silu", 2 * 3072, 1024, "act", [(2, 512, 2)]),
    ("8b norm+gate_up+silu", 2 * 12288, 4096, "act", [(2, 1024, 4)]),
    ("8b down+add", 4096, 12288, "add", [(2, 2048, 8)]),
]
print("| shape | tile | STAGES | us per call |\n|---|---|---|---|")
with pdl.scope():
    for label, n, k, kind, tiles in CASES:
        ws = [rnd(n, k, scale=0.02) for _ in range(max(2, (256 << 20) // (n * k * 2)))]
        x, nw = rnd(1, k), rnd(k) + 1
        r = rnd(1, n)
        for tile in tiles:
            for st in (0, 3, 4):
                c = (*tile, st)
                if kind == "act":
                    fn = lambda a, w, c=c, n=n, nw=nw: sg._launch(a, w, None, n // 2, c, None, nw, 1e-6, False, 1)[0]  # noqa: E731
                elif kind == "add":
                    fn = lambda a, w, c=c, n=n, r=r: sg._launch(a, w, None, n, c, add=r)[0]  # noqa: E731
                else:
                    fn = lambda a, w, c=c, n=n: sg._launch(a, w, None, n, c)[0]  # noqa: E731
                print(f"| {label} | {tile} | {st} | {time_us(fn, ws, x):.2f} |", flush=True)
        del ws
        torch.cuda.empty_cache()
