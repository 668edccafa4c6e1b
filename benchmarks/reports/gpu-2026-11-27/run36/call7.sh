#!/bin/bash
# Run 36 call 7: HEAD's GPU tests (engine, greedy agreement with HF, attention kernels, paged cache, sampler, MoE).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
PYTHONPATH=$PWD/src timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_fused_engine.py \
  tests/test_greedy_agreement_gpu.py tests/test_kernels.py tests/test_paged.py tests/test_sampler_fast.py tests/test_moe.py \
  > $OUT/call7_tests.log 2>&1
tail -4 $OUT/call7_tests.log
echo "wall $(( $(date +%s) - T0 )) s"
