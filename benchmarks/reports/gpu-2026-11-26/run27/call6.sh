#!/bin/bash
# GPU run 27, call 6: the whole one-GPU test suite at 25f9cd6 (the session's code: the epilogue add, its GPU test at
# real shapes included).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > $OUT/gpu_suite.log 2>&1; echo "GPU suite rc=$?"
tail -8 $OUT/gpu_suite.log
