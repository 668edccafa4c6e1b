#!/bin/bash
# GPU run 23, call 2: call 1's changes plus the decode graphs' in-graph input spread. GPU tests of
# the graph runner; the fork test on the previous source (INFER_SRC=.old/prev/src, 5757fab: should
# fail there); the offline workload (256 x 512 output tokens, every flag) new vs prev,
# alternated; the 256-sequence step new vs prev (first pair profiled: device busy time).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_engine.py tests/test_async_scheduling.py \
  tests/test_chunked_prefill.py 2>&1 | tail -4
echo "--- the fork test on the previous source (expected to fail):"
INFER_SRC=$PWD/.old/prev/src PYTHONPATH=/tmp/site:$PWD/.old/prev/src timeout 100 python3 -m pytest -q -p no:cacheprovider \
  -m gpu tests/test_fused_engine.py -k forks_of_a_one_token 2>&1 | tail -3
CK=/tmp/infer-ckpt
[ -d $CK/qwen3-0.6b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for v in new prev new prev; do
  s=$PWD/src; [ $v = prev ] && s=$PWD/.old/prev/src
  PYTHONPATH=/tmp/site:$s timeout 120 python3 benchmarks/offline_throughput.py --model $CK/qwen3-0.6b --device cuda \
    --dtype bfloat16 --max-num-seqs 256 --max-num-batched-tokens 16384 --min-output-len 512 --max-output-len 512 \
    --engines infer --infer-configs "$ALL" --no-progress --no-ceilings --out $OUT/offline_$v.json > $OUT/offline_$v.log 2>&1
  [ -f $OUT/offline_$v.md ] || tail -5 $OUT/offline_$v.log
  echo "offline $v: $(grep -E '^\| infer' $OUT/offline_$v.md | head -1)"
  mv $OUT/offline_$v.md $OUT/offline_${v}_$RANDOM.md
done
for v in new prev new prev; do
  s=$PWD/src; [ $v = prev ] && s=$PWD/.old/prev/src
  prof=0; [ -f $OUT/profiled_$v ] || { prof=3; touch $OUT/profiled_$v; }
  PYTHONPATH=/tmp/site:$s timeout 120 python3 benchmarks/step_profile.py --model $CK/qwen3-0.6b --device cuda \
    --dtype bfloat16 --max-num-seqs 256 --max-num-batched-tokens 16384 --steps 60 --unsync-steps 50 --profile-steps $prof \
    --host-profile 0 --no-progress --infer-configs "$ALL" --out $OUT/step_$v.json > /dev/null 2>&1
  echo "step $v (profiled $prof): $(grep -E '^\| infer' $OUT/step_$v.md | cut -d'|' -f5-17)"
  mv $OUT/step_$v.md $OUT/step_${v}_$RANDOM.md
done
rm -f $OUT/*.json $OUT/profiled_* $OUT/*.log
