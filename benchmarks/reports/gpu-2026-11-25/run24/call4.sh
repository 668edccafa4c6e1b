#!/bin/bash
# GPU run 24, call 4: (1) the norm computed in one pass (the mean square beside the products, the scale
# applied to the sums: no first pass over the row) against two passes, tiles tuned, Qwen3-4B;
# (2) the decode attention at batch 1 per split plan (attn_batch1.py); (3) batch-1 decode of Qwen3-4B
# with the new default tiles, one pass and two, pdl on; (4) the 256-sequence step, pdl off and on.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
R=benchmarks/reports/gpu-2026-11-25/run24 CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1 & done
for one in 0 1; do
INFER_ONE_PASS_NORM=$one timeout 150 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --projs qkv gate_up --pdl --fused --tune --out $OUT/tune_onepass$one.json > $L/tune.log 2>&1 || tail -5 $L/tune.log
echo "one pass $one:"; grep "^| qwen3-4b | norm" $OUT/tune_onepass$one.md | cut -d'|' -f3,6,7,11,14-17
done
timeout 60 python3 $R/attn_batch1.py 2>&1 | tail -5
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for one in 0 1; do
  INFER_ONE_PASS_NORM=$one timeout 100 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL,pdl=true" --out $L/s$one.json > $L/s$one.log 2>&1 || tail -3 $L/s$one.log
  echo "4b one pass $one: $(grep -E '^\| infer' $L/s$one.md | cut -d'|' -f3-9)"
done
ALL=kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,batching=continuous
timeout 200 python3 benchmarks/step_profile.py --model $CK/qwen3-0.6b --device cuda --dtype bfloat16 --max-num-seqs 256 \
  --max-num-batched-tokens 16384 --steps 40 --unsync-steps 40 --profile-steps 0 --no-progress \
  --infer-configs "$ALL;$ALL,pdl=true;$ALL;$ALL,pdl=true" --out $OUT/step256.json > $L/step256.log 2>&1 || tail -3 $L/step256.log
grep "^| infer" $OUT/step256.md | cut -d'|' -f2,5-10,15-18 | sed 's/kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,batching=continuous/ALL/'
rm -f $OUT/*.png
