#!/bin/bash
# Run 36 call 11: HEAD (the norm before gate/up launching gate/up early): the fused kernels', the fused engine's and
# the greedy-agreement GPU tests (the device time left allowed no more).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
PYTHONPATH=$PWD/src timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py \
  tests/test_fused_engine.py tests/test_greedy_agreement_gpu.py > $OUT/call11_tests.log 2>&1
tail -2 $OUT/call11_tests.log
echo "wall $(( $(date +%s) - T0 )) s"
