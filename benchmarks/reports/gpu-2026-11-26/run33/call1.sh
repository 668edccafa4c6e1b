#!/bin/bash
# GPU run 33, call 1 (asked as nvidia-h200, for the H200 figure): batch 1 at HEAD, every flag + pdl,
# Qwen3-4B twice (the first beside HF static cache + torch.compile and the copy floor) and Qwen3-0.6B once.
# Exits at once on anything but an H200 (run 32 measured this code on H100s). On an H200, also: the skinny GEMM's tiles swept at Qwen3-4B's one-row shapes as the engine launches them
# (PDL; QKV and gate/up with their norm), to see whether the H100-tuned default_config holds there, and run 27's
# per-kernel end deltas (trace_deltas.py) at this code.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
case "$GPU" in *H200*) ;; *) echo "not an H200: nothing to measure here (run 32 measured HEAD on H100s)"; exit 0;; esac
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
timeout 120 python3 benchmarks/reports/gpu-2026-11-26/run27/trace_deltas.py --model $CK/qwen3-4b --device cuda \
  --dtype bfloat16 --max-num-seqs 1 --num-requests 1 --min-len 128 --max-len 128 --min-output-len 400 \
  --max-output-len 400 --temperature 0 --skip 5 --steps 10 --unsync-steps 10 --profile-steps 10 --top 14 --no-progress \
  --infer-configs "$ALL" --out $L/step1.json > $OUT/call1_trace_deltas.log 2>&1; echo trace rc=$?
grep -A 30 "end deltas" $OUT/call1_trace_deltas.log | head -32
timeout 150 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --projs o down --pdl --tune \
  --out $OUT/tune4b_o_down.json > $L/t1.log 2>&1 || tail -5 $L/t1.log
timeout 200 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --projs qkv gate_up --pdl --fused --fused-only --tune \
  --out $OUT/tune4b_qkv_gateup.json > $L/t2.log 2>&1 || tail -5 $L/t2.log
for f in $OUT/tune4b_*.md; do grep "^| qwen3-4b" $f | cut -d'|' -f3,4,6,11-17; done
rm -f $OUT/*.png
