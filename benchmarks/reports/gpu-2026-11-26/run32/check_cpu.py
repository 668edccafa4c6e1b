"""Run 32: persistent.py against the engine's kernel and the plain-PyTorch reference under the Triton
interpreter (CPU, float32, small shapes): python check_cpu.py"""
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import persistent as ps  # noqa: E402
import torch  # noqa: E402

from infer.kernels import skinny_gemm as sg  # noqa: E402

torch.manual_seed(0)
for m, n, k, act, norm, add, programs, stages in [(1, 40, 96, None, 0, False, 3, 0), (1, 24, 64, "silu", 1, False, 2, 0),
                                                  (1, 40, 96, None, 2, False, 4, 3), (2, 17, 80, "silu", 2, False, 3, 3),
                                                  (1, 33, 64, None, 0, True, 5, 0), (3, 16, 48, None, 1, True, 1, 3)]:
    x = torch.randn(m, k)
    w = torch.randn((2 if act else 1) * n, k) * 0.1
    res = torch.randn(m, k) if norm == 2 else None
    nw = torch.rand(k) + 0.5 if norm else None
    a = torch.randn(m, n) if add else None
    cfg = (8, 32, 1, stages)
    y, r_out = ps.persistent_linear(x, w, programs, cfg, residual=res, norm_weight=nw, activation=act, add=a)
    yn, rn = ps.persistent_linear(x, w, programs, cfg, residual=res, norm_weight=nw, activation=act, add=a,
                                  nested=True)
    assert torch.equal(yn, y) and (rn is None or torch.equal(rn, r_out)), "nested differs from flattened"
    if norm:
        ref, r_ref = sg.skinny_norm_linear_reference(x, res, nw, 1e-6, False, w, None, act)
        eng, r_eng = sg.skinny_norm_linear(x, res, nw, 1e-6, False, w, None, act, config=cfg)
    else:
        ref, r_ref = sg.skinny_linear_reference(x, w), None
        eng, r_eng = sg.skinny_linear(x, w, config=cfg), None
    if add:
        ref, eng = ref + a, eng + a
    ok = torch.allclose(y, ref, atol=1e-4, rtol=1e-4) and (r_out is None or torch.equal(r_out, r_ref))
    print(m, n, k, act, norm, add, programs, stages, "ref ok" if ok else "REF MISMATCH",
          f"max|y-engine| {(y - eng).abs().max().item():.2e}")
    assert ok
print("all ok")
