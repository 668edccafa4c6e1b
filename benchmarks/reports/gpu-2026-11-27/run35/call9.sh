#!/bin/bash
# GPU run 35, call 9: HEAD (0f69f66) on the engine's GPU tests the refactor touches (the fused engine, the
# greedy-agreement gate), and its batch-1 decode twice.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_fused_engine.py tests/test_greedy_agreement_gpu.py \
  tests/test_sampler_fast.py > $OUT/call9_tests.log 2>&1
tail -2 $OUT/call9_tests.log; echo "+$(( $(date +%s) - T0 )) s"
[ -d $CK/qwen3-4b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for i in 1 2; do timeout 60 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "qwen3-4b HEAD batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; done
echo "wall $(( $(date +%s) - T0 )) s"
