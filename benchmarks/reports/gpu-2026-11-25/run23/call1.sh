#!/bin/bash
# GPU run 23, call 1: decode steps staged straight from the sequences (stage_decodes), the stateless
# sampling-tensor build, forks of a one-token prefill under graphs. GPU tests of the graph runner;
# the fork test on the previous source (.old/prev, 5757fab: it should fail there); the changed host
# pieces (host_parts.py); the 256-sequence step, new vs prev, alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_engine.py tests/test_async_scheduling.py \
  tests/test_chunked_prefill.py 2>&1 | tail -4
echo "--- the fork test on the previous source (expected to fail):"
PYTHONPATH=/tmp/site:$PWD/.old/prev/src timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_fused_engine.py -k forks_of_a_one_token 2>&1 | tail -3
CK=/tmp/infer-ckpt
[ -d $CK/qwen3-0.6b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b >/dev/null 2>&1
timeout 120 python3 benchmarks/reports/gpu-2026-11-25/run23/host_parts.py $CK/qwen3-0.6b 2>&1 | tail -8
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for v in new prev new prev new prev; do
  s=$PWD/src; [ $v = prev ] && s=$PWD/.old/prev/src
  PYTHONPATH=/tmp/site:$s timeout 100 python3 benchmarks/step_profile.py --model $CK/qwen3-0.6b --device cuda \
    --dtype bfloat16 --max-num-seqs 256 --max-num-batched-tokens 16384 --steps 60 --unsync-steps 50 --profile-steps 0 \
    --host-profile 0 --no-progress --infer-configs "$ALL" --out $OUT/step_$v.json > /dev/null 2>&1
  echo "$v: $(grep -E '^\| infer' $OUT/step_$v.md | cut -d'|' -f5-10,14-17)"
  mv $OUT/step_$v.md $OUT/step_${v}_$RANDOM.md
done
rm -f $OUT/*.json
