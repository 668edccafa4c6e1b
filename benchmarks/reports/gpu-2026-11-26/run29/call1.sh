#!/bin/bash
# GPU run 29, call 1: A = 5be680f (.base/src) against the working tree with call1_experiment.patch:
# INFER_EXP_EARLY=1 (every PDL kernel lets the next one launch before its own wait, not after it) and
# INFER_EXP_KVPRE=1 (each decode-attention program loads its first key tile's pages, K and V before its wait,
# all but the newest key, which the QK norm + RoPE writes; that row after the wait). Variants: B0 (neither),
# E, K, EK. Qwen3-4B and 0.6B batch 1 alternated; then the attention and fused GPU tests with EK.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { local e=0 k=0; case $2 in *E*) e=1;; esac; case $2 in *K*) k=1;; esac
  PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) INFER_EXP_EARLY=$e INFER_EXP_KVPRE=$k \
  TRITON_CACHE_DIR=/tmp/tc_$2 timeout 80 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B0 E K EK A E K EK; do run qwen3-4b $v; done
for v in A EK A EK; do run qwen3-0.6b $v; done
export PYTHONPATH=$PWD/src
INFER_EXP_EARLY=1 INFER_EXP_KVPRE=1 TRITON_CACHE_DIR=/tmp/tc_EK timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_kernels.py tests/test_fused_kernels.py tests/test_fused_engine.py > $OUT/tests.log 2>&1
echo "EK: GPU tests rc=$?"; tail -3 $OUT/tests.log
