#!/bin/bash
# GPU run 29, call 5: the decode attention's split count at batch 1 (call5_experiment.patch: INFER_EXP_SPLITS = the
# grid's key slices per sequence, 0 = decode_num_splits's, which is 2 here: single_stream.py's max_model_len is 264).
# A context of 129-256 keys in slices of at least one 64-key tile: S1 = one program per KV head walks them all (no
# merge), S2 = today's (two programs, the last one merges), S4 = up to four one-tile slices. Qwen3-4B and 0.6B batch 1.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { INFER_EXP_SPLITS=${2#S} timeout 80 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in S0 S1 S4 S0 S1 S4; do run qwen3-4b $v; done
for v in S0 S1 S4 S0 S1 S4; do run qwen3-0.6b $v; done
