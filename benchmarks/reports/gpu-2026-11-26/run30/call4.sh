#!/bin/bash
# GPU run 30, call 4 (two GPUs): the two-GPU NCCL cases at the working tree (HEAD), which one-GPU call 2 skipped:
# tensor and expert parallelism over NCCL through the Triton attention (one-tile slices, a9b922e) and experts.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
set -o pipefail
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_parallel.py 2>&1 | tee $OUT/call4_parallel.log | tail -6
