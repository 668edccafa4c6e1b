#!/bin/bash
# GPU run 28, call 3: the working tree (the skinny GEMM's pipelined K loop, STAGES 3 by default from 40 M weight
# elements: the LM head, a large gate/up) against A = 24eafa9 (.base/src). The rule's shapes (stages2.py), Qwen3-4B and
# 0.6B batch 1 alternated, the fused-kernel GPU tests and the fused engine's batch-1 / PDL tests.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
R=benchmarks/reports/gpu-2026-11-26/run28
(for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
export PYTHONPATH=$PWD/src
timeout 150 python3 $R/stages2.py > $OUT/stages2.md 2>&1; cat $OUT/stages2.md
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) \
  timeout 80 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 \
  --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B A B; do run qwen3-4b $v; done
for v in A B A B; do run qwen3-0.6b $v; done
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py tests/test_fused_engine.py > $OUT/tests.log 2>&1; echo "B: fused-kernel + fused-engine GPU tests rc=$?"; tail -1 $OUT/tests.log
