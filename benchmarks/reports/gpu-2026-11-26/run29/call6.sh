#!/bin/bash
# GPU run 29, call 6: A = 5be680f's src (.base/src) against the working tree: decode_num_splits caps a narrow batch's
# slices at ceil(max_context / 64) (MIN_SPLIT_KEYS, one key tile) instead of ceil(max_context / 256). Batch 1 with
# single_stream.py (max_model_len = prompt + 136): Qwen3-4B 128-token prompts (A: 2 slices, B: up to 4 of 64 keys),
# 1,024-token prompts (A: 5 slices of ~256 keys, B: up to 18 of 64), Qwen3-0.6B 128; then the GPU tests of the kernels
# and of the fused engine on B.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) timeout 90 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens $3 --output-len 128 --repeats 3 --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 prompt $3 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B A B; do run qwen3-4b $v 128; done
for v in A B A B; do run qwen3-4b $v 1024; done
for v in A B A B; do run qwen3-0.6b $v 128; done
export PYTHONPATH=$PWD/src
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_fused_engine.py > $OUT/call6_tests.log 2>&1
echo "B: kernel + fused-engine GPU tests rc=$?"; tail -2 $OUT/call6_tests.log
