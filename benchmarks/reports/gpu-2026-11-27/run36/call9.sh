#!/bin/bash
# Run 36 call 9: the upper bound of dropping the one-row norm kernels (call9_experiment.patch: INFER_EXP_SKIP_NORM
# 1 = QKV reads x un-normalized, 2 = gate/up does, 3 = both; wrong tokens, every other kernel the same). The
# norms' end deltas are 2.1 us each (run 35's trace), but skipping the QK norm + RoPE kernel (call 2) was slower:
# does a norm's boundary cost what its end delta says? HEAD c158a16, batch 1, every phase 8-9 flag + pdl.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { INFER_EXP_SKIP_NORM=${2#S} PYTHONPATH=$PWD/src timeout 90 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log | cut -c1-300
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(python3 -c "import json; x = [r for r in json.load(open('$L/ss.json'))['rows'] if r['engine'].startswith('infer')][0]; print(f\"tpot {x['tpot_ms']:.4f} ms, floor {x['floor_ms']:.4f} ({100 * x['floor_frac']:.1f}%)\")")"; }
for v in S0 S1 S2 S3 S0 S1 S2 S3; do run qwen3-4b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
