#!/bin/bash
# GPU run 24, call 3: a wider tile sweep (BLOCK_N 1-8, BLOCK_K up to the whole row, 2-8 warps; every
# tile's time kept in the report) at Qwen3-4B shapes under PDL, and where batch-1 decode's time goes now
# (step_profile.py's kernel table, Qwen3-4B, every flag, pdl off and on).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
[ -d $CK/qwen3-4b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1 &
timeout 330 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --pdl --fused --tune --out $OUT/tune4b.json > $L/tune.log 2>&1 || tail -5 $L/tune.log
grep "^|" $OUT/tune4b.md | cut -d'|' -f3,6,7,11,14-17
wait
ALL=kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for pdl in false true; do
timeout 100 python3 benchmarks/step_profile.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 --max-num-seqs 1 \
  --num-requests 1 --min-len 128 --max-len 128 --min-output-len 700 --max-output-len 700 --temperature 0 \
  --skip 5 --steps 30 --unsync-steps 200 --profile-steps 10 --top 14 --no-progress \
  --infer-configs "$ALL,pdl=$pdl" --out $OUT/step1_pdl_$pdl.json > $L/step1.log 2>&1 || tail -5 $L/step1.log
grep "^| infer" $OUT/step1_pdl_$pdl.md | head -1 | cut -d'|' -f15-18; sed -n '/top device kernels/,/^$/p;/top device kernels/,+16p' $OUT/step1_pdl_$pdl.md | grep "^| [_a-zA-Z]" | cut -c1-120 | head -14
done
rm -f $OUT/*.png
