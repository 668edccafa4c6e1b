#!/bin/bash
# GPU run 24, call 2: the engine's tiles from call 1's tuning (BLOCK_N 2), the skinny GEMM for every
# one-row projection. 1. GPU tests of the fused kernels and the fused engine (PDL bit-identity at
# Qwen3-4B shapes); 2. skinny_gemm.py at the default tiles, both shapes, PDL on/off, fused rows;
# 3. batch-1 decode: landed code (.base) against this tree, pdl off and on.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1 & done
timeout 200 python3 -m pytest -q -x -m gpu tests/test_fused_kernels.py tests/test_fused_engine.py -p no:cacheprovider 2>&1 | tail -4
timeout 120 python3 benchmarks/skinny_gemm.py --models qwen3-4b qwen3-0.6b --rows 1 --pdl --fused --out $OUT/skinny.json > $L/skinny.log 2>&1 || tail -5 $L/skinny.log
grep "^|" $OUT/skinny.md | cut -d'|' -f2-13
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for p in qwen3-4b qwen3-0.6b; do
  PYTHONPATH=$PWD/.base/src timeout 100 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/base_$p.json > $L/base_$p.log 2>&1
  echo "base $p: $(grep -E '^\| infer' $L/base_$p.md | head -1 | cut -d'|' -f3-9)"
  timeout 150 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL;$ALL,pdl=true" --out $OUT/single_$p.json > $L/new_$p.log 2>&1
  echo "new  $p:"; grep -E '^\| infer' $OUT/single_$p.md | cut -d'|' -f2-9 | sed 's/batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true/ALL/'
done
rm -f $OUT/*.png
