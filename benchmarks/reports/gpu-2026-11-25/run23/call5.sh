#!/bin/bash
# GPU run 23, call 5: the whole GPU test suite at the session's code; batch-1 decode of Qwen3-0.6B
# shapes (every flag), new vs prev (.old/prev: 5757fab), alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SECTION_TIMEOUT=400 bash scripts/gpu_suite.sh env tests 2>&1 | grep -E "passed|failed|error" | tail -5
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
CK=/tmp/infer-ckpt
[ -d $CK/qwen3-0.6b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for v in new prev new prev; do
  s=$PWD/src; [ $v = prev ] && s=$PWD/.old/prev/src
  PYTHONPATH=/tmp/site:$s timeout 100 python3 benchmarks/single_stream.py --model $CK/qwen3-0.6b --device cuda \
    --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
    --out $OUT/single_$v.json > $OUT/single_$v.log 2>&1
  echo "batch 1 $v: $(grep -E '^\| infer' $OUT/single_$v.md | head -1)"
  mv $OUT/single_$v.md $OUT/single_${v}_$RANDOM.md
done
rm -f $OUT/*.json $OUT/*.log
