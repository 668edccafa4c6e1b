#!/bin/bash
# GPU run 24, call 5: the whole GPU test suite at the session's code, then the batch-1 figures
# (single_stream.py, every phase 8-9 flag, pdl off and on, Qwen3-4B and Qwen3-0.6B shapes).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1 & done
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests > $OUT/tests.log 2>&1; echo "tests rc=$?"
grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -8
wait
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for p in qwen3-4b qwen3-0.6b; do
  timeout 120 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL;$ALL,pdl=true" --out $OUT/single_$p.json > $L/s_$p.log 2>&1 || tail -3 $L/s_$p.log
  echo "$p:"; grep -E '^\| infer' $OUT/single_$p.md | cut -d'|' -f2-9 | sed "s/$ALL/ALL/"
done
