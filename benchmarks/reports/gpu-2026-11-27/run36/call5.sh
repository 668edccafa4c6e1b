#!/bin/bash
# Run 36 call 5: the norm kernels load their weight before the PDL wait (B = the working tree) against HEAD bb577b2
# (A = .base/src), batch 1, every phase 8-9 flag + pdl, alternated; then the fused kernels' GPU tests at B.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$PWD/$( [ $2 = A ] && echo .base/src || echo src ) timeout 90 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log | cut -c1-300
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B A B A B; do run qwen3-4b $v; done
for v in A B A B; do run qwen3-0.6b $v; done
PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py > $OUT/call5_tests.log 2>&1
tail -1 $OUT/call5_tests.log
echo "wall $(( $(date +%s) - T0 )) s"
