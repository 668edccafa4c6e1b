#!/bin/bash
# GPU run 23, call 6 (asked for nvidia-h200; an H100 came): the figures at the session's code, every flag:
# batch-1 decode of Qwen3-0.6B and Qwen3-4B shapes (128-token prompt, 128 outputs), the offline
# workload with 512 output tokens, and the 256-sequence step.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for p in qwen3-0.6b qwen3-4b; do
  [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p >/dev/null 2>&1
  timeout 150 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 --prompt-lens 128 \
    --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $OUT/single_$p.json > $OUT/single_$p.log 2>&1
  echo "batch 1 $p: $(grep -E '^\| infer' $OUT/single_$p.md | head -1)"
done
timeout 150 python3 benchmarks/offline_throughput.py --model $CK/qwen3-0.6b --device cuda --dtype bfloat16 \
  --max-num-seqs 256 --max-num-batched-tokens 16384 --min-output-len 512 --max-output-len 512 --engines infer \
  --infer-configs "$ALL" --no-progress --no-ceilings --out $OUT/offline.json > $OUT/offline.log 2>&1
echo "offline: $(grep -E '^\| infer' $OUT/offline.md | head -1)"
timeout 150 python3 benchmarks/step_profile.py --model $CK/qwen3-0.6b --device cuda --dtype bfloat16 --max-num-seqs 256 \
  --max-num-batched-tokens 16384 --steps 60 --unsync-steps 50 --profile-steps 0 --no-progress --infer-configs "$ALL" \
  --out $OUT/step.json > /dev/null 2>&1
echo "step: $(grep -E '^\| infer' $OUT/step.md | head -1 | cut -d'|' -f5-17)"
rm -f $OUT/*.json
for f in $OUT/*.log; do [ -f ${f%.log}.md ] && rm $f; done
