#!/bin/bash
# GPU run 25, call 1: where the host part of a 256-sequence step goes, at the session's start (4f8f59f + the
# step_profile split of execute's host part into input preparation and launches).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b >/dev/null 2>&1
R=benchmarks/reports/gpu-2026-11-25/run25
timeout 200 python3 $R/host_parts.py $CK/qwen3-0.6b > $OUT/host_parts.md 2>$OUT/host_parts.err && rm $OUT/host_parts.err
cat $OUT/host_parts.md
for i in 1 2; do
timeout 150 python3 benchmarks/step_profile.py --model $CK/qwen3-0.6b --device cuda --dtype bfloat16 --max-num-seqs 256 \
  --max-num-batched-tokens 16384 --steps 60 --unsync-steps 50 --profile-steps 0 --no-progress --infer-configs "$ALL" \
  --host-profile $((i == 2 ? 20 : 0)) --top 25 --out $OUT/step$i.json > $OUT/step$i.log 2>&1 && rm $OUT/step$i.log
head -5 $OUT/step$i.md | tail -1 | cut -d'|' -f5-25
done
rm -f $OUT/*.json
