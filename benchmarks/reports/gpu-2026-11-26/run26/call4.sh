#!/bin/bash
# GPU run 26, call 4 (two GPUs): the whole GPU test suite at the working tree (d660425's kernel fix + a two-GPU
# parity case with pdl), the NCCL tests included.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
set -o pipefail
timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests 2>&1 | tee $OUT/gpu_suite.log | tail -25
