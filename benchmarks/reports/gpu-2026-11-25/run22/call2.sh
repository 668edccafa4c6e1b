#!/bin/bash
# GPU run 22, call 2: the host's work per step at 256 sequences (Qwen3-0.6B, every flag), three sources in
# one call: old = 60e4627 (before the host-work changes of 2026-11-25), mid = 585eb7a (after them), new =
# the working tree (output kinds; the server's streams ask DELTA). Usage: call2.sh offline|stream
# (.old/{old,mid}/src: `git archive <commit> src`, carried).
MODE=${1:-offline}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
CK=/tmp/infer-ckpt
[ -d $CK/qwen3-0.6b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-0.6b $CK/qwen3-0.6b >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true
prof() {  # prof NAME SRC EXTRA...
  local name=$1 src=$2; shift 2
  PYTHONPATH=/tmp/site:$src timeout 150 python3 benchmarks/step_profile.py --model $CK/qwen3-0.6b --device cuda \
    --dtype bfloat16 --max-num-seqs 256 --max-num-batched-tokens 16384 --steps 60 --unsync-steps 50 --profile-steps 3 \
    --host-profile 0 --no-progress --infer-configs "$ALL" --out $OUT/${MODE}_$name.json "$@" > $OUT/log_${MODE}_$name.txt 2>&1
  echo "$name: $(grep -E '^\| infer' $OUT/${MODE}_$name.md | cut -d'|' -f5-10,14-17)"
}
echo "columns: schedule execute output step execute_host host | unsync_step unsync_wait unsync_host busy_share_unsync"
if [ "$MODE" = offline ]; then
  for v in new old mid new old mid; do
    case $v in new) s=$PWD/src;; *) s=$PWD/.old/$v/src;; esac
    prof ${v}_$RANDOM $s
  done
else
  for v in new mid old; do
    case $v in new) s=$PWD/src;; *) s=$PWD/.old/$v/src;; esac
    prof $v $s --stream
  done
  MODE=hostprof prof new $PWD/src --host-profile 20 --top 40 --steps 20 --unsync-steps 0 --profile-steps 0
  grep -E "^\| [a-z_]+\.py" $OUT/hostprof_new.md | head -40
fi
rm -f $OUT/*.json
