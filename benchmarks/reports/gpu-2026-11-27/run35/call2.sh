#!/bin/bash
# GPU run 35, call 2: where a batch-1 step goes now (trace_deltas.py: end deltas per kernel, by place in the layer),
# Qwen3-4B, every flag + pdl; then the GPU tests at 5f57cc9 (the working tree's experiment hooks off).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
R=benchmarks/reports/gpu-2026-11-27/run35
export PYTHONPATH=$PWD/src
for p in qwen3-4b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
timeout 150 python3 $R/trace_deltas.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 --max-num-seqs 1 \
  --num-requests 1 --min-len 128 --max-len 128 --min-output-len 400 --max-output-len 400 --temperature 0 \
  --skip 5 --steps 10 --unsync-steps 10 --profile-steps 10 --top 14 --no-progress \
  --infer-configs "$ALL" --out $L/step1.json > $OUT/call2_trace.log 2>&1; echo rc=$?
grep -A 32 "end deltas" $OUT/call2_trace.log | head -34
echo "+$(( $(date +%s) - T0 )) s"
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_sampler_fast.py tests/test_fused_kernels.py tests/test_kernels.py \
  tests/test_paged.py tests/test_fused_engine.py tests/test_greedy_agreement_gpu.py tests/test_moe.py > $OUT/call2_tests.log 2>&1
tail -3 $OUT/call2_tests.log
echo "wall $(( $(date +%s) - T0 )) s"
