#!/bin/bash
# Run 36 call 8 (two H100s): the GPU tests calls 5 and 7 did not cover, at HEAD: batching, KV offload, the
# two-GPU NCCL cases (tensor / expert parallelism), prefix caching, the sampler, structured output.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
PYTHONPATH=$PWD/src timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_batching.py \
  tests/test_kv_offload.py tests/test_parallel.py tests/test_prefix_caching.py tests/test_sampler.py tests/test_structured.py \
  > $OUT/call8_tests.log 2>&1
tail -8 $OUT/call8_tests.log
echo "wall $(( $(date +%s) - T0 )) s"
