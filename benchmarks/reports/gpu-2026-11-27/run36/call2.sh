#!/bin/bash
# Run 36 call 2: the upper bound of fusing the QK norm + RoPE (+ cache write) into the decode attention.
# call2_experiment.patch: INFER_EXP_SKIP_ROPE=1 skips the qk_norm_rope kernel in decode-only steps (the attention
# reads q un-normed and un-rotated, the cache keeps stale K/V: wrong tokens, the right kernel count and bytes).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { env $( [ $2 = SKIP ] && echo INFER_EXP_SKIP_ROPE=1 ) PYTHONPATH=$PWD/src timeout 90 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log | cut -c1-300
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A SKIP A SKIP A SKIP; do run qwen3-4b $v; done
for v in A SKIP A SKIP; do run qwen3-0.6b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
