#!/bin/bash
# GPU run 33, call 5 (asked as nvidia-h100-x1): calls 3-4's H200 result on an H100. Batch 1, every flag + pdl,
# alternated: A = HEAD (every one-row norm fused into its projection), act = gate/up's norm a kernel of its own,
# both = QKV's too, at the plain tile (8, 256, 8, 0) (the best of call 4 on the H200). Qwen3-4B and Qwen3-0.6B.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { INFER_EXP_UNFUSE="${2%%:*}" INFER_EXP_TILES="${2#*:}" timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 \
  --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json \
  > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 [$2] batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
V=": act: both:6144,2560,0,0=8,256,8,0"
for i in 1 2; do for v in $V; do run qwen3-4b $v; done; done
for i in 1 2; do for v in $V; do run qwen3-0.6b $v; done; done
