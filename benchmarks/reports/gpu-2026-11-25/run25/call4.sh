#!/bin/bash
# GPU run 25, call 4: cache hints on the skinny GEMM's weight loads (an experiment: INFER_SKINNY_CACHE /
# INFER_SKINNY_EVICT, read by the uncommitted kernel of this call), per projection and at batch 1 (Qwen3-4B,
# every flag + pdl); the batch-1 step's kernels without PDL (their own durations); HF's row.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
[ -d $CK/qwen3-4b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for hint in ":" ":evict_first" ".cg:" ".cg:evict_first" ":evict_last"; do
  export INFER_SKINNY_CACHE=${hint%%:*} INFER_SKINNY_EVICT=${hint##*:}
  timeout 100 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --pdl --fused --out $L/sk.json > $L/sk.log 2>&1 || tail -3 $L/sk.log
  echo "hint [$hint] proj us (pdl): $(grep '^| qwen3-4b' $L/sk.md | cut -d'|' -f3,11 | tr '\n' ' ')"
  timeout 100 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "hint [$hint] batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done
unset INFER_SKINNY_CACHE INFER_SKINNY_EVICT
timeout 100 python3 benchmarks/step_profile.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 --max-num-seqs 1 \
  --num-requests 1 --min-len 128 --max-len 128 --min-output-len 700 --max-output-len 700 --temperature 0 \
  --skip 5 --steps 30 --unsync-steps 200 --profile-steps 10 --top 14 --no-progress \
  --infer-configs "${ALL%,pdl=true}" --out $OUT/step1_nopdl.json > $L/step1.log 2>&1 || tail -5 $L/step1.log
sed -n '/top device kernels/,+18p' $OUT/step1_nopdl.md | cut -c1-140
timeout 150 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $OUT/single_hf.json > $L/hf.log 2>&1
grep -E '^\|' $OUT/single_hf.md | cut -d'|' -f2-8; grep -i -E "error|hf|transformers" $L/hf.log | tail -5
rm -f $OUT/*.json
