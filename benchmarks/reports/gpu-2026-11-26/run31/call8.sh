#!/bin/bash
# GPU run 31, call 8: the one-row projections let the next kernel launch only once their weight stream is done
# (call8_experiment.patch, INFER_EXP_LATE=1: griddepcontrol.launch_dependents after the K loop instead of right after
# the wait), so that the next kernel's early programs and their first loads do not compete with the stream. Qwen3-4B
# and Qwen3-0.6B batch 1, every flag + pdl: A = HEAD (.base/src), L = the working tree with INFER_EXP_LATE=1.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) INFER_EXP_LATE=$([ $2 = L ] && echo 1 || echo 0) \
  timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 \
  --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A L A L; do run qwen3-4b $v; done
for v in A L; do run qwen3-0.6b $v; done
