#!/bin/bash
# GPU run 21, call 5: the whole GPU test suite, batch-1 decode (no regression from the split plan), then
# chunked prefill with every flag on (whole-step mixed graphs, long contexts split) as in call 1.
export INFER_COMMIT=$(cat .commit 2>/dev/null)
R=$OUT/r; mkdir -p $R
OUT=$R SECTION_TIMEOUT=200 bash scripts/gpu_suite.sh tests > $OUT/tests.log 2>&1
grep -E "passed|failed|^FAILED|Error" $OUT/tests.log | head -12
export PYTHONPATH=/tmp/site:$PWD/src
CK=/tmp/infer-ckpt
python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b >/dev/null 2>&1
timeout 120 python3 benchmarks/single_stream.py --model $CK/qwen3-0.6b --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 256 --repeats 3 --hf \
  --infer-configs "batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true" \
  --out $OUT/single.json > $OUT/single.log 2>&1; grep -E "^\|" $OUT/single.md | cut -c1-300 | head -5
rm -rf $R; bash benchmarks/reports/gpu-2026-11-25/run21/call1.sh NOTESTS
