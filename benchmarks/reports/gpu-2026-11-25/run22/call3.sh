#!/bin/bash
# GPU run 22, calls 3-5: chunked prefill with every flag on, the long-prefill cap (long_prefill_token_threshold,
# vLLM's name) beside a larger budget: long prompts take at most the cap per step, new short prompts the
# rest, so a burst of arrivals is admitted fast while each step's prefill work stays bounded.
# Usage: PAIRS="1024:256 2048:256" call3.sh PRESET   (budget:cap; cap 0 = none). run 21 call 1's workload and flags.
P=${1:-qwen3-4b}
export INFER_COMMIT=$(cat .commit 2>/dev/null)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src
FINAL=$OUT; R=/tmp/r3; mkdir -p $R
SV="--fused-kernels --cuda-graphs --async-scheduling --cuda-graph-mixed-max-tokens 2048"
WL="--input-len 256 --output-len 1536 --long-prompts 8 --long-len 8000 --long-start-s 1 --long-interval-s 0.5"
CK=/tmp/infer-ckpt
[ -d $CK/$P ] || python3 scripts/make_synthetic_checkpoint.py $P $CK/$P >/dev/null 2>&1
configs=("off=")
seen=" "
for pair in ${PAIRS:-256:0 1024:256 2048:256 2048:512}; do
  b=${pair%%:*} t=${pair##*:}
  label=c$b; [ "$t" = 0 ] || label=c$b-t$t
  [[ "$seen" == *" $label "* ]] && label=$label-again  # a repeat in the same call
  seen="$seen$label "
  if [ "$t" = 0 ]; then configs+=("$label=--chunked-prefill --max-num-batched-tokens $b")
  else configs+=("$label=--chunked-prefill --max-num-batched-tokens $b --long-prefill-token-threshold $t"); fi
done
timeout 560 python3 benchmarks/serve_bench.py --launch --workload decode-interference --token-prompts --token-itl \
  --num-requests 32 $WL --no-progress \
  --server-args "--model $CK/$P --device cuda --batching continuous --kv-cache paged --max-model-len 16384 --max-num-seqs 128 $SV" \
  --server-configs "${configs[@]}" --out $R/chunked_$P.json --plot $FINAL/chunked_$P.png > $FINAL/log_$P.txt 2>&1
echo "rc=$?"
cp $R/chunked_$P.md $FINAL/ 2>/dev/null
grep -E "^\|" $FINAL/chunked_$P.md | head -12
grep -iE "Traceback|Error" $FINAL/log_$P.txt | head -5
