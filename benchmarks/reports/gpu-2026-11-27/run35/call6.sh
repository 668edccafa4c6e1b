#!/bin/bash
# GPU run 35, call 6 (H200): the greedy path's logprob from the combining kernel (5f57cc9, B) against the code before it
# (A = 695dfe4 in .base/src), alternated, Qwen3-4B and Qwen3-0.6B; gate/up + SiLU at (2, 512, 1, 3) (G2,
# call6_experiment.patch's INFER_EXP_TILES; call 1 had it at 3.27 against 3.28 on an H100); then where a step goes
# (trace_deltas.py) at B.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
R=benchmarks/reports/gpu-2026-11-27/run35
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
run() { INFER_EXP_TILES=$([ $2 = G2 ] && echo "9728,2560,1,1=2,512,1,3") PYTHONPATH=$(src $2) timeout 60 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B G2 A B G2; do run qwen3-4b $v; done
for v in A B A B; do run qwen3-0.6b $v; done
PYTHONPATH=$PWD/src timeout 150 python3 $R/trace_deltas.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 --max-num-seqs 1 \
  --num-requests 1 --min-len 128 --max-len 128 --min-output-len 400 --max-output-len 400 --temperature 0 \
  --skip 5 --steps 10 --unsync-steps 10 --profile-steps 10 --top 14 --no-progress \
  --infer-configs "$ALL" --out $L/step1.json > $OUT/call6_trace.log 2>&1; echo rc=$?
grep -A 24 "end deltas" $OUT/call6_trace.log | head -26
echo "wall $(( $(date +%s) - T0 )) s"
