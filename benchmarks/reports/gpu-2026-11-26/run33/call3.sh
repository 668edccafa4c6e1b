#!/bin/bash
# GPU run 33, call 3: the norm before a one-row projection as a kernel of its own again (call3_experiment.patch,
# INFER_EXP_UNFUSE: rms_norm's kernel, then the skinny GEMM without NORM; "act" = gate/up only, "qkv" = QKV only,
# "both"). On an H200 the norm fused into gate/up costs ~4 us a call (run 26: 31.4 against 27.0 us plain), more than
# a small kernel's boundary under PDL (~1.1 us, qk_norm_rope's end delta in call 1). Batch 1, every flag + pdl,
# alternated: A = fused (HEAD), act, qkv, both; Qwen3-0.6B A / both.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { INFER_EXP_UNFUSE="$([ $2 = A ] || echo $2)" timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A act qkv both A act qkv both; do run qwen3-4b $v; done
for v in A both; do run qwen3-0.6b $v; done
