#!/bin/bash
# GPU run 23, call 3: where the host's work of a 256-sequence step goes now (cProfile of 10 steps,
# functions by self time too), and whether pinning the process to one core (taskset) steadies the
# host's timings: new without / with taskset, alternated.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src
CK=/tmp/infer-ckpt
[ -d $CK/qwen3-0.6b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
run() {  # label, host-profile steps, command prefix
  $3 timeout 150 python3 benchmarks/step_profile.py --model $CK/qwen3-0.6b --device cuda \
    --dtype bfloat16 --max-num-seqs 256 --max-num-batched-tokens 16384 --steps 60 --unsync-steps 50 --profile-steps 0 \
    --host-profile $2 --top 60 --no-progress --infer-configs "$ALL" --out $OUT/step_$1.json > /dev/null 2>&1
  echo "step $1: $(grep -E '^\| infer' $OUT/step_$1.md | head -1 | cut -d'|' -f5-17)"
}
run profiled 10 ""
for i in 1 2 3; do run free$i 0 ""; run pinned$i 0 "taskset -c 5"; done
rm -f $OUT/*.json
