#!/bin/bash
# GPU run 31, call 6: a limited L2 prefetch before the PDL wait (call6_experiment.patch, INFER_EXP_PF_TILES=T: each
# one-row skinny-GEMM program asks L2, with one cp.async.bulk.prefetch.L2 per weight row, for the T tiles after the
# one it loads into registers; run 28 asked for the whole rows and lost, 3.51 -> 3.96 ms). Qwen3-4B batch 1, every
# flag + pdl: A = HEAD (.base/src), B1 / B2 / B4 = the working tree with T = 1, 2, 4; alternated twice.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
[ -d $CK/qwen3-4b ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) INFER_EXP_PF_TILES=${2#B} \
  timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 \
  --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B1 B2 B4 A B1 B2 B4; do run qwen3-4b $v; done
