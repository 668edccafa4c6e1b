#!/bin/bash
# GPU run 30, call 1: how much of a batch-1 step the norms fused into the projections cost. A = the working tree
# (every flag + pdl); N = the same with INFER_EXP_NONORM=1 (call1_experiment.patch): the skinny GEMMs skip their norm
# (the values are wrong; the bytes and the kernel boundaries are the same): an upper bound on what computing the
# norm elsewhere could save. Qwen3-4B A / N / A / N, Qwen3-0.6B A / N.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { INFER_EXP_NONORM=$([ $2 = N ] && echo 1 || echo 0) timeout 90 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A N A N; do run qwen3-4b $v; done
for v in A N; do run qwen3-0.6b $v; done
grep -E '^\| (hf|floor|copy)' $L/ss.md | head -3
