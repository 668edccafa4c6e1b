#!/bin/bash
# GPU run 35, call 1 (H200). A = 695dfe4 (.base/src: `git archive 695dfe4 src | tar -x -C .base`), B = the working tree
# (5f57cc9, the greedy path's logprob from the combining kernel, + call1_experiment.patch, whose hooks are off
# unless their variables are set). 1) A / B alternated, Qwen3-4B and Qwen3-0.6B. 2) B with the projections'
# weight rows asked of L2 before their PDL wait (run 28's cp.async.bulk.prefetch.L2, now only for the named
# shapes, INFER_EXP_PF "n,k,act"): o (after the latency-bound decode attention), QKV, gate/up (after a norm).
# 3) run 34's prepared small tiles (INFER_EXP_TILES "n,k,act,norm=BLOCK_N,BLOCK_K,warps,stages").
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
pf() { case $1 in PO) echo "2560,4096,0";; PQ) echo "6144,2560,0";; PG) echo "9728,2560,1";; PA) echo "2560,4096,0;6144,2560,0;9728,2560,1";; esac; }
tiles() { case $1 in Q0) echo "6144,2560,0,1=2,128,1,0";; G1) echo "9728,2560,1,1=2,256,1,3";; G2) echo "9728,2560,1,1=2,512,1,3";;
  L1) echo "151936,2560,0,0=2,256,1,3";; O2) echo "2560,4096,0,0=2,1024,2,0";; D2) echo "2560,9728,0,0=2,1024,2,0";;
  OK) echo "2560,4096,0,0=2,2048,4,0";; esac; }
run() { INFER_EXP_PF=$(pf $2) INFER_EXP_TILES=$(tiles $2) PYTHONPATH=$(src $2) timeout 60 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B A B; do run qwen3-4b $v; done
for v in A B A B; do run qwen3-0.6b $v; done
for v in PO PQ PG PA B PO; do run qwen3-4b $v; done
for v in Q0 G1 G2 L1 O2 D2 OK B; do run qwen3-4b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
