#!/bin/bash
# GPU run 27, call 7: an nsys trace of Qwen3-4B batch-1 decode (every flag + pdl, CUDA graphs traced per node) and
# each kernel's "end delta" (end_deltas.py): what it adds to the step's critical path under PDL.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
which nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -2
NSYS=$(which nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/*/bin/nsys 2>/dev/null | head -1)
[ -n "$NSYS" ] || { echo "no nsys on this image"; exit 0; }
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
R=benchmarks/reports/gpu-2026-11-26/run27
export PYTHONPATH=$PWD/src
[ -d $CK/qwen3-4b ] || python3 scripts/make_synthetic_checkpoint.py qwen3-4b $CK/qwen3-4b --device cuda >/dev/null 2>&1
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
timeout 200 $NSYS profile --cuda-graph-trace=node --trace=cuda -o $L/p --force-overwrite true \
  python3 benchmarks/single_stream.py --model $CK/qwen3-4b --device cuda --dtype bfloat16 --prompt-lens 128 \
  --output-len 64 --repeats 1 --infer-configs "$ALL" --out $L/ss.json > $L/nsys.log 2>&1; echo "nsys rc=$?"; tail -3 $L/nsys.log
timeout 120 $NSYS stats --report cuda_gpu_trace --format csv --output $L/trace $L/p.nsys-rep > /dev/null 2>&1; ls $L | head
python3 $R/end_deltas.py $L/trace_cuda_gpu_trace.csv > $OUT/end_deltas.md 2>&1; cat $OUT/end_deltas.md
