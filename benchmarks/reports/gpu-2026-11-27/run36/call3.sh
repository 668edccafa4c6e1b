#!/bin/bash
# Run 36 call 3: is the device idle between decode steps in single_stream.py's own loop? (idle_trace.py; run 35's
# trace came from step_profile.py, which synchronizes every step and showed ~75 us per step of gaps around the
# input copies.) HEAD, batch 1, every phase 8-9 flag + pdl.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt; R=benchmarks/reports/gpu-2026-11-27/run36
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for p in qwen3-4b qwen3-0.6b; do
  echo "== $p"; PYTHONPATH=$PWD/src timeout 120 python3 $R/idle_trace.py $CK/$p "$ALL" 2>&1 | grep -v Warning | tail -18
done
echo "wall $(( $(date +%s) - T0 )) s"
