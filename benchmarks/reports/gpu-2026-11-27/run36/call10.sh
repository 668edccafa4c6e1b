#!/bin/bash
# Run 36 call 10: the norm before a projection lets that projection launch before its own PDL wait (call10_experiment.patch:
# pdl.launch_next_then_wait in the norm kernel; INFER_EXP_EARLY 1 = the norm before QKV, 2 = before gate/up, 3 = both).
# Call 9: without the norm before gate/up the step was 53 us faster (gate/up launched during o), without QKV's 47 slower.
# HEAD c158a16 + the patch, batch 1, every phase 8-9 flag + pdl.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { INFER_EXP_EARLY=${2#E} PYTHONPATH=$PWD/src timeout 90 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log | cut -c1-300
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(python3 -c "import json; x = [r for r in json.load(open('$L/ss.json'))['rows'] if r['engine'].startswith('infer')][0]; print(f\"tpot {x['tpot_ms']:.4f} ms, floor {x['floor_ms']:.4f} ({100 * x['floor_frac']:.1f}%)\")")"; }
for v in E0 E2 E1 E3 E0 E2 E1 E3; do run qwen3-4b $v; done
for v in E0 E2 E3 E0 E2 E3; do run qwen3-0.6b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
