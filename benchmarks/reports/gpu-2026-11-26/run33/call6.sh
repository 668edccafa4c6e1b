#!/bin/bash
# GPU run 33, call 6: the engine's one-row "norm, then project" as two kernels (the norm's, then the skinny GEMM at the
# tile of a projection after a norm, the activation in its epilogue), the working tree P, against HEAD A (.base/src).
# Batch 1, every flag + pdl, alternated: Qwen3-4B A P A P, Qwen3-0.6B A P A P. Then the GPU tests of what it touches.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
run() { PYTHONPATH=$(src $2) timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A P A P; do run qwen3-4b $v; done
for v in A P A P; do run qwen3-0.6b $v; done
PYTHONPATH=$PWD/src timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_fused_kernels.py \
  tests/test_fused_engine.py tests/test_greedy_agreement_gpu.py tests/test_moe.py 2>&1 > $OUT/call6_tests.log; tail -4 $OUT/call6_tests.log
