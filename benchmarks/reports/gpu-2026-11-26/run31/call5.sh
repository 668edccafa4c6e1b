#!/bin/bash
# GPU run 31, call 5 (one GPU, warm from call 4): the whole GPU test suite at HEAD (the NaN fixes and the merged
# NaN test of run 30 included; the two-GPU NCCL cases skip on one GPU).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
set -o pipefail
timeout 480 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests 2>&1 | tee $OUT/call5_gpu_suite.log | tail -15
