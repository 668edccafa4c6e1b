#!/bin/bash
# GPU run 34, call 7: the landed change (the decode attention's unrolled merge for grids of <= 8 splits; x's next
# slice loaded ahead in the skinny GEMM's register loop for tiles of <= 2 warps), P = working tree, against
# A = HEAD (.base/src). Batch 1, every flag + pdl, alternated twice on Qwen3-4B and Qwen3-0.6B; then the GPU
# tests of what it touches and of what run 33 left unrun.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
run() { PYTHONPATH=$(src $2) timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A P A P; do run qwen3-4b $v; done
for v in A P A P; do run qwen3-0.6b $v; done
PYTHONPATH=$PWD/src timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_fused_kernels.py tests/test_kernels.py \
  tests/test_paged.py tests/test_fused_engine.py tests/test_greedy_agreement_gpu.py tests/test_moe.py > $OUT/call7_tests.log 2>&1
tail -3 $OUT/call7_tests.log
echo "wall $(( $(date +%s) - T0 )) s"
