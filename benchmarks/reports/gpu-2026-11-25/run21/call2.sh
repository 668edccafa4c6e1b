#!/bin/bash
# GPU run 21, call 2: where a mixed step's time goes (32 decoding streams + a chunk of an 8,000-token
# prompt every step), eager vs piecewise graphs, Qwen3-4B and Qwen3-0.6B shapes.
export INFER_COMMIT=$(cat .commit 2>/dev/null)
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt
ALL="batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,chunked_prefill=true"
for p in ${PRESETS:-qwen3-4b qwen3-0.6b}; do
  python3 scripts/make_synthetic_checkpoint.py $p $CK/$p >/dev/null 2>&1
  timeout 280 python3 benchmarks/step_profile.py --model $CK/$p --device cuda --dtype bfloat16 --max-num-seqs 64 \
    --max-num-batched-tokens ${BUDGET:-512} --long-len 8000 --streams 32 --skip 30 --steps 30 --unsync-steps 30 \
    --profile-steps 3 --host-profile 10 --top 25 --no-progress \
    --infer-configs "$ALL;$ALL,cuda_graph_mixed_max_tokens=2048" --out $OUT/mixed_$p.json > $OUT/mixed_$p.log 2>&1
  grep -E "^\| (label|infer)" $OUT/mixed_$p.md | cut -c1-600 | sed 's/batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,//'
  tail -3 $OUT/mixed_$p.log
done
