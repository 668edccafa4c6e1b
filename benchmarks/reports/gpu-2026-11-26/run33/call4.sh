#!/bin/bash
# GPU run 33, call 4: call 3 found the norm before gate/up cheaper as a kernel of its own on the H200 (2.78 -> 2.72 ms);
# QKV's was not (2.81). Now the plain products' tiles (call2_experiment.patch's INFER_EXP_TILES, by (n, k, act, norm)):
# gate/up + SiLU without the norm at the default (2, 512, 2, 3), at (2, 512, 2, 0) and at (8, 256, 4, 3) (call 1's sweep
# with the norm), and QKV unfused at its plain default (2, 512, 2, 0), at (8, 256, 8, 0) and at (4, 512, 4, 3).
# Batch 1, every flag + pdl; Qwen3-0.6B A / act.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
# variant = UNFUSE:TILES
run() { INFER_EXP_UNFUSE="${2%%:*}" INFER_EXP_TILES="${2#*:}" timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 \
  --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json \
  > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 [$2] batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
V="act: act:9728,2560,1,0=2,512,2,0 act:9728,2560,1,0=8,256,4,3 both:6144,2560,0,0=8,256,8,0 both:6144,2560,0,0=4,512,4,3"
for i in 1 2; do for v in $V; do run qwen3-4b $v; done; done
for v in : act: : act:; do run qwen3-0.6b $v; done
