#!/bin/bash
# GPU run 35, call 4: which half of call 3 loses on Qwen3-4B: the norm before QKV and gate/up without a kernel of its own (call3_experiment.patch,
# INFER_EXP_SQ=1): the projection before it (o, down: the residual add in their epilogue) adds each program's sum of
# squares of its rounded outputs into one float32 with an atomic, and the projection after it reads that sum after its
# PDL wait and normalizes x slice by slice (the skinny GEMM's NORM mode without its first pass). A pool of sums zeroed
# at the start of each forward (one memset in the graph). A = the same tree with the variable unset; alternated. Then
# call4_experiment.patch: INFER_EXP_SQ 1 both norms, 2 only the one before gate/up, 3 only before QKV, 4 the
# atomics alone (every norm keeps its kernel); A = unset.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { INFER_EXP_SQ=$([ $2 = A ] || echo ${2#S}) PYTHONPATH=$PWD/src timeout 60 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A S1 S2 S3 S4 A S2 S3 S4; do run qwen3-4b $v; done
for v in S2 S3 S2 S3; do run qwen3-0.6b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
