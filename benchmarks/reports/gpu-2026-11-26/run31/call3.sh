#!/bin/bash
# GPU run 31, call 3: where the fused MLP's time goes (Qwen3-4B): each of the two kernels alone; the fused kernel
# whole (EXP 0), without its reduction (1), without its down phase either (2), with a volatile-load spin (3).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/reports/gpu-2026-11-26/run31
C=""
for c in "64,128,256,32,8,1" "32,128,128,64,4,3" "32,128,256,64,8,3"; do for e in 0 1 2 3; do C="$C;$c,$e"; done; done
timeout 400 python3 $D/mlp_bench.py --shapes 4b --components --configs "${C#;}"
