#!/bin/bash
# GPU run 25, call 9 (its first try failed to compile: the one-load variant reused a loop variable's name): an experiment: the fused norm's first pass (the mean square of x + residual) as one load of
# the whole row instead of one per BLOCK_K slice (INFER_EXP_NORM_ONE_LOAD: the most elements loaded at once;
# 0 = the slices, as at a28a1e8). The fused-kernel and fused-engine GPU tests with it; per projection (skinny_gemm.py --fused --pdl) and at batch 1, alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
INFER_EXP_NORM_ONE_LOAD=8192 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py \
  tests/test_fused_engine.py > $OUT/tests.log 2>&1; echo "fused GPU tests with one load: rc=$?"; tail -1 $OUT/tests.log
for v in 0 8192; do
  export INFER_EXP_NORM_ONE_LOAD=$v
  timeout 100 python3 benchmarks/skinny_gemm.py --models qwen3-4b qwen3-0.6b --rows 1 --pdl --fused --projs qkv gate_up --out $L/sk.json > $L/sk.log 2>&1 || tail -3 $L/sk.log
  echo "one-load $v (us, pdl): $(grep '^| qwen3' $L/sk.md | cut -d'|' -f2,3,11 | tr '\n' ' ')"
done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for p in qwen3-4b qwen3-0.6b; do
for v in 0 8192 0 8192; do
  export INFER_EXP_NORM_ONE_LOAD=$v
  timeout 100 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$p one-load $v batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done; done
