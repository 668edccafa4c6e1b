#!/bin/bash
# GPU run 26, call 3: re-tune Qwen3-4B's fused norm + QKV and norm + gate/up + SiLU tiles now that the norm's first
# pass can load whole rows (run 25 tuned them slice by slice), for one-load thresholds of 16 (committed), 32 and 64
# values per thread (call3_experiment.patch: env hooks, not committed); then batch 1 with the best pair against the
# defaults, alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
R=benchmarks/reports/gpu-2026-11-26/run26
(for p in qwen3-4b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
for one in 16 32 64; do
  INFER_EXP_ONE_LOAD=$one timeout 150 python3 benchmarks/skinny_gemm.py --models qwen3-4b --rows 1 --pdl --fused --tune \
    --projs qkv gate_up --out $L/tune_$one.json > $L/tune_$one.log 2>&1 || tail -3 $L/tune_$one.log
  cp $L/tune_$one.json $OUT/
done
BEST=$(python3 $R/pick.py 16 32 64); echo "best: $BEST"
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for v in X=0 "$BEST" X=0 "$BEST"; do
  env $v timeout 90 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "qwen3-4b [$v] batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done
