#!/bin/bash
# GPU run 22, call 1: the whole GPU test suite (run 21's stopped inside test_moe.py at its 200-s limit),
# then where Qwen3-4B's batch-1 decode step goes (every flag; top kernels), after the skinny-GEMM routing
# of the merged qkv / gate_up projections at M=1 (603189a), never measured on a GPU.
export INFER_COMMIT=$(cat .commit 2>/dev/null)
FINAL=$OUT; R=$OUT/r; mkdir -p $R
OUT=$R SECTION_TIMEOUT=430 bash scripts/gpu_suite.sh env tests > $FINAL/tests.log 2>&1
grep -E "passed|failed|^FAILED|^ERROR|stopped after" $FINAL/tests.log | head -30
export PYTHONPATH=/tmp/site:$PWD/src
CK=/tmp/infer-ckpt
python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b >/dev/null 2>&1
timeout 100 python3 benchmarks/step_profile.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 --max-num-seqs 1 \
  --num-requests 1 --min-len 128 --max-len 128 --min-output-len 700 --max-output-len 700 --temperature 0 \
  --skip 5 --steps 50 --unsync-steps 300 --profile-steps 20 --host-profile 0 --top 25 --no-progress \
  --infer-configs "kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true" \
  --out $FINAL/step1_qwen3-4b.json > $FINAL/step1.log 2>&1
tail -5 $FINAL/step1.log; head -60 $FINAL/step1_qwen3-4b.md
rm -rf $R
