#!/bin/bash
# GPU run 28, call 4: the register loop with AHEAD = 2 or 3 tiles in flight beyond the current one (all of them
# loaded before the PDL wait), call4_experiment.patch (INFER_EXP_AHEAD). Per call (ahead.py), then batch 1:
# A = c10d3b0 (.base/src), B2 / B3 = the working tree with INFER_EXP_AHEAD=2 / 3.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
R=benchmarks/reports/gpu-2026-11-26/run28
(for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
export PYTHONPATH=$PWD/src
timeout 100 python3 $R/ahead.py > $OUT/ahead.md 2>&1; cat $OUT/ahead.md
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) INFER_EXP_AHEAD=${2#B} \
  timeout 80 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 \
  --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B2 B3 A B2 B3; do run qwen3-4b $v; done
for v in A B2 A B2; do run qwen3-0.6b $v; done
