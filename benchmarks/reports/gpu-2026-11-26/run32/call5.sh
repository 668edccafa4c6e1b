#!/bin/bash
# GPU run 32, call 5 (two GPUs): the whole GPU test suite at HEAD (the persistent grid included), the two-GPU
# NCCL cases of tests/test_parallel.py too (last run at e3d6e2d).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
set -o pipefail
timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests 2>&1 | tee $OUT/call5_gpu_suite.log | tail -12
