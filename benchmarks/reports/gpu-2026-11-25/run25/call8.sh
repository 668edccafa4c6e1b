#!/bin/bash
# GPU run 25, call 8: the figures at a28a1e8 beside HF transformers (static cache + torch.compile)
# and the copy floor measured in the same run: batch 1 (single_stream.py, every phase 8-9 flag, pdl off and on),
# and the offline workload (256 requests, 512 output tokens, every flag).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
for p in qwen3-4b qwen3-0.6b; do
  timeout 240 python3 benchmarks/single_stream.py --model $CK/$p --device cuda --dtype bfloat16 --prompt-lens 128 \
    --output-len 128 --repeats 3 --hf compiled --infer-configs "$ALL;$ALL,pdl=true" --out $OUT/single_$p.json > $L/s_$p.log 2>&1 || tail -3 $L/s_$p.log
  echo "$p:"; grep -E '^\| (infer|hf)' $OUT/single_$p.md | cut -d'|' -f2-8 | sed "s/$ALL/ALL/"
done
timeout 150 python3 benchmarks/offline_throughput.py --model $CK/qwen3-0.6b --device cuda --dtype bfloat16 \
  --max-num-seqs 256 --max-num-batched-tokens 16384 --min-output-len 512 --max-output-len 512 --engines infer \
  --infer-configs "$ALL,pdl=true" --no-progress --no-ceilings --out $OUT/offline.json > $L/offline.log 2>&1 || tail -3 $L/offline.log
echo "offline: $(grep -E '^\| infer' $OUT/offline.md | head -1)"
rm -f $OUT/*.json
