#!/bin/bash
# GPU run 31, call 1: the fused MLP kernel (src/infer/kernels/fused_mlp.py) at Qwen3-4B / 0.6B / 8B MLP shapes:
# correctness against the reference, then us per layer of a 36-layer chain (CUDA graph, PDL) against the two
# one-row kernels the engine runs today; a tile sweep at Qwen3-4B.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/reports/gpu-2026-11-26/run31
timeout 150 python3 $D/mlp_bench.py --shapes 4b,0.6b,8b || echo "exit $?"
timeout 330 python3 $D/mlp_bench.py --shapes 4b --sweep || echo "exit $?"
