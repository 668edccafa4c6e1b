"""Run 27 call 2: microseconds per call (PDL, back to back, weights from HBM) of Qwen3-4B's o and down projections
with the residual add in their epilogue, by where the residual slice is loaded (INFER_EXP_ADD: 1 after the PDL wait,
before the loop; 2 after the loop; 3 before the PDL wait), against the product alone."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
from skinny_gemm import time_us  # noqa: E402

from infer.kernels import pdl  # noqa: E402
from infer.kernels import skinny_gemm as sg  # noqa: E402

h, i, q = 2560, 9728, 4096
dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)


r = rnd(1, h)
print("| projection | variant | us per call (PDL), twice |\n|---|---|---|")
with pdl.scope():
    for name, n, k in (("o", h, q), ("down", h, i)):
        ws = [rnd(n, k, scale=0.02) for _ in range(max(2, (256 << 20) // (n * k * 2)))]
        a = rnd(1, k)
        for mode in ("plain", "1", "2", "3", "plain", "1", "2", "3"):
            os.environ["INFER_EXP_ADD"] = mode if mode != "plain" else "1"
            t = time_us(lambda a_, w, n=n, mode=mode: sg._launch(a_, w, None, n, None,
                                                                 add=None if mode == "plain" else r)[0], ws, a)
            print(f"| {name} | {'plain' if mode == 'plain' else 'ADD ' + mode} | {t:.2f} |")
        del ws
