#!/bin/bash
# GPU run 30, call 5 (asked as nvidia-h200): the figures at HEAD: batch 1, every flag + pdl, Qwen3-4B and
# Qwen3-0.6B twice each (single_stream.py measures the copy-bandwidth floor in the same run); then offline
# throughput, Qwen3-0.6B, 256 requests, prompts uniform in [100, 1024], 512 output tokens each.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for p in qwen3-4b qwen3-0.6b qwen3-4b qwen3-0.6b; do
  timeout 90 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 --prompt-lens 128 \
  --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$p batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; done
timeout 150 python3 benchmarks/offline_throughput.py --model $CK/qwen3-0.6b --device cuda --dtype bfloat16 \
  --max-num-seqs 256 --max-num-batched-tokens 16384 --min-output-len 512 --max-output-len 512 --engines infer \
  --infer-configs "$ALL" --no-progress --no-ceilings --out $OUT/offline.json > $L/offline.log 2>&1 || tail -3 $L/offline.log
echo "offline: $(grep -E '^\| infer' $OUT/offline.md | head -1)"
