#!/bin/bash
# GPU run 29, call 3: batch-1 decode at e01a090 (5be680f's src), Qwen3-4B and Qwen3-0.6B, twice each, asked as an H200.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for p in qwen3-4b qwen3-0.6b qwen3-4b qwen3-0.6b; do
  timeout 80 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$p batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; cp $L/ss.md $OUT/ss_$p.md; done
