#!/bin/bash
# GPU run 33, call 7: Qwen3-0.6B's QKV (K = 1,024) after the norm's own kernel, at the tile of a projection after a
# norm (8, 256, 8) (call 6's code, A = .base/src) against the plain one-row tile (2, 512, 2) (Q = the working tree:
# (8, 256, 8) only for K >= 2,048). Calls 3 and 6 hinted at 0.937 against 0.951 ms. Batch 1, every flag + pdl.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
[ -d $CK/qwen3-0.6b ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b --device cuda >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
run() { PYTHONPATH=$(src $2) timeout 40 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A Q A Q; do run qwen3-0.6b $v; done
