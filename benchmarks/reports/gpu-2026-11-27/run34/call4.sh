#!/bin/bash
# GPU run 34, call 4: two cuts of a dependent chain (call4_experiment.patch on the working tree, .base = HEAD):
# M = INFER_EXP_STATIC_MERGE=1: the decode attention's last program merges the splits with every split's
#     loads unrolled (all in flight at once: one trip to L2, not one per split) when the grid has <= 8 splits;
# X = INFER_EXP_X_AHEAD=1: the skinny GEMM's register loop (QKV, o; STAGES 0) loads x's next slice with the
#     next weight tile instead of at the top of each step (the first programs of an SM miss L1 on each slice);
# MX = both. A = HEAD. Batch 1, every flag + pdl, alternated; then their GPU tests with the switches on.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
run() { INFER_EXP_STATIC_MERGE=$(case $2 in M|MX) echo 1;; *) echo 0;; esac) INFER_EXP_X_AHEAD=$(case $2 in X|MX) echo 1;; *) echo 0;; esac) \
  PYTHONPATH=$(src $2) timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 \
  --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json \
  > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for i in 1 2; do for v in A M X MX; do run qwen3-4b $v; done; done
for v in A M X MX; do run qwen3-0.6b $v; done
INFER_EXP_STATIC_MERGE=1 INFER_EXP_X_AHEAD=1 PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_paged.py tests/test_fused_kernels.py -k "decode or split or skinny" > $OUT/call4_tests.log 2>&1; tail -2 $OUT/call4_tests.log
echo "wall $(( $(date +%s) - T0 )) s"
