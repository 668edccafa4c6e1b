#!/bin/bash
# GPU run 26, call 8 (the session's last device minutes): qk_norm_rope loads what no kernel of the step writes (the
# token's position and slot, its cos/sin row, the norm weights) before its PDL wait, as the attention now plans its
# split first (call 7). A = 7ffcd2e (.base/src), B = the working tree. GPU tests of the kernels and the fused
# engine on B; batch 1 alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
(for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
export PYTHONPATH=$PWD/src
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_fused_kernels.py tests/test_fused_engine.py > $OUT/tests.log 2>&1; echo "B: kernel, fused-kernel, fused-engine GPU tests rc=$?"; tail -1 $OUT/tests.log
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) \
  timeout 80 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 \
  --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B A B; do run qwen3-4b $v; done
for v in A B; do run qwen3-0.6b $v; done
