#!/bin/bash
# GPU run 25, call 5: the split merge of the decode kernel, all of a KV head's query heads side by side with the
# next split prefetched (new) against 4f8f59f's one head at a time (base, .base/src): the decode-attention GPU
# tests, batch 1 (single_stream.py, every flag + pdl, Qwen3-4B and 0.6B, base/new alternated), and the
# batch-1 step's kernels without PDL.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -1 $OUT/tests.log
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for p in qwen3-4b qwen3-0.6b; do
for src in base new base new; do
  export PYTHONPATH=$PWD/$([ $src = base ] && echo .base/src || echo src)
  timeout 100 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$p $src batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done; done
for src in base new; do
export PYTHONPATH=$PWD/$([ $src = base ] && echo .base/src || echo src)
timeout 100 python3 benchmarks/step_profile.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 --max-num-seqs 1 \
  --num-requests 1 --min-len 128 --max-len 128 --min-output-len 700 --max-output-len 700 --temperature 0 \
  --skip 5 --steps 30 --unsync-steps 200 --profile-steps 10 --top 6 --no-progress \
  --infer-configs "${ALL%,pdl=true}" --out $L/step1.json > $L/step1.log 2>&1 || tail -5 $L/step1.log
echo "$src no-pdl step: $(grep '^| infer' $L/step1.md | head -1 | cut -d'|' -f17-22)"; grep -E "_paged_decode|_qk_norm|_skinny" $L/step1.md | cut -c1-100
done
