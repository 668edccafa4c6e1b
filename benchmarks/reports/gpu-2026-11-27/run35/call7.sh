#!/bin/bash
# GPU run 35, call 7 (H200): the decode attention's launch at batch 1 (call7_experiment.patch, INFER_EXP_ATT
# "BLOCK_N,MIN_SPLIT_KEYS,warps,stages"; HEAD: 64,64,4,3). Its slices are one key tile at 129-264 keys, so Triton's
# pipeliner (stages 3) only routes the one tile through shared memory: S1 = stages 1; W8 = 8 warps, stages 1;
# W2 = 2 warps, stages 1; T32 = 32-key tiles and slices (twice the programs), stages 1. Plus QKV at (1, 256, 1)
# (Q1, INFER_EXP_TILES). A = HEAD's defaults; alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
att() { case $1 in S1) echo 64,64,4,1;; W8) echo 64,64,8,1;; W2) echo 64,64,2,1;; T32) echo 32,32,4,1;; esac; }
run() { INFER_EXP_ATT=$(att $2) INFER_EXP_TILES=$([ $2 = Q1 ] && echo "6144,2560,0,1=1,256,1,0") PYTHONPATH=$PWD/src \
  timeout 60 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A S1 W8 W2 T32 Q1 A S1 W8; do run qwen3-4b $v; done
for v in A S1 A S1; do run qwen3-0.6b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
