#!/bin/bash
# GPU run 26, call 1: two experiments on the one-row projections (env switches, not defaults):
#   INFER_EXP_NORM_FOLD=1  the fused norm without its first pass: the mean square summed beside the products,
#                          rstd multiplying the sums at the end;
#   INFER_EXP_PRELOAD=V    each program's first PRE_K columns of W as one tile loaded before the PDL wait
#                          (at most V weight values per thread).
# GPU tests with the preload; per projection (skinny_gemm.py --fused --pdl); Qwen3-4B batch 1 per variant.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
(for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
INFER_EXP_PRELOAD=64 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py > $OUT/tests.log 2>&1; echo "fused-kernel GPU tests, preload 64: rc=$?"; tail -1 $OUT/tests.log
run_sk() { env $1 timeout 60 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --pdl --fused --out $L/sk.json > $L/sk.log 2>&1 || tail -3 $L/sk.log
  echo "[$1] (us, pdl): $(grep '^| qwen3' $L/sk.md | cut -d'|' -f3,11 | tr '\n' ' ')"; }
for v in X=0 INFER_EXP_NORM_FOLD=1 INFER_EXP_PRELOAD=32 INFER_EXP_PRELOAD=64 INFER_EXP_PRELOAD=128 "INFER_EXP_PRELOAD=64 INFER_EXP_NORM_FOLD=1"; do run_sk "$v"; done
cp $L/sk.md $OUT/sk_last.md
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for v in X=0 INFER_EXP_PRELOAD=64 INFER_EXP_NORM_FOLD=1 "INFER_EXP_PRELOAD=64 INFER_EXP_NORM_FOLD=1" "INFER_EXP_PRELOAD=128 INFER_EXP_NORM_FOLD=1" "INFER_EXP_PRELOAD=32 INFER_EXP_NORM_FOLD=1" X=0; do
  env $v timeout 90 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "qwen3-4b [$v] batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done
