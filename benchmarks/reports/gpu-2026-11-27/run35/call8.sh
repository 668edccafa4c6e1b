#!/bin/bash
# GPU run 35, call 8: after the review's refactor (skinny_gemm.after_norm_config; benchmarks/skinny_gemm.py --fused
# timing the engine's own add_rms_norm_linear): the benchmark's fused rows, new (working tree) against the one before
# (.base/bench/skinny_gemm.py = ebbef76's, with 695dfe4's src), and the fused kernels' GPU tests.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
for v in new old new; do
  if [ $v = new ]; then B=benchmarks/skinny_gemm.py S=$PWD/src; else B=.base/bench/skinny_gemm.py S=$PWD/.base/src; fi
  PYTHONPATH=$S timeout 120 python3 $B --rows 1 --pdl --fused --fused-only --projs qkv gate_up --out /tmp/sk_$v.json \
    > /tmp/sk_$v.log 2>&1 || tail -5 /tmp/sk_$v.log
  echo "$v (+$(( $(date +%s) - T0 )) s):"; python3 - "$v" <<'PY'
import json, sys
for r in json.load(open(f"/tmp/sk_{sys.argv[1]}.json"))["results"]:
    print(r["model"], r["proj"], "tile", r.get("default_tile"), "two_kernels_us", r.get("two_kernels_us"),
          "two_kernels_pdl_us", r.get("two_kernels_pdl_us"), "max_err_rel", round(r["max_err_rel"], 5))
PY
done
PYTHONPATH=$PWD/src timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_fused_kernels.py \
  > $OUT/call8_tests.log 2>&1
tail -3 $OUT/call8_tests.log
echo "wall $(( $(date +%s) - T0 )) s"
