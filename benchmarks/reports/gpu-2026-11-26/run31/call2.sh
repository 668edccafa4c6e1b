#!/bin/bash
# GPU run 31, call 2: the fused MLP's best tiles of call 1 and wider ones (BI 128, 16 warps), on row-major and on
# column-major down weights (is reading down by columns what loses?), against the two kernels; Qwen3-4B.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/reports/gpu-2026-11-26/run31
timeout 400 python3 $D/mlp_bench.py --shapes 4b --transposed \
  --configs "64,128,256,64,8,1;32,128,128,64,4,3;128,64,128,64,8,1;128,64,128,64,16,1;64,128,256,64,16,1;64,128,256,128,8,1;64,128,256,32,8,1;128,128,128,64,16,1"
