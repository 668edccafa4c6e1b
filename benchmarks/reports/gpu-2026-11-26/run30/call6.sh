#!/bin/bash
# GPU run 30, call 6: the sampler's argmax takes a NaN as torch.argmax does (the first NaN wins) instead of returning
# the id one past the vocabulary. A = HEAD (.base/src), B = the working tree. The sampler benchmark A / B / A / B
# (256 and 1 rows, bf16, Qwen3's vocabulary), batch-1 Qwen3-0.6B A / B / A / B (greedy: argmax_lse every step), then
# the sampler's and the engine's NaN GPU tests on B.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
[ -d $CK/qwen3-0.6b ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b --device cuda >/dev/null 2>&1
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
for v in A B A B; do
  PYTHONPATH=$(src $v) timeout 60 python3 benchmarks/sampler.py --rows 256,1 --dtypes bfloat16 --mixes greedy,temperature,top_k_top_p --quick \
    --out $L/sampler_$v.json > $L/sampler.log 2>&1 || tail -3 $L/sampler.log
  echo "== sampler $v"; grep -E '^\|' $L/sampler_$v.md | cut -c1-160
done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
for v in A B A B; do
  PYTHONPATH=$(src $v) timeout 90 python3 benchmarks/single_stream.py --model $CK/qwen3-0.6b --device cuda \
    --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --infer-configs "$ALL" --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "qwen3-0.6b $v batch 1: $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"
done
export PYTHONPATH=$PWD/src
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sampler_fast.py tests/test_sampler.py \
  tests/test_batching.py 2>&1 | tail -4
