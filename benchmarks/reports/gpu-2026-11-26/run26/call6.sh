#!/bin/bash
# GPU run 26, call 6: before the PDL wait, each program of a one-row projection asks L2 for its whole share of W
# (PTX prefetch.global.L2, one per 128-byte line: no registers held, unlike call 1's preload), so that the weight
# stream of a projection starts under the kernel before it (INFER_EXP_PREFETCH = "all"
# or one K, e.g. 4096 = Qwen3-4B's o alone, after the attention). call6_experiment.patch, not committed.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
(for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
INFER_EXP_PREFETCH=all timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py > $OUT/tests.log 2>&1; echo "fused-kernel GPU tests, prefetch all: rc=$?"; tail -1 $OUT/tests.log
for v in X all; do
  INFER_EXP_PREFETCH=$([ $v = X ] || echo $v) timeout 60 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --pdl --fused --out $L/sk.json > $L/sk.log 2>&1 || tail -3 $L/sk.log
  echo "prefetch [$v] (us, pdl): $(grep '^| qwen3' $L/sk.md | cut -d'|' -f3,11 | tr '\n' ' ')"
done
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for v in X all 4096 X all 4096; do
  INFER_EXP_PREFETCH=$([ $v = X ] || echo $v) timeout 90 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "qwen3-4b prefetch [$v] batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done
for v in X all; do
  INFER_EXP_PREFETCH=$([ $v = X ] || echo $v) timeout 60 python3 benchmarks/single_stream.py --model $CK/qwen3-0.6b --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "qwen3-0.6b prefetch [$v] batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done
