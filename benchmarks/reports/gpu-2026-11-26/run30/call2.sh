#!/bin/bash
# GPU run 30, call 2 (one GPU, warm from call 1): the whole GPU test suite at the working tree (HEAD: a9b922e's
# one-tile attention slices included; the two-GPU NCCL cases skip on one GPU).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
set -o pipefail
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests 2>&1 | tee $OUT/call2_gpu_suite.log | tail -15
