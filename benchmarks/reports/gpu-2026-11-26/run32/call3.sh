#!/bin/bash
# GPU run 32, call 3: as call 2 with the nested-loop variant and ptxas registers; the persistent-grid skinny GEMM (persistent.py) against the engine's one-row kernels in a
# chain of 36 Qwen3-4B layers' projections with PDL (persist_bench.py): correctness, a sweep of the program
# count per projection, the best combined and alternated with the engine's kernels.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 450 python3 benchmarks/reports/gpu-2026-11-26/run32/persist_bench.py
