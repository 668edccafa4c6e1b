#!/bin/bash
# GPU run 25, call 6: an experiment: the fewest keys of a flash-decoding slice when the batch is narrow
# (decode_split_plan's min_split_keys, 0 at 4f8f59f; INFER_EXP_MIN_SPLIT, read by this call's uncommitted
# code), batch 1 at Qwen3-4B shapes (every flag + pdl), 128- and 1024-token prompts, 128 outputs.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
[ -d $CK/qwen3-4b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for rep in 1 2; do
for ms in 0 128 256 512 1024; do
  export INFER_EXP_MIN_SPLIT=$ms
  timeout 100 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
    --prompt-lens 128 1024 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "min_split_keys $ms: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f3,5,8 | tr '\n' ' ')"
done; done
