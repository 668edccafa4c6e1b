#!/bin/bash
# GPU run 26, call 7: the decode attention at batch 1 is latency-bound (a page lookup, then K and V from HBM).
# B: the sequence's length, the split plan and the early exit of unused programs move before the PDL wait (only the
# host writes seq_lens and the block table). C: B + each program asks L2 for its slice's K and V rows before the wait
# (PTX prefetch.global.L2, while qk_norm_rope runs; INFER_EXP_KV_PREFETCH=1, call7_experiment.patch).
# A = HEAD (.base/src). Attention GPU tests on B and C; Qwen3-4B batch 1 alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
(for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
export PYTHONPATH=$PWD/src
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_fused_engine.py > $OUT/tests_B.log 2>&1; echo "B: kernel + fused-engine GPU tests rc=$?"; tail -1 $OUT/tests_B.log
INFER_EXP_KV_PREFETCH=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_fused_engine.py > $OUT/tests_C.log 2>&1; echo "C: rc=$?"; tail -1 $OUT/tests_C.log
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) INFER_EXP_KV_PREFETCH=$([ $2 = C ] && echo 1 || echo 0) \
  timeout 90 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens $3 --output-len 128 \
  --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 prompt $3 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B C A B C; do run qwen3-4b $v 128; done
for v in A C; do run qwen3-4b $v 1024; done
for v in A C; do run qwen3-0.6b $v 128; done
