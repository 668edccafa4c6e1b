#!/bin/bash
# Run 36 call 1 = run 35's next_call.sh (+ HEAD's sampler GPU tests, unrun at bb577b2). Apply call1_experiment.patch to
# HEAD's working tree first (`git apply benchmarks/reports/gpu-2026-11-27/run35/next_experiment.patch`; revert with
# `git checkout src` before committing anything): INFER_EXP_ATT "BLOCK_N,MIN_SPLIT_KEYS,warps,stages" sets the decode
# attention's key tile, its shortest slice and its launch; INFER_EXP_TILES overrides one-row skinny GEMM tiles.
#
# The idea: at batch 1 over 129-256 keys the decode attention (7.1 us a layer on an H200, run 35's largest loss
# beyond the weights' bytes) runs 3-4 one-tile slices per KV head and merges them: after its PDL wait a chain of
# q -> K (+ V, which the pipeliner's prologue issues with K) -> partial store + acq_rel counter -> the last
# program's merge loads -> output. One program per KV head holding all the keys in ONE tile (BLOCK_N 256,
# MIN_SPLIT_KEYS 256: `active` = 1, it writes its output directly) drops the counter and the merge trips, at
# the price of 8 programs each streaming 128 KB of K and V. Run 29's "one unsplit slice" (3.45 vs 3.39-3.41 ms,
# H100) walked four 64-key tiles in turn; this is one tile. Variants: T256 (8 warps, stages 2: K and V issued
# together, 128 KB of shared memory per stage: may not compile, then the log says so), T256W16 (16 warps),
# T256S1 (stages 1: V after the softmax), T128 (two 128-key one-tile slices and a 2-split merge). A = HEAD.
# ~300 s on one GPU; ask for nvidia-h200.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
att() { case $1 in T256) echo 256,256,8,2;; T256W16) echo 256,256,16,2;; T256S1) echo 256,256,16,1;; T128) echo 128,128,8,2;; esac; }
run() { INFER_EXP_ATT=$(att $2) PYTHONPATH=$PWD/src timeout 90 python3 benchmarks/single_stream.py \
  --model $CK/$1 --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" \
  --out $L/ss.json > $L/ss.log 2>&1 || tail -3 $L/ss.log | cut -c1-300
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for v in A T256 T256W16 T256S1 T128 A T256 T256W16 T256S1 T128; do run qwen3-4b $v; done
for v in A T256W16 A T256W16; do run qwen3-0.6b $v; done
# the attention's GPU tests under the 16-warp one-tile launch (every shape the suite decodes, splits included)
INFER_EXP_ATT=256,256,16,2 PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
  tests/test_kernels.py tests/test_paged.py > $OUT/next_tests.log 2>&1
tail -3 $OUT/next_tests.log
PYTHONPATH=$PWD/src timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sampler_fast.py > $OUT/sampler_tests.log 2>&1; tail -2 $OUT/sampler_tests.log
echo "wall $(( $(date +%s) - T0 )) s"
