#!/bin/bash
# Run 36 call 4: the engine's TPOT against its bucket-1 graph replayed back to back (graph_only.py), HEAD, batch 1,
# every phase 8-9 flag + pdl; and whether a Triton kernel reads and writes pinned host memory (UVA).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt; R=benchmarks/reports/gpu-2026-11-27/run36
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for p in qwen3-4b qwen3-0.6b; do
  echo "== $p"; PYTHONPATH=$PWD/src timeout 150 python3 $R/graph_only.py $CK/$p "$ALL" 2>&1 | grep -v -i warn | tail -12
done
echo "wall $(( $(date +%s) - T0 )) s"
