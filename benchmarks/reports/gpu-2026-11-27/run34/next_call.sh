#!/bin/bash
# Prepared at the end of run 34 for the next GPU run (not run: device time spent). Three parts, ~500 s on one GPU:
# 1. The GPU tests at HEAD that run 34 could not run after its last change (Qwen3-4B's QKV at the one-warp tile
#    (2, 256, 1) with x ahead): the fused kernels, the fused engine, the greedy-agreement gate, MoE, the attention.
# 2. That change on an H100 (A = HEAD, B = HEAD~ in .base/src: `git archive f5ff966~ src | tar -x -C .base`).
#    Run parts 1-2 with kind nvidia-h100-x1, or run part 2 there and the rest on an H200.
# 3. More small tiles with x ahead on Qwen3-4B (apply call10_experiment.patch to the working tree; INFER_EXP_TILES
#    "n,k,act,norm=BLOCK_N,BLOCK_K,warps,stages"): QKV at (2, 128, 1, 0); gate/up + SiLU at (2, 256, 1, 3) and
#    (2, 512, 1, 3) (pipelined: x in flight through the pipeliner); the LM head at (2, 256, 1, 3); o at
#    (2, 1024, 2, 0) and down at (2, 1024, 2, 0) (2 warps: x ahead); P = HEAD's defaults.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
PYTHONPATH=$PWD/src timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_fused_kernels.py tests/test_kernels.py \
  tests/test_paged.py tests/test_fused_engine.py tests/test_greedy_agreement_gpu.py tests/test_moe.py > $OUT/next_tests.log 2>&1
tail -3 $OUT/next_tests.log
src() { [ $1 = B ] && echo $PWD/.base/src || echo $PWD/src; }
tiles() { case $1 in Q0) echo "6144,2560,0,1=2,128,1,0";; G1) echo "9728,2560,1,1=2,256,1,3";; G2) echo "9728,2560,1,1=2,512,1,3";;
  L1) echo "151936,2560,0,0=2,256,1,3";; O2) echo "2560,4096,0,0=2,1024,2,0";; D2) echo "2560,9728,0,0=2,1024,2,0";; esac; }
run() { INFER_EXP_TILES=$(tiles $2) PYTHONPATH=$(src $2) timeout 60 python3 benchmarks/single_stream.py --model $CK/$1 \
  --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json \
  > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in B P B P; do run qwen3-4b $v; done
for v in Q0 G1 G2 L1 O2 D2 P; do run qwen3-4b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
