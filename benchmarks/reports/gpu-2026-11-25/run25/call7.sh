#!/bin/bash
# GPU run 25, call 7: the whole GPU test suite at a28a1e8 (the session's kernel and engine code), then the
# 256-sequence step's host work (step_profile.py, Qwen3-0.6B, every flag) twice.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1 & done
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests > $OUT/tests.log 2>&1; echo "tests rc=$?"
grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -8
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for i in 1 2; do
timeout 100 python3 benchmarks/step_profile.py --model $CK/qwen3-0.6b --device cuda --dtype bfloat16 --max-num-seqs 256 \
  --max-num-batched-tokens 16384 --steps 60 --unsync-steps 50 --profile-steps 0 --no-progress --infer-configs "$ALL" \
  --out $OUT/step$i.json > $L/step$i.log 2>&1 || tail -3 $L/step$i.log
head -5 $OUT/step$i.md | tail -1 | cut -d'|' -f5-20
done
rm -f $OUT/*.json
