#!/bin/bash
# GPU run 28, call 1: L2 prefetch before the PDL wait (call1_experiment.patch, INFER_EXP_PF: bit 1 = each skinny-GEMM
# program asks L2 for its whole weight rows, cp.async.bulk.prefetch.L2; bit 2 = each decode-attention program for
# its keys' K and V rows). Batch 1: A = 24eafa9 (.base/src), B0..B3 = the working tree with INFER_EXP_PF=0..3.
# Then per call (run 27's percall.py) with PF 0 and 1, and the fused/attention GPU tests with PF 3.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
R=benchmarks/reports/gpu-2026-11-26/run28
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
export PYTHONPATH=$PWD/src
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) INFER_EXP_PF=${2#B} \
  timeout 80 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 \
  --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B1 B2 B3 B0 A B1 B2 B3; do run qwen3-4b $v; done
for v in A B3 A B3; do run qwen3-0.6b $v; done
for pf in 0 1; do INFER_EXP_PF=$pf timeout 60 python3 benchmarks/reports/gpu-2026-11-26/run27/percall.py > $OUT/percall_pf$pf.md 2>&1; echo "PF $pf"; cat $OUT/percall_pf$pf.md; done
INFER_EXP_PF=3 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py tests/test_fused_engine.py tests/test_kernels.py > $OUT/tests.log 2>&1; echo "PF 3: GPU tests rc=$?"; tail -1 $OUT/tests.log
