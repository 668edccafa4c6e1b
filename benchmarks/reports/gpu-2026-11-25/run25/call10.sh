#!/bin/bash
# GPU run 25, call 10: the committed one-load norm (16 values per thread at most) against a28a1e8 (base, .base/src):
# the fused projections (skinny_gemm.py --fused --pdl) and batch 1 (every flag + pdl), alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
timeout 100 python3 benchmarks/skinny_gemm.py --models qwen3-4b qwen3-0.6b --rows 1 --pdl --fused --projs qkv gate_up --out $L/sk.json > $L/sk.log 2>&1 || tail -3 $L/sk.log
echo "new (us, pdl): $(grep '^| qwen3' $L/sk.md | cut -d'|' -f2,3,11 | tr '\n' ' ')"
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for src in base new base new; do
  export PYTHONPATH=$PWD/$([ $src = base ] && echo .base/src || echo src)
  timeout 100 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "qwen3-4b $src batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done
