#!/bin/bash
# GPU run 31, call 4 (asked as nvidia-h200 on a fresh machine, for the H200 figure): batch 1 at HEAD, every
# flag + pdl, Qwen3-4B twice and Qwen3-0.6B once (run 30's call 8 script).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for p in qwen3-4b qwen3-4b qwen3-0.6b; do
  timeout 90 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 --prompt-lens 128 \
  --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$p batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; done
grep -E '^\| (hf|floor|copy)' $L/ss.md | head -3
