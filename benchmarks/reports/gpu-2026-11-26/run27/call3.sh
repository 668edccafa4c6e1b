#!/bin/bash
# GPU run 27, call 3: what the QK norm + RoPE kernel and the decode attention cost a Qwen3-4B batch-1 step, measured
# by leaving them out (call3_experiment.patch, INFER_EXP_SKIP: "qknorm" passes q/k/v through unrotated and writes no
# cache row, "attn" passes q as the attention's output; the tokens are wrong, the other kernels' work is the same).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
[ -d $CK/qwen3-4b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { INFER_EXP_SKIP=$2 timeout 80 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 skip=[$2] batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in none qknorm attn qknorm,attn none qknorm attn qknorm,attn; do run qwen3-4b $v; done
