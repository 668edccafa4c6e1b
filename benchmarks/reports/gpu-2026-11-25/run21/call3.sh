#!/bin/bash
# GPU run 21, call 3: whole-step graphs for decodes + one prompt chunk: GPU tests, the mixed-step profile
# again (as call 2), and the prefill kernel's tile sweep with the chunked-prefill extend shape.
export INFER_COMMIT=$(cat .commit 2>/dev/null)
export PYTHONPATH=$PWD/src
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_engine.py tests/test_chunked_prefill.py 2>&1 \
  | tee $OUT/tests.log | tail -15
[ -n "$TESTS_ONLY" ] && exit 0
PRESETS="${PRESETS:-qwen3-4b qwen3-0.6b}" bash benchmarks/reports/gpu-2026-11-25/run21/call2.sh
timeout 200 python3 benchmarks/paged_attention.py --batches 1 --contexts 1024 --prefill 1 256 --tune prefill \
  --out $OUT/tune > $OUT/tune.log 2>&1
grep "'kernel': 'prefill'" $OUT/tune.log | python3 -c "
import ast, sys
rows = [ast.literal_eval(l.strip()) for l in sys.stdin]
for prefix in (0, 4096):
    rs = sorted((r for r in rows if r.get('prefix') == prefix and 'triton_ms' in r), key=lambda r: r['triton_ms'])
    for r in rs[:6]: print(prefix, r['BLOCK_M'], r['BLOCK_N'], r['warps'], r['stages'], round(r['triton_ms'], 3), round(r['triton_tflops'], 1))
    cur = [r for r in rs if (r['BLOCK_M'], r['BLOCK_N'], r['warps'], r['stages']) == (64, 64, 4, 3)]
    print('current', prefix, cur and round(cur[0]['triton_ms'], 3))
"
