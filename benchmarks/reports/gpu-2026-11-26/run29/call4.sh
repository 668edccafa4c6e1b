#!/bin/bash
# GPU run 29, call 4: run 27's per-kernel end deltas (trace_deltas.py: torch.profiler's device events during
# step_profile.py's profiled batch-1 steps) at this code, Qwen3-4B, every flag + pdl; run 27 call 7b took them
# on an H200 before the pipelined K loop.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
[ -d $CK/qwen3-4b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
timeout 150 python3 benchmarks/reports/gpu-2026-11-26/run27/trace_deltas.py --model $CK/qwen3-4b --device cuda \
  --dtype bfloat16 --max-num-seqs 1 --num-requests 1 --min-len 128 --max-len 128 --min-output-len 400 \
  --max-output-len 400 --temperature 0 --skip 5 --steps 10 --unsync-steps 10 --profile-steps 10 --top 14 --no-progress \
  --infer-configs "$ALL" --out $L/step1.json > $OUT/call4_trace_deltas.log 2>&1; echo rc=$?
grep -B 3 -A 30 "end deltas" $OUT/call4_trace_deltas.log | head -40
