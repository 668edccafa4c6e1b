#!/bin/bash
# GPU run 33, call 2: call 1's H200 tile sweep (skinny_gemm.py --tune --pdl at Qwen3-4B's one-row shapes) put other tiles
# first than default_config's (tuned on H100s): norm + gate/up + SiLU (8, 256, 4, 3) 30.9 us against the default
# (2, 512, 2, 3) 33.5; norm + QKV (8, 512, 2, 3) 11.3 / 11.6; down (4, 512, 2, 3) 14.2 / 14.9. In the engine, batch 1,
# every flag + pdl, alternated: A = default tiles, G = gate/up's H200 tile, T = all three (call2_experiment.patch:
# INFER_EXP_TILES overrides default_config by (n, k, act, norm)); Qwen3-0.6B A once (no shape of it is overridden).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
GU="9728,2560,1,1=8,256,4,3"; QKV="6144,2560,0,1=8,512,2,3"; DOWN="2560,9728,0,0=4,512,2,3"
tiles() { case $1 in A) echo "";; G) echo "$GU";; T) echo "$GU;$QKV;$DOWN";; esac; }
run() { INFER_EXP_TILES="$(tiles $2)" timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 \
  --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A G T A G T A G T; do run qwen3-4b $v; done
