#!/bin/bash
# GPU run 22, call 10: the host part of a 256-sequence decode step, piece by piece (host_parts.py).
CK=/tmp/infer-ckpt
[ -d $CK/qwen3-0.6b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b >/dev/null 2>&1
PYTHONPATH=$PWD/src timeout 300 python3 benchmarks/reports/gpu-2026-11-25/run22/host_parts.py $CK/qwen3-0.6b 2>&1 \
  | grep -v Warning | tee $OUT/host_parts.txt | tail -30
