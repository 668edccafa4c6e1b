#!/bin/bash
# GPU run 25, call 2 (an H200 came): the batch-1 figures on the machine (single_stream.py,
# every phase 8-9 flag, pdl off and on, HF static + compile and the copy floor in the same run).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
[ -d $CK/qwen3-4b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1
[ -d $CK/qwen3-0.6b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b --device cuda >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for p in qwen3-4b qwen3-0.6b; do
  timeout 200 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL;$ALL,pdl=true" --out $OUT/single_$p.json > $L/s_$p.log 2>&1 || tail -3 $L/s_$p.log
  echo "$p:"; grep -E '^\| (infer|hf)' $OUT/single_$p.md | cut -d'|' -f2-9 | sed "s/$ALL/ALL/"
  grep -i floor $OUT/single_$p.md | head -3
done
rm -f $OUT/*.json
