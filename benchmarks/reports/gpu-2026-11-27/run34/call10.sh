#!/bin/bash
# GPU run 34, call 10: since x ahead made the 2-warp register loop much faster (Qwen3-0.6B), Qwen3-4B's
# projections at small register-loop tiles, which now load x ahead (call10_experiment.patch: INFER_EXP_TILES
# "n,k,act,norm=BLOCK_N,BLOCK_K,warps,stages" overrides a one-row tile; x_ahead follows from warps <= 2).
# A = HEAD (.base/src); G0 = gate/up + SiLU at (2, 512, 2, 0) (pipelined (2, 512, 2, 3) by default);
# D2 = down at (2, 512, 2, 0) (persistent (2, 2048, 8) by default); D1 = down at (2, 256, 1, 0);
# O1 = o at (2, 256, 1, 0) (default (2, 1024, 4)); Q1 = QKV at (2, 256, 1, 0) (default (8, 256, 8)).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
tiles() { case $1 in G0) echo "9728,2560,1,1=2,512,2,0";; D2) echo "2560,9728,0,0=2,512,2,0";; D1) echo "2560,9728,0,0=2,256,1,0";;
  O1) echo "2560,4096,0,0=2,256,1,0";; Q1) echo "6144,2560,0,1=2,256,1,0";; esac; }
run() { INFER_EXP_TILES=$(tiles $2) PYTHONPATH=$(src $2) timeout 60 python3 benchmarks/single_stream.py --model $CK/$1 \
  --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json \
  > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A G0 D2 D1 O1 Q1 A; do run qwen3-4b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
