#!/bin/bash
# GPU run 34, call 3: how much of a batch-1 step is outside its CUDA graph (graph_gap.py), at HEAD.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt; for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
for i in 1 2; do for p in qwen3-4b qwen3-0.6b; do
  PYTHONPATH=$PWD/src timeout 120 python3 benchmarks/reports/gpu-2026-11-27/run34/graph_gap.py $CK/$p 2>&1 | grep -v Warning | tail -2
done; done
echo "wall $(( $(date +%s) - T0 )) s"
