#!/bin/bash
# GPU run 26, call 2: is the review commit c3755e3 (the norm's first pass as one loop of NORM_BLOCK slices) slower
# than e8d129e (a straight-line one-load branch), as call 1's base suggests (norm + QKV 16.1 us against 11.5 in
# run 25)? A = e8d129e (.base/src), B = c3755e3 (.head/src), C = the working tree (one load again, straight-line,
# the pass's body in a helper shared with the sliced loop). Per projection and Qwen3-4B batch 1, alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
(for p in qwen3-4b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py tests/test_fused_engine.py > $OUT/tests.log 2>&1; echo "C: fused GPU tests rc=$?"; tail -1 $OUT/tests.log
src() { case $1 in A) echo $PWD/.base/src;; B) echo $PWD/.head/src;; C) echo $PWD/src;; esac; }
for v in A B C; do
  PYTHONPATH=$(src $v) timeout 60 python3 benchmarks/skinny_gemm.py --models qwen3-4b qwen3-0.6b --rows 1 --pdl --fused --projs qkv gate_up --out $L/sk.json > $L/sk.log 2>&1 || tail -3 $L/sk.log
  echo "$v (us, pdl): $(grep '^| qwen3' $L/sk.md | cut -d'|' -f2,3,11 | tr '\n' ' ')"
done
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for v in A B C A B C; do
  PYTHONPATH=$(src $v) timeout 90 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "qwen3-4b $v batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done
