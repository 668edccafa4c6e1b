#!/bin/bash
# GPU run 24, call 1: PDL and the fused norm/projection/activation kernel, first look.
# 1. the fused-kernel GPU tests; 2. the skinny GEMM and its fused variant against cuBLAS (+ the unfused
# norm/activation kernels) at Qwen3-4B/0.6B shapes, with and without PDL, tiles tuned at 4B;
# 3. batch-1 decode (single_stream.py) of both shapes: the landed code (a77b02a, carried in .base/src)
# against this tree with pdl off and on, every other phase 8-9 flag on.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt
for p in qwen3-4b qwen3-0.6b; do python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1 & done
timeout 240 python3 -m pytest -q -x -m gpu tests/test_fused_kernels.py -p no:cacheprovider 2>&1 | tail -4
timeout 200 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --pdl --fused --tune --out $OUT/skinny4b.json > $OUT/skinny4b.log 2>&1
timeout 60 python3 benchmarks/skinny_gemm.py --models qwen3-0.6b --rows 1 --pdl --fused --out $OUT/skinny06.json > $OUT/skinny06.log 2>&1
cat $OUT/skinny4b.md $OUT/skinny06.md 2>/dev/null | grep -v "^$" | cut -c1-250
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for p in qwen3-4b qwen3-0.6b; do
  PYTHONPATH=$PWD/.base/src timeout 100 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $OUT/base_$p.json > $OUT/base_$p.log 2>&1
  echo "base $p: $(grep -E '^\| infer' $OUT/base_$p.md | head -1)"
  timeout 150 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL;$ALL,pdl=true" --out $OUT/new_$p.json > $OUT/new_$p.log 2>&1
  echo "new  $p:"; grep -E '^\| infer' $OUT/new_$p.md
  tail -3 $OUT/new_$p.log
done
