#!/bin/bash
# GPU run 34, call 2: the norm after o and after down computed by the projection's last program to finish
# (call2_experiment.patch, INFER_EXP_LASTNORM=1: each program of the skinny GEMM with a residual add bumps a
# counter after its stores; the last one reads the row back from L2 and writes rms_norm of it; the norm's own
# kernel, 72 launches a Qwen3-4B step, is gone). L = the patch with the switch, A = HEAD (.base/src), alternated.
# Then: the kernel against the reference at Qwen3-4B's o and down shapes; the GPU tests at HEAD of what run 33
# left unrun; the fused-engine GPU tests with the switch on.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
run() { INFER_EXP_LASTNORM=$([ $2 = L ] && echo 1 || echo 0) PYTHONPATH=$(src $2) timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 \
  --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json \
  > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
PYTHONPATH=$PWD/src python3 - <<'PY'
import torch
from infer.kernels import skinny_gemm, fused_reference as R, pdl
torch.manual_seed(0)
for n, k in ((2560, 4096), (2560, 9728), (1024, 2048), (1024, 3072)):
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda"); w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**.5
    res = torch.randn(1, n, dtype=torch.bfloat16, device="cuda"); nw = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    for p in (False, True):
        with pdl.scope(p):
            bad = 0
            for _ in range(50):
                y, normed = skinny_gemm.skinny_linear_norm(x, w, None, res, nw, 1e-6, False)
                yr = skinny_gemm.skinny_linear(x, w, None, residual=res)
                nr = R.rms_norm(yr, nw, 1e-6, False)
                bad += int(not torch.equal(y, yr)) + int((normed.float() - nr.float()).abs().max().item() > 0.02 * nr.float().abs().max().item())
        print(f"lastnorm n={n} k={k} pdl={p}: mismatches {bad}/50, counter {skinny_gemm._COUNTERS['cuda:0'].item()}")
PY
for v in A L A L; do run qwen3-4b $v; done
for v in A L A L; do run qwen3-0.6b $v; done
INFER_EXP_LASTNORM=1 PYTHONPATH=$PWD/src timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_engine.py \
  tests/test_greedy_agreement_gpu.py > $OUT/call2_tests_lastnorm.log 2>&1; tail -2 $OUT/call2_tests_lastnorm.log
PYTHONPATH=$PWD/.base/src timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py tests/test_kernels.py \
  tests/test_paged.py > $OUT/call2_tests_head.log 2>&1; tail -2 $OUT/call2_tests_head.log
echo "wall $(( $(date +%s) - T0 )) s"
