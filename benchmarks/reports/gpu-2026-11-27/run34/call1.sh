#!/bin/bash
# GPU run 34, call 1: run 33's prepared experiment (next_call.sh), call1_experiment.patch applied to the working tree. Since run 33 the one-row norm before
# QKV and gate/up is rms_norm's kernel again: 72 launches a Qwen3-4B step, each on the critical path, whose
# chain after the PDL wait is: the row's load (L2), a cross-warp reduction, the norm weight's load (cold, HBM),
# the store. next_experiments.patch (apply to the working tree; .base = HEAD's src) loads the weight before the
# wait, INFER_EXP_NORM_WARPS overrides the kernel's warps (default 8 at Qwen3-4B's 2,560), and INFER_EXP_PAGE_PRE=1
# has each decode-attention program load its first key tile's block-table entries (host-written) before its wait.
# INFER_EXP_PERSIST overrides the persistent grid's programs per SM (6, run 32, measured on an H100 only; 0 = one
# program per row block: Qwen3-4B's down). Batch 1, every flag + pdl, alternated: A = HEAD, W = the patch,
# W1/W4/W16 = the patch at 1/4/16 warps, WP = W with the attention's pages before the wait, D0/D8 = W with the down
# projection's grid not persistent / at 8 programs per SM.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
warps() { case $1 in W1) echo 1;; W4) echo 4;; W16) echo 16;; *) echo 0;; esac; }
persist() { case $1 in D0) echo 0;; D8) echo 8;; *) echo 6;; esac; }
run() { INFER_EXP_PERSIST=$(persist $2) INFER_EXP_PAGE_PRE=$([ $2 = WP ] && echo 1 || echo 0) INFER_EXP_NORM_WARPS=$(warps $2) PYTHONPATH=$(src $2) timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 \
  --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json \
  > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for i in 1 2; do for v in A W W1 W4 W16 WP D0 D8; do run qwen3-4b $v; done; done
for v in A W W1 W4; do run qwen3-0.6b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
