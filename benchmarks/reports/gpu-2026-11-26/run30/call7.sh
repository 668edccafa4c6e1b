#!/bin/bash
# GPU run 30, call 7: the shared NaN-aware argmax (first_argmax, moved to fused_triton) in the sampler and in MoE routing:
# the GPU tests of the sampler, MoE (the new NaN routing case), the fused kernels and batching (the engine NaN case).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sampler_fast.py tests/test_sampler.py \
  tests/test_moe.py tests/test_batching.py tests/test_fused_kernels.py 2>&1 | tail -4
