#!/bin/bash
# GPU run 34, call 6: with call 4's static merge on (M), the one-row tiles of gate/up + SiLU and of the LM head
# in the engine (call6_experiment.patch = call 5's; INFER_EXP_TILES "n,k,act,norm=BLOCK_N,BLOCK_K,warps,stages").
# M = defaults (gate/up and LM head (2, 512, 2, 3)); G1 gate/up (2, 512, 2, 4); G2 (4, 512, 4, 3); G3 (2, 1024, 4, 3);
# L1 LM head (4, 512, 4, 3); L2 (2, 1024, 4, 3); L3 (2, 512, 2, 4). Qwen3-4B, alternated twice.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
G=9728,2560,1,1 H=151936,2560,0,0
tiles() { case $1 in G1) echo "$G=2,512,2,4";; G2) echo "$G=4,512,4,3";; G3) echo "$G=2,1024,4,3";;
  L1) echo "$H=4,512,4,3";; L2) echo "$H=2,1024,4,3";; L3) echo "$H=2,512,2,4";; esac; }
run() { INFER_EXP_STATIC_MERGE=1 INFER_EXP_TILES=$(tiles $2) PYTHONPATH=$PWD/src timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 \
  --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json \
  > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for i in 1 2; do for v in M G1 G2 G3 L1 L2 L3; do run qwen3-4b $v; done; done
echo "wall $(( $(date +%s) - T0 )) s"
