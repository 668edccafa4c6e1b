#!/bin/bash
# GPU run 26, call 5: Qwen3-4B's o projection follows the decode attention, which is latency-bound (6-8 us, the
# memory bus idle). With a tile as wide as the row (BLOCK_K = K = 4096), a program's whole share of W is its
# first tile, loaded before the PDL wait: does streaming o's weights under the attention beat the back-to-back
# best tile (2, 1024, 4)? Env hook of call3_experiment.patch (not committed); batch 1 per tile, base twice.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
export PYTHONPATH=$PWD/src
[ -d $CK/qwen3-4b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for t in X 2,4096,8 1,4096,4 2,4096,4 4,4096,8 2,2048,4 X; do
  env INFER_EXP_TILE_PLAIN_4096=$([ $t = X ] || echo $t) timeout 90 python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 \
    --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "qwen3-4b o tile [$t] batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done
