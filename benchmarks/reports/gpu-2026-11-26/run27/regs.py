"""Run 27: registers per thread of the one-row projections at Qwen3-4B shapes (sm_90, Triton's bundled ptxas -v; no
GPU needed), with their default tiles and grids. Run in the repository root with PYTHONPATH=src:

    python benchmarks/reports/gpu-2026-11-26/run27/regs.py
"""
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from infer.kernels import skinny_gemm as sk

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
bf = "*bf16"
sig = {"x_ptr": bf, "r_ptr": bf, "r_out_ptr": bf, "nw_ptr": bf, "w_ptr": bf, "b_ptr": bf, "add_ptr": bf, "y_ptr": bf,
       "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_rm": "i32", "stride_om": "i32",
       "stride_wn": "i32", "stride_am": "i32", "stride_ym": "i32", "up_offset": "i64", "eps": "fp32"}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
         if sig[n].startswith("*") or n.startswith("stride") or n == "K"}
print("| projection | tile (BLOCK_N, BLOCK_K, warps) | programs | ptxas |\n|---|---|---|---|")
for name, n, k, norm, act, add in (("norm + QKV", 6144, 2560, 1, 0, 0), ("o + residual", 2560, 4096, 0, 0, 1),
                                   ("norm + gate/up + SiLU", 9728, 2560, 1, 1, 0), ("down + residual", 2560, 9728, 0, 0, 1)):
    bn, bk, w, _ = sk.default_config(1, n, k, act=bool(act), norm=norm > 0)  # run 28 added STAGES
    consts = {"M_PAD": 1, "BLOCK_N": bn, "BLOCK_K": bk, "HAS_BIAS": False, "NORM": norm, "UNIT_OFFSET": False,
              "ACT": act, "ADD": add, "USE_PDL": True, "MANUAL_BF16": False,
              "NORM_K_PAD": norm and sk._norm_k_pad(1, k, w), "STAGES": 0}  # the register loop, as in run 27
    kernel = triton.compile(ASTSource(fn=sk._skinny_gemm_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                                      constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": w})
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        open(ptx, "w").write(kernel.asm["ptx"])
        info = subprocess.run([PTXAS, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stderr
    used = next(line.split(":", 1)[1].strip() for line in info.splitlines() if "registers" in line)
    print(f"| {name} | {(bn, bk, w)} | {triton.cdiv(n, bn)} | {used} |")
