#!/bin/bash
# GPU run 32, call 1 (asked as nvidia-h200, for the H200 figure): batch 1 at HEAD, every flag + pdl,
# Qwen3-4B twice (the first beside HF static cache + torch.compile and the copy floor) and Qwen3-0.6B once.
# On an H200 only: the skinny GEMM's tiles swept at Qwen3-4B's one-row shapes as the engine launches them
# (PDL; QKV and gate/up with their norm), to see whether the H100-tuned default_config holds there.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
HF="--hf compiled"; case "$GPU" in *H200*) ;; *) HF=--hf;; esac
for p in qwen3-4b qwen3-4b qwen3-0.6b; do
  timeout 200 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 --prompt-lens 128 \
  --output-len 128 --repeats 3 $HF --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$p batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
  grep -E '^\| (hf|floor|copy)' $L/ss.md | head -3; HF=--hf
done
case "$GPU" in *H200*) ;; *) echo "not an H200: no tile sweep"; exit 0;; esac
timeout 150 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --projs o down --pdl --tune \
  --out $OUT/tune4b_o_down.json > $L/t1.log 2>&1 || tail -5 $L/t1.log
timeout 200 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --projs qkv gate_up --pdl --fused --fused-only --tune \
  --out $OUT/tune4b_qkv_gateup.json > $L/t2.log 2>&1 || tail -5 $L/t2.log
for f in $OUT/tune4b_*.md; do grep "^| qwen3-4b" $f | cut -d'|' -f3,4,6,11-17; done
rm -f $OUT/*.png
