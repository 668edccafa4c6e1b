#!/bin/bash
# GPU run 32, call 4: the persistent grid in the engine's skinny GEMM (skinny_gemm.persistent_programs: one-row
# products of the 8-warp register loop with more row blocks than 6 an SM; at Qwen3-4B that is down alone).
# A = HEAD (.base/src), P = the working tree. Batch 1, every flag + pdl: Qwen3-4B A P A P A P, Qwen3-0.6B A P
# (no product of it qualifies); the down projection alone at Qwen3-4B and 8B shapes (skinny_gemm.py, PDL); the
# skinny-GEMM and fused-engine GPU tests on the working tree.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
run() { PYTHONPATH=$(src $2) timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A P A P A P; do run qwen3-4b $v; done
for v in A P; do run qwen3-0.6b $v; done
for v in A P; do
  PYTHONPATH=$(src $v) timeout 60 python3 benchmarks/skinny_gemm.py --models qwen3-4b qwen3-8b --rows 1 --projs down --pdl \
    --out $L/down.json > $L/down.log 2>&1 || tail -3 $L/down.log
  echo "$v down alone:"; grep "^| qwen3" $L/down.md | cut -d'|' -f2-4,6,11-13
done
PYTHONPATH=$PWD/src timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_fused_kernels.py \
  tests/test_fused_engine.py 2>&1 | tail -6
