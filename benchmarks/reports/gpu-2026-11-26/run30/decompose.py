"""GPU run 30: what a one-row gate/up (and QKV) kernel pays for its norm and for its activation.

Times, with PDL and the default tiles, at Qwen3-4B's shapes (weights from HBM, CUDA-graph replays of
benchmarks/skinny_gemm.py's time_us): the plain product, the product + activation (ACT), the norm + product
(NORM 1, no residual: what the engine runs after an ADD epilogue), the norm + product + activation, and the
norm with a residual (NORM 2). Twice, interleaved."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
from skinny_gemm import time_us  # noqa: E402

from infer.kernels import pdl  # noqa: E402
from infer.kernels import skinny_gemm as sg  # noqa: E402

torch.manual_seed(0)
dev = "cuda"
for name, n, k in (("gate_up", 2 * 9728, 2560), ("qkv", 6144, 2560)):
    copies = max(2, (256 << 20) // (n * k * 2))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    res = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    nw = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
    act = "silu" if name == "gate_up" else None
    cases = {
        "plain": lambda a, w, k=k, nw=nw, res=res, act=act: sg.skinny_linear(a, w),
        "plain, norm tile": lambda a, w, k=k, nw=nw, res=res, act=act: sg._launch(a, w, None, w.shape[0], sg.default_config(1, w.shape[0], k, act=False, norm=True))[0],
        "act": lambda a, w, k=k, nw=nw, res=res, act=act: sg._launch(a, w, None, w.shape[0] // 2, None, act=1)[0],
        "norm1": lambda a, w, k=k, nw=nw, res=res, act=act: sg.skinny_norm_linear(a, None, nw, 1e-6, False, w)[0],
        "norm1+act": lambda a, w, k=k, nw=nw, res=res, act=act: sg.skinny_norm_linear(a, None, nw, 1e-6, False, w, activation=act)[0],
        "norm2+act": lambda a, w, k=k, nw=nw, res=res, act=act: sg.skinny_norm_linear(a, res, nw, 1e-6, False, w, activation=act)[0],
    }
    if act is None:
        for c in ("act", "norm1+act", "norm2+act"):
            cases.pop(c)
        cases["norm2"] = lambda a, w, nw=nw, res=res: sg.skinny_norm_linear(a, res, nw, 1e-6, False, w)[0]
    for rep in range(2):
        with pdl.scope():
            print(name, rep, {c: round(time_us(f, ws, x), 2) for c, f in cases.items()}, flush=True)
