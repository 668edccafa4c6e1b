#!/bin/bash
# GPU run 23, call 7: after the review (run_packed reads its own packed buffer; the placeholders'
# usual-step shortcut moved into _patch): the GPU tests of the graph runner, async scheduling,
# chunked prefill and structured output.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_engine.py tests/test_async_scheduling.py \
  tests/test_chunked_prefill.py tests/test_structured.py 2>&1 | tail -4
