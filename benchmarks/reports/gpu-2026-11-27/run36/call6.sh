#!/bin/bash
# Run 36 call 6: HEAD ba6dc5e (B: the norms' weight before the PDL wait) against bb577b2 (A = .base/src) with
# TPOT to 4 decimals, and the one-row norm kernel (2,560 or 1,024 values) at 2, 4 and 16 warps instead of 8 / 4
# (call6_experiment.patch: INFER_EXP_NORM_WARPS). Batch 1, every phase 8-9 flag + pdl, alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { env INFER_EXP_NORM_WARPS=$(case $2 in W*) echo ${2#W};; *) echo 0;; esac) \
  PYTHONPATH=$PWD/$( [ $2 = A ] && echo .base/src || echo src ) timeout 90 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log | cut -c1-300
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(python3 -c "import json; x = [r for r in json.load(open('$L/ss.json'))['rows'] if r['engine'].startswith('infer')][0]; print(f\"tpot {x['tpot_ms']:.4f} ms, floor {x['floor_ms']:.4f} ({100 * x['floor_frac']:.1f}%)\")")"; }
for v in A B W4 W16 W2 A B W4 W16 W2; do run qwen3-4b $v; done
for v in A B W2 A B W2; do run qwen3-0.6b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
