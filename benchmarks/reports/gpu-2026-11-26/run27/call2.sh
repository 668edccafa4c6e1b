#!/bin/bash
# GPU run 27, call 2: where the o/down epilogue's residual slice is loaded (call2_experiment.patch, INFER_EXP_ADD:
# 1 after the PDL wait, before the loop (call 1); 2 after the loop; 3 before the PDL wait). Per call (percall_add.py),
# then Qwen3-4B batch 1: A = f6b1bed (.base/src), B1/B2/B3 = the working tree with each mode.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
R=benchmarks/reports/gpu-2026-11-26/run27
(for p in qwen3-4b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
export PYTHONPATH=$PWD/src
timeout 100 python3 $R/percall_add.py > $OUT/percall_add.md 2>&1; cat $OUT/percall_add.md
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) INFER_EXP_ADD=${2#B} \
  timeout 80 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 \
  --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B1 B2 B3 A B1 B2 B3; do run qwen3-4b $v; done
