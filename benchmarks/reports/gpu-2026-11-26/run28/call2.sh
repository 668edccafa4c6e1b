#!/bin/bash
# GPU run 28, call 2: Triton's pipeliner on the skinny GEMM's K loop (call2_experiment.patch, STAGES: 0 = the kernel's
# register double buffer, S >= 2 = tl.range(num_stages=S), S - 1 weight tiles in flight through shared memory).
# Per call by tile and STAGES (stages.py), then Qwen3-4B batch 1: A = 24eafa9 (.base/src), B0/B3/B4 = the working
# tree with INFER_EXP_STAGES=0/3/4; the skinny GPU tests with STAGES 3.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
R=benchmarks/reports/gpu-2026-11-26/run28
(for p in qwen3-4b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
export PYTHONPATH=$PWD/src
timeout 220 python3 $R/stages.py > $OUT/stages.md 2>$OUT/stages.err; tail -6 $OUT/stages.md
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) INFER_EXP_STAGES=${2#B} \
  timeout 80 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 \
  --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B3 B4 B0 A B3 B4; do run qwen3-4b $v; done
INFER_EXP_STAGES=3 timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py -k "skinny or norm_linear or residual" > $OUT/tests.log 2>&1; echo "STAGES 3: skinny GPU tests rc=$?"; tail -1 $OUT/tests.log
