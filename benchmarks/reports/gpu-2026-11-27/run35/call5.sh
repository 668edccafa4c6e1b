#!/bin/bash
# GPU run 35, call 5: call 4's sums of squares spread over 32 float32s on 32 cache lines (program j adds into
# line j % 32; the projection after the norm loads the 32 and adds them), not one contended float32
# (call5_experiment.patch). INFER_EXP_SQ 1 both norms, 2 only before gate/up, 3 only before QKV, 4 the atomics alone;
# W = S1 with 128 slots 32 bytes apart (INFER_EXP_SQ_SLOTS / _STRIDE); A = unset. Alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { case $2 in A) sq=;; W) sq=1;; *) sq=${2#S};; esac
  INFER_EXP_SQ=$sq INFER_EXP_SQ_SLOTS=$([ $2 = W ] && echo 128) INFER_EXP_SQ_STRIDE=$([ $2 = W ] && echo 8) \
  PYTHONPATH=$PWD/src timeout 60 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A S4 S1 S2 S3 W A S4 S1 W; do run qwen3-4b $v; done
for v in A S1 A S1; do run qwen3-0.6b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
