#!/bin/bash
# GPU run 30, call 3: A = HEAD (.base/src, e3d6e2d + run 30 notes) against the working tree (call3_experiment.patch): the decode
# attention loads each tile's V right after its K (both in flight at once) instead of after the softmax. Batch 1,
# A / B / A / B: Qwen3-4B 128- and 1,024-token prompts, Qwen3-0.6B 128; then the attention kernel GPU tests on B.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) timeout 90 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens $3 --output-len 128 --repeats 3 --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 prompt $3 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B A B; do run qwen3-4b $v 128; done
for v in A B A B; do run qwen3-4b $v 1024; done
for v in A B A B; do run qwen3-0.6b $v 128; done
export PYTHONPATH=$PWD/src
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py > $OUT/call3_tests.log 2>&1
echo "B: kernel GPU tests rc=$?"; tail -2 $OUT/call3_tests.log
