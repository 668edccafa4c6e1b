#!/bin/bash
# GPU run 34, call 11: call 10's winner, Qwen3-4B's QKV at the 1-warp tile (2, 256, 1, 0) with x ahead (Q1), again,
# beside (2, 512, 1, 0) (Q2) and (4, 256, 1, 0) (Q3); A = HEAD. Same patch as call 10 (call10_experiment.patch).
# Then the one-row norm + projection GPU test at Qwen3 shapes with Q1's tile for Qwen3-4B's QKV.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
tiles() { case $1 in Q1) echo "6144,2560,0,1=2,256,1,0";; Q2) echo "6144,2560,0,1=2,512,1,0";; Q3) echo "6144,2560,0,1=4,256,1,0";; esac; }
run() { INFER_EXP_TILES=$(tiles $2) PYTHONPATH=$(src $2) timeout 60 python3 benchmarks/single_stream.py --model $CK/$1 \
  --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json \
  > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A Q1 Q2 Q3 A Q1; do run qwen3-4b $v; done
INFER_EXP_TILES="6144,2560,0,1=2,256,1,0" PYTHONPATH=$PWD/src timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_fused_kernels.py -k "add_rms_norm_linear_one_row" 2>&1 | tail -1
echo "wall $(( $(date +%s) - T0 )) s"
