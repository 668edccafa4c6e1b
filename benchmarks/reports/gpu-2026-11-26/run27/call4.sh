#!/bin/bash
# GPU run 27, call 4: the decode attention's split merge takes CHUNK splits per step (one [rows, CHUNK, D] load, a sum
# over the chunk) instead of one split per step, and only the KV head's real query rows (not the 16 of its dots).
# A = 9a4e6b9 (.base/src), B = the working tree. GPU tests of the attention kernels, fused kernels and fused engine
# on B; batch 1 alternated (128- and 1,024-token prompts).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
(for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done) &
export PYTHONPATH=$PWD/src
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_paged.py > $OUT/tests_attn.log 2>&1; echo "B: attention GPU tests rc=$?"; tail -1 $OUT/tests_attn.log
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
run() { PYTHONPATH=$([ $2 = A ] && echo $PWD/.base/src || echo $PWD/src) \
  timeout 80 python3 benchmarks/single_stream.py --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens $3 --output-len 128 \
  --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 prompt $3 batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A B A B; do run qwen3-4b $v 128; done
for v in A B; do run qwen3-4b $v 1024; done
for v in A B; do run qwen3-0.6b $v 128; done
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_engine.py > $OUT/tests_engine.log 2>&1; echo "B: fused-engine GPU tests rc=$?"; tail -1 $OUT/tests_engine.log
