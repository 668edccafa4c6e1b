#!/bin/bash
# GPU run 21, call 1: the piecewise mixed-step graphs (a0c9825) on the GPU, then chunked prefill with
# every flag on at Qwen3-4B and Qwen3-0.6B shapes, budgets swept, streams that outlive the long prompts.
export INFER_COMMIT=$(cat .commit 2>/dev/null)
R=$OUT/r; mkdir -p $R; export OUT_FINAL=$OUT; export OUT=$R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src
[ "$1" = NOTESTS ] || timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_engine.py tests/test_chunked_prefill.py 2>&1 \
  | tee $R/tests.log | tail -15
[ -n "$TESTS_ONLY" ] && exit 0
SV="--fused-kernels --cuda-graphs --async-scheduling --cuda-graph-mixed-max-tokens 2048"
WL="--input-len 256 --output-len 1536 --long-prompts 8 --long-len 8000 --long-start-s 1 --long-interval-s 0.5"
for p in qwen3-4b qwen3-0.6b; do
  CHUNK_N=32 CHUNK_PRESETS=$p CHUNK_BUDGETS="${BUDGETS:-256 512 1024 2048}" CHUNK_SERVER_ARGS="$SV" \
    SECTION_TIMEOUT=${ST:-230} CHUNK_WORKLOAD="$WL" bash scripts/gpu_suite.sh bench_chunked > $R/log_$p.txt 2>&1
  grep -E "^\| (config|off|c[0-9])" $R/chunked_$p.md | cut -d'|' -f2,3,4,6,7,8,9,10,11,12
  grep -iE "captured|Traceback|Error" $R/log_$p.txt | head -6
done
cd $R && tar czf $OUT_FINAL/run21_call1.tgz . && ls $OUT_FINAL
