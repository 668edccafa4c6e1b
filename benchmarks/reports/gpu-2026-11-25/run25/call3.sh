#!/bin/bash
# GPU run 25, call 3 (H200): the one-row projection tiles at Qwen3-4B shapes tuned on this GPU (under PDL,
# norm and activation fused), and the batch-1 step's kernels (step_profile.py, every flag + pdl).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
[ -d $CK/qwen3-4b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1 &
timeout 330 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --pdl --fused --tune --out $OUT/tune4b.json > $L/tune.log 2>&1 || tail -5 $L/tune.log
grep "^|" $OUT/tune4b.md | cut -d'|' -f3,6,7,11,14-17 | head -30
wait
ALL=kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
timeout 100 python3 benchmarks/step_profile.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 --max-num-seqs 1 \
  --num-requests 1 --min-len 128 --max-len 128 --min-output-len 700 --max-output-len 700 --temperature 0 \
  --skip 5 --steps 30 --unsync-steps 200 --profile-steps 10 --top 14 --no-progress \
  --infer-configs "$ALL,pdl=true" --out $OUT/step1.json > $L/step1.log 2>&1 || tail -5 $L/step1.log
sed -n '/top device kernels/,+18p' $OUT/step1.md | cut -c1-140
rm -f $OUT/*.png
