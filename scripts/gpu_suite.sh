#!/usr/bin/env bash
# The GPU suite: everything the GPU machine has to say, in one call of the `device` tool.
#
#   bash scripts/gpu_suite.sh                   # every section, in order
#   bash scripts/gpu_suite.sh env parity        # only these sections
#   SUITE_SKIP=tests bash scripts/gpu_suite.sh  # all but these
#   PARITY_ARGS=--all bash scripts/gpu_suite.sh # extra arguments to both parity runs (+ llama3-8b)
#   SECTION_TIMEOUT=300 SECTION_TIMEOUT_tp=200 bash scripts/gpu_suite.sh tp bench_parallel  # stacks of a hang
#
# Runs in the repository root of the GPU machine, whose python3 has torch (CUDA), transformers,
# safetensors, tokenizers, jinja2, pytest, tqdm, numpy but not gguf, fastapi, uvicorn,
# outlines-core, sse-starlette or openai. infer is not pip-installed there: it is imported from
# src/ (PYTHONPATH). Wheels of missing packages may be carried in .whl/ (see the device tool's
# README); they are installed into /tmp/site without touching the image. The server section
# needs fastapi, starlette, uvicorn, pydantic, pydantic-core, typing-inspection, annotated-types,
# annotated-doc and opentelemetry-api.
#
# What lands in $OUT (default: a new benchmarks/runs/gpu-suite-<date>-<time>/, ignored by git; the
# device tool sets $OUT and brings back at most 8 files, so keep it few):
#   suite.log      everything every section printed, with a header per section;
#   summary.json   each section's exit status and seconds (also at the end of suite.log);
#   <report>.json  what sections write (parity.json, parity_fp32.json, ...).
# Past 8 files, everything but suite.log and summary.json is packed into reports.tar.gz.
# The suite goes on after a failed section and exits 1 if any failed. Measured on an H100
# (2026-11-22): env + tests + parity + parity_fp32 take ~130 s; keep the whole within ~10 min.
#
# To add a section (later: benchmarks): write a function `section_<name>` and add <name> to
# SECTIONS below. A section prints what a reader needs and writes its reports under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/benchmarks/runs/gpu-suite-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
MAX_OUT_FILES=8

SECTIONS=(env tests parity parity_fp32 bench_kernels bench_single bench_paged server bench_offline bench_serve bench_step
          bench_fused bench_sampler bench_flags parity_fused greedy_agreement bench_flags_nano bench_chunked
          bench_moe bench_moe_model tests_new bench_prefix bench_structured bench_offload bench_step1)
CKPT="${CKPT:-/tmp/infer-ckpt}"  # synthetic checkpoints, shared by the sections

# ----------------------------------------------------------------------------- environment
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1  # no network there
export TOKENIZERS_PARALLELISM=false

setup_python_path() {
    if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
        echo "installing carried wheels: $(cd .whl && ls -- *.whl | tr '\n' ' ')"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
            || echo "WARNING: installing .whl/*.whl failed"
        export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    else
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
    echo "PYTHONPATH=$PYTHONPATH"
}

# ----------------------------------------------------------------------------- sections

section_env() {
    nvidia-smi || echo "nvidia-smi failed"
    "$PY" - <<'EOF'
import platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.1f} GiB", "sm", f"{p.major}.{p.minor}",
          "count", torch.cuda.device_count())
for mod in ("triton", "transformers", "safetensors", "tokenizers", "numpy", "jinja2", "gguf", "fastapi"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except ImportError:
        print(mod, "MISSING")
import infer, infer.loader, infer.attention, infer.models  # must work without gguf/fastapi
print("infer", infer.__version__, "from", infer.__file__)
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
}

# TESTS: the test files or node ids to run (default: all of tests/)
section_tests() {
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests}
    local rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "pytest: no tests selected by -m gpu (exit 5): OK"
        return 0
    fi
    return "$rc"
}

# bf16, the serving dtype: infer vs HF sdpa, with HF eager vs HF sdpa as the noise floor.
section_parity() {
    # shellcheck disable=SC2086
    "$PY" scripts/gpu_parity.py --workdir "$CKPT" --reuse --out "$OUT/parity.json" ${PARITY_ARGS:-}
}

# float32 at the same real shapes: the exact check (max |dlogit| <= 1e-3, identical argmax).
section_parity_fp32() {
    # shellcheck disable=SC2086
    "$PY" scripts/gpu_parity.py --dtype float32 --workdir "$CKPT" --reuse --out "$OUT/parity_fp32.json" \
        ${PARITY_ARGS:-}
}

# Phase 1: batch-1 TTFT/TPOT of infer (contiguous and paged KV, Triton attention) next to HF eager and
# HF static-cache + torch.compile, bf16. SINGLE_CONFIGS / SINGLE_HF / BENCH_PROMPTS override.
section_bench_single() {
    local preset rc=0
    for preset in ${BENCH_PRESETS:-qwen3-0.6b qwen3-4b}; do
        [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
        "$PY" benchmarks/single_stream.py --model "$CKPT/$preset" --device cuda --dtype bfloat16 \
            --prompt-lens ${BENCH_PROMPTS:-128} --output-len 128 --repeats 3 --hf ${SINGLE_HF:-eager compiled} \
            --infer-configs "${SINGLE_CONFIGS:-kv_cache=contiguous;kv_cache=paged}" --out "$OUT/single_$preset.json" || rc=1
    done
    return "$rc"
}

# Phase 5: the paged decode/prefill kernels against PyTorch SDPA over gathered K/V, bf16, Qwen3-4B shapes.
section_bench_kernels() {
    # shellcheck disable=SC2086
    "$PY" benchmarks/paged_attention.py --out "$OUT" ${KERNEL_ARGS:-}
}

# Phase 5 end to end: the same KV memory budget, contiguous rows vs paged blocks (concurrency, throughput,
# preemptions, KV utilization), on a half-scale nano-vllm workload (128 requests, lengths 50-512), bf16.
section_bench_paged() {
    local preset=${PAGED_PRESET:-qwen3-4b}
    [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
    # shellcheck disable=SC2086
    "$PY" benchmarks/offline_throughput.py --model "$CKPT/$preset" --device cuda --dtype bfloat16 \
        --scale "${PAGED_SCALE:-0.5}" --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --kv-cache-memory-bytes "${PAGED_KV_BYTES:-4294967296}" --engines infer --no-progress \
        --infer-configs "batching=continuous,kv_cache=contiguous;batching=continuous,kv_cache=paged" \
        --out "$OUT/paged_$preset.json" --plot "$OUT/paged_$preset.png" ${PAGED_ARGS:-}
}

# Phase 2: the OpenAI-compatible server on the GPU (needs fastapi/uvicorn/pydantic carried in .whl/).
section_server() {
    local preset=${SERVER_PRESET:-qwen3-0.6b}
    [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
    "$PY" scripts/gpu_server_smoke.py "$CKPT/$preset"
}

# Phases 3-4: the nano-vllm offline workload (256 requests, lengths 100-1024), infer static and
# continuous batching next to HF transformers' padded batched generate and its continuous
# batching (generate_batch), bf16, in one run. OFFLINE_ARGS adds flags (e.g. --scale 0.25).
section_bench_offline() {
    local preset rc=0
    for preset in ${OFFLINE_PRESETS:-qwen3-0.6b}; do
        [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
        # shellcheck disable=SC2086
        "$PY" benchmarks/offline_throughput.py --model "$CKPT/$preset" --device cuda --dtype bfloat16 \
            --max-num-seqs 256 --max-num-batched-tokens 16384 \
            --engines "${OFFLINE_ENGINES:-infer,hf,hf-cb}" --hf-batch-size "${HF_BATCH:-128}" \
            --infer-configs "${OFFLINE_CONFIGS:-batching=static;batching=continuous}" --no-progress \
            --out "$OUT/offline_$preset.json" --plot "$OUT/offline_$preset.png" ${OFFLINE_ARGS:-} || rc=1
    done
    return "$rc"
}

# Phases 3-4 online: Poisson arrivals through the HTTP server, static vs continuous batching
# (needs the server wheels in .whl/).
section_bench_serve() {
    local preset=${SERVE_PRESET:-qwen3-0.6b} mode rc=0
    [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
    for mode in static continuous; do
        # shellcheck disable=SC2086
        "$PY" benchmarks/serve_bench.py --launch --server-args "--model $CKPT/$preset --device cuda \
            --max-model-len 2048 --max-num-seqs 128 --max-num-batched-tokens 8192 --batching $mode" \
            --token-prompts --token-itl --num-requests ${SERVE_N:-200} --request-rates ${SERVE_RATES:-4 16 64} \
            --input-len 512 --output-len 256 --no-progress --out "$OUT/serve_$mode.json" ${SERVE_ARGS:-} || rc=1
    done
    return "$rc"
}

# Where a step's time goes (host vs device, top kernels), contiguous vs paged KV, on the
# offline workload's steady decode batch (benchmarks/step_profile.py).
section_bench_step() {
    local preset=${STEP_PRESET:-qwen3-0.6b}
    [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
    # shellcheck disable=SC2086
    "$PY" benchmarks/step_profile.py --model "$CKPT/$preset" --device cuda --dtype bfloat16 --max-num-seqs 256 \
        --max-num-batched-tokens 16384 --no-progress \
        --infer-configs "${STEP_CONFIGS:-batching=continuous;batching=continuous,kv_cache=paged}" \
        --out "$OUT/step_$preset.json" ${STEP_ARGS:-}
}

# Phases 8-9 at batch 1: one request decoding alone (600 greedy tokens after a 128-token prompt),
# every flag on: device busy per step, kernels per step, host work vs waiting for the device (the
# unsynchronized window) and where the host's time goes (cProfile). STEP1_PRESETS picks the models.
section_bench_step1() {
    local preset rc=0
    for preset in ${STEP1_PRESETS:-qwen3-0.6b qwen3-4b}; do
        [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
        # shellcheck disable=SC2086
        "$PY" benchmarks/step_profile.py --model "$CKPT/$preset" --device cuda --dtype bfloat16 --max-num-seqs 1 \
            --num-requests 1 --min-len 128 --max-len 128 --min-output-len 700 --max-output-len 700 --temperature 0 \
            --skip 5 --steps 50 --unsync-steps 300 --profile-steps 20 --host-profile 100 --no-progress \
            --infer-configs "${STEP1_CONFIGS:-kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true}" \
            --out "$OUT/step1_$preset.json" ${STEP1_ARGS:-} || rc=1
    done
    return "$rc"
}

# Phase 8: each fused kernel against the unfused PyTorch ops (CUDA-graph replays), bf16, Qwen3 shapes.
section_bench_fused() {
    # shellcheck disable=SC2086
    "$PY" benchmarks/fused_kernels.py --out "$OUT" ${FUSED_ARGS:-}
}

# Phase 8: the sampler's fast paths against the reference pipeline, 1/32/256 rows x 151,936.
section_bench_sampler() {
    # shellcheck disable=SC2086
    "$PY" benchmarks/sampler.py --out "$OUT/sampler.json" ${SAMPLER_ARGS:-}
}

# Phases 8-9: fused_kernels, cuda_graphs and async_scheduling, each alone and all three, on the offline
# workload with 512 output tokens (Qwen3-0.6B), then batch-1 decode with all three next to HF's compiled
# static cache (both presets). The numbers of docs/phases/08-fused-kernels.md and 09-cuda-graphs.md.
# Phase 15: one MoE layer at Qwen3-30B-A3B shapes, the Triton sort + grouped GEMM against the loop over
# experts for 1..4096 tokens, and a sweep of its tile sizes (docs/phases/15-moe-expert-parallelism.md).
section_bench_moe() {
    # shellcheck disable=SC2086
    "$PY" benchmarks/moe_kernel.py --out "$OUT" ${MOE_ARGS:---tune}
}

# Phase 15: the whole Qwen3-30B-A3B (random weights generated on the GPU at load time: 61 GB would not fit
# the disk): batch-1 decode with the loop, with the kernel, with every flag; offline throughput.
section_bench_moe_model() {
    local d="$CKPT/qwen3-30b-a3b" rc=0 base="batching=continuous,kv_cache=paged"
    [ -d "$d" ] || "$PY" scripts/make_synthetic_checkpoint.py qwen3-30b-a3b "$d" --random-weights || return 1
    if [ "${MOE_SINGLE:-1}" = 1 ]; then
        "$PY" benchmarks/single_stream.py --model "$d" --device cuda --dtype bfloat16 --prompt-lens 128 \
            --output-len 128 --repeats 3 \
            --infer-configs "kv_cache=paged,moe_backend=torch;kv_cache=paged;kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true" \
            --out "$OUT/single_qwen3-30b-a3b.json" || rc=1
    fi
    # eager (the first config) takes over 6 minutes on an H200 for this workload: MOE_OFFLINE_CONFIGS=fast skips it
    local configs="$base;$base,fused_kernels=true,cuda_graphs=true,async_scheduling=true"
    [ "${MOE_OFFLINE_CONFIGS:-}" = fast ] && configs="$base,fused_kernels=true,cuda_graphs=true,async_scheduling=true"
    "$PY" benchmarks/offline_throughput.py --model "$d" --device cuda --dtype bfloat16 --max-model-len 2048 \
        --max-num-seqs 256 --max-num-batched-tokens 16384 --engines infer --infer-configs "$configs" \
        --no-progress --out "$OUT/offline_qwen3-30b-a3b.json" --plot "$OUT/offline_qwen3-30b-a3b.png" || rc=1
    return $rc
}

# Phases 14-15 (a 2-GPU machine, e.g. nvidia-h200-x2; not in the default list):
#   bash scripts/gpu_suite.sh env tp; bash scripts/gpu_suite.sh tp_bf16; bash scripts/gpu_suite.sh bench_parallel step_parallel
# tp: the 2-GPU tests (NCCL; fp32 tokens equal one GPU's, eager and with CUDA graphs) and the TP=2 / EP=2 parity gate (+ TP=2 with graphs) through the
# engine (fp32 exact, bf16 within gpu_parity's bounds). bench_parallel: batch-1 decode and offline
# throughput for TP=1 vs TP=2 (Qwen3-8B; PARALLEL_DENSE=qwen3-4b for another) and TP=1 / TP=2 / EP=2
# (Qwen3-30B-A3B, 4 layers), plus
# all-reduce / all-gather / all-to-all at decode sizes (docs/phases/14-tensor-parallelism.md).
section_tp() {
    local rc=0
    "$PY" -m pytest -q tests/test_parallel.py -k "${TP_TESTS:-two_gpus}" -p no:cacheprovider || rc=1
    "$PY" -m pytest -q tests/test_allreduce.py -p no:cacheprovider || rc=1
    "$PY" scripts/tp_parity.py --device cuda --dtype float32 --presets "${TP_FP32:-qwen3-0.6b,gemma3-1b,qwen3-30b-a3b-4l}" \
        --graphs --workdir "$CKPT/tp-fp32" --out "$OUT/tp_parity_fp32.json" || rc=1
    return $rc
}

# The bf16 parity gate at the multi-GPU issue's shapes (a separate section: ~5 minutes).
section_tp_bf16() {
    local rc=0
    # bf16 checkpoints are the ones bench_parallel writes (same preset, dtype and seed): shared
    "$PY" scripts/tp_parity.py --device cuda --dtype bfloat16 --presets "${TP_BF16:-qwen3-8b,qwen3-4b,qwen3-30b-a3b-4l}" \
        --graphs --workdir "$CKPT" --out "$OUT/tp_parity_bf16.json" || rc=1
    return $rc
}

section_bench_parallel() {
    local p dense=${PARALLEL_DENSE:-qwen3-8b}  # the multi-GPU issue's goal: Qwen3-8B TP=2 >= 1.5x TP=1
    for p in "$dense" qwen3-30b-a3b-4l; do
        [ -d "$CKPT/$p" ] || "$PY" scripts/make_synthetic_checkpoint.py "$p" "$CKPT/$p" || return 1
    done
    "$PY" benchmarks/parallel.py --device cuda --model "$CKPT/$dense" --moe-model "$CKPT/qwen3-30b-a3b-4l" \
        --decode-tokens 128 --decode-repeats 3 --requests 64 --prompt-len 256 --output-len 128 --max-num-seqs 64 \
        --batches 1,8,64,256 --flags "${PARALLEL_FLAGS:-fused_kernels=true,cuda_graphs=true}" --out "$OUT/parallel_gpu.json"
}

# Issue 55 (a 2- or 4-GPU machine): all-reduce latency per size, NCCL against symmetric memory's one-shot and
# two-shot, eager and in CUDA graphs (AR_RANKS=4 on a 4-GPU machine); then bench_parallel with
# PARALLEL_FLAGS=fused_kernels=true,cuda_graphs=true,all_reduce_backend=symm_mem,all2all_backend=fixed_capacity
section_bench_allreduce() {
    "$PY" benchmarks/allreduce.py --ranks "${AR_RANKS:-2}" --out "$OUT/allreduce.json"
}

# Where a batch-1 decode step's time goes with TP=2 against one GPU, both with CUDA graphs (rank 0's
# view: host phases, device busy time, top kernels; benchmarks/step_profile.py).
section_step_parallel() {
    local dense=${PARALLEL_DENSE:-qwen3-8b} base="batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true"
    [ -d "$CKPT/$dense" ] || "$PY" scripts/make_synthetic_checkpoint.py "$dense" "$CKPT/$dense" || return 1
    # two requests of 128 prompt and 512 output tokens, one at a time: every timed step is a batch-1
    # decode (--scale 0.01 alone gave outputs of a few tokens, so the window held prefills
    # and idle steps, and the profile saw no kernels)
    "$PY" benchmarks/step_profile.py --model "$CKPT/$dense" --device cuda --dtype bfloat16 --scale 0.01 \
        --num-requests 2 --min-len 128 --max-len 128 --min-output-len 512 --max-output-len 512 \
        --max-num-seqs 1 --skip 16 --steps 64 --profile-steps 8 --no-progress \
        --infer-configs "$base;$base,tensor_parallel_size=2" --out "$OUT/step_parallel.json"
}

section_bench_flags() {
    local preset rc=0 base="batching=continuous,kv_cache=paged"
    for preset in qwen3-0.6b qwen3-4b; do
        [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
    done
    "$PY" benchmarks/offline_throughput.py --model "$CKPT/qwen3-0.6b" --device cuda --dtype bfloat16 \
        --max-num-seqs 256 --max-num-batched-tokens 16384 --min-output-len 512 --max-output-len 512 --engines infer \
        --infer-configs "$base;$base,fused_kernels=true;$base,cuda_graphs=true;$base,async_scheduling=true;$base,fused_kernels=true,cuda_graphs=true,async_scheduling=true" \
        --no-progress --out "$OUT/offline512_qwen3-0.6b.json" --plot "$OUT/offline512_qwen3-0.6b.png" || rc=1
    for preset in qwen3-0.6b qwen3-4b; do
        "$PY" benchmarks/single_stream.py --model "$CKPT/$preset" --device cuda --dtype bfloat16 --prompt-lens 128 \
            --output-len 128 --repeats 3 --hf compiled \
            --infer-configs "kv_cache=paged;kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true" \
            --out "$OUT/flags_single_$preset.json" || rc=1
    done
    return "$rc"
}

# Phase 8: the bf16 parity gate with the fused forward and the Triton attention backend (the engine's
# forward with fused_kernels on; CUDA graphs replay that same forward).
section_parity_fused() {
    # shellcheck disable=SC2086
    "$PY" scripts/gpu_parity.py --workdir "$CKPT" --reuse --fused-kernels --attention-backend triton \
        --out "$OUT/parity_fused.json" ${PARITY_ARGS:-}
}

# Phases 8-9: the share of 256-token greedy continuations identical with every flag on vs all off (bf16).
section_greedy_agreement() {
    local preset=qwen3-0.6b base="batching=continuous,kv_cache=paged,max_num_seqs=64"
    [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
    "$PY" benchmarks/greedy_agreement.py --model "$CKPT/$preset" --device cuda --dtype bfloat16 --num-prompts 64 \
        --prompt-len 128 --output-len 256 --out "$OUT/greedy_agreement.json" \
        --infer-configs "$base;$base,fused_kernels=true;$base,fused_kernels=true,cuda_graphs=true,async_scheduling=true"
}

# Phases 8-9 on the full nano-vllm workload (256 requests, prompts and outputs uniform in [100, 1024]).
section_bench_flags_nano() {
    local preset=qwen3-0.6b base="batching=continuous,kv_cache=paged"
    [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
    "$PY" benchmarks/offline_throughput.py --model "$CKPT/$preset" --device cuda --dtype bfloat16 \
        --max-num-seqs 256 --max-num-batched-tokens 16384 --engines infer --no-progress \
        --infer-configs "$base;$base,fused_kernels=true,cuda_graphs=true,async_scheduling=true" \
        --out "$OUT/offline_nano_$preset.json"
}

# Phase 6 online: steady decode streams while 8,000-token prompts arrive, chunked prefill off and at
# budgets 512/2048/8192 (needs the server wheels in .whl/). CHUNK_PRESETS picks the models, CHUNK_BUDGETS the budgets
# (an entry BUDGET:CAP also sets long_prefill_token_threshold, e.g. "1024:512 2048:192"),
# CHUNK_SERVER_ARGS adds server flags (e.g. "--fused-kernels --cuda-graphs --async-scheduling"), CHUNK_WORKLOAD
# replaces the workload's lengths and timing (with every flag on, 0.6B's streams finish before 2 s).
section_bench_chunked() {
    local preset b rc=0
    local -a configs=()
    for b in ${CHUNK_BUDGETS:-512 2048 8192}; do
        if [[ "$b" == *:* ]]; then
            configs+=("c${b%%:*}-t${b##*:}=--chunked-prefill --max-num-batched-tokens ${b%%:*} --long-prefill-token-threshold ${b##*:}")
        else
            configs+=("c$b=--chunked-prefill --max-num-batched-tokens $b")
        fi
    done
    for preset in ${CHUNK_PRESETS:-qwen3-0.6b}; do
        [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
        # shellcheck disable=SC2086
        "$PY" benchmarks/serve_bench.py --launch --workload decode-interference --token-prompts --token-itl \
            --num-requests ${CHUNK_N:-64} ${CHUNK_WORKLOAD:---input-len 256 --output-len 512 --long-prompts 8 \
            --long-len 8000 --long-start-s 2 --long-interval-s 1} --no-progress \
            --server-args "--model $CKPT/$preset --device cuda --batching continuous --kv-cache paged \
                --max-model-len 16384 --max-num-seqs 128 ${CHUNK_SERVER_ARGS:-}" \
            --server-configs "off=" "${configs[@]}" \
            --out "$OUT/chunked_$preset.json" --plot "$OUT/chunked_$preset.png" || rc=1
    done
    return "$rc"
}

# The GPU tests of phases 7, 10, 13 and 15 only (a quicker subset of `tests`).
section_tests_new() {
    "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_prefix_caching.py tests/test_kv_offload.py \
        tests/test_structured.py tests/test_moe.py
}

# Phase 7: TTFT cold vs warm by prefix length, and the shared-prefix / multi-turn / no-sharing workloads with
# the cache off and on, Qwen3-4B shapes, in one process (benchmarks/prefix_caching.py). PREFIX_CONFIGS: one
# run per entry, NAME=FIELD=VALUE,FIELD=VALUE (EngineConfig overrides; "eager=" for none), reports NAME.*;
# PREFIX_WORKLOADS="" skips part 2.
section_bench_prefix() {
    local preset=qwen3-4b entry name args rc=0
    [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
    for entry in ${PREFIX_CONFIGS:-eager=}; do
        name=${entry%%=*}
        args=${entry#*=}
        # shellcheck disable=SC2086
        "$PY" benchmarks/prefix_caching.py --model "$CKPT/$preset" --device cuda --max-model-len 8192 --max-num-seqs 64 \
            --prefix-lens ${PREFIX_LENS:-1024 2048 4096} --repeats 3 --suffix-len 64 --workload-prefix-len 4096 \
            --workloads ${PREFIX_WORKLOADS-shared-prefix multi-turn random} \
            --num-requests ${PREFIX_N:-64} --turns 4 --output-len 128 --request-rate 8 \
            --engine-args ${args//,/ } \
            --out "$OUT/prefix/$name.json" --plot "$OUT/prefix/$name.png" || rc=1
    done
    return "$rc"
}

# Phase 13: constrained vs unconstrained decode at batch 1 and 32, eager and with the phase 8-9 flags
# (needs outlines-core carried in .whl/), Qwen3-0.6B shapes (a byte-level BPE of 151,936 ids).
section_bench_structured() {
    local preset=qwen3-0.6b rc=0
    [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
    "$PY" benchmarks/structured_output.py --model "$CKPT/$preset" --device cuda --dtype bfloat16 \
        --out "$OUT/structured/structured.json" || rc=1
    "$PY" benchmarks/structured_output.py --model "$CKPT/$preset" --device cuda --dtype bfloat16 \
        --attention-backend triton --fused-kernels --cuda-graphs --async-scheduling \
        --out "$OUT/structured-fast/structured.json" || rc=1
    return "$rc"
}

# Phase 10: copy bandwidths, 8k/16k prefixes restored from the host tier vs recomputed, and a multi-turn
# workload larger than the KV pool, offload none vs host (Qwen3-4B shapes; ~34 GB of pinned host memory).
# OFFLOAD_ENGINE_ARGS: EngineConfig overrides, FIELD=VALUE separated by spaces.
section_bench_offload() {
    local preset=qwen3-4b
    [ -d "$CKPT/$preset" ] || "$PY" scripts/make_synthetic_checkpoint.py "$preset" "$CKPT/$preset" || return 1
    # shellcheck disable=SC2086
    "$PY" benchmarks/kv_offload.py --device cuda --model "$CKPT/$preset" --shapes qwen3-4b \
        --prefix-lens ${OFFLOAD_LENS:-1024 4096 8192 16384} --tier host --repeats 3 --max-num-seqs 32 \
        --kv-offload-bytes 32000000000 --multi-turn --conversations ${OFFLOAD_CONV:-32} --turns 4 --system-len 2048 \
        --turn-len 256 --output-len 64 --multi-turn-kv-cache-memory-bytes 4000000000 \
        --engine-args ${OFFLOAD_ENGINE_ARGS:-} --out "$OUT/offload"
}

# ----------------------------------------------------------------------------- driver

# One section in a subshell. With SECTION_TIMEOUT=<seconds> (or SECTION_TIMEOUT_<name>), a section
# still running then gets SIGABRT, which makes every Python process of it print its threads' stacks
# (PYTHONFAULTHANDLER) before it dies: a hang (an NCCL collective, a worker waiting) shows where it is,
# and the sections after it still run. Exit 124 when the limit was reached (137 when the section also
# ignored SIGABRT and was killed 20 s later).
run_section() {
    local name=$1 limit_var="SECTION_TIMEOUT_$1"
    local limit=${!limit_var:-${SECTION_TIMEOUT:-}}
    if [ -z "$limit" ]; then
        ( "section_$name" ) 2>&1
        return $?
    fi
    export PY OUT CKPT PYTHONFAULTHANDLER=1
    export -f $(declare -F | awk '{print $3}')
    timeout -s ABRT -k 20 "$limit" bash -c "section_$name" 2>&1
    local rc=$?
    # timeout's own statuses only: a section that aborted by itself (134) did not reach the limit
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "=== $name: stopped after ${limit}s (SECTION_TIMEOUT)"
    fi
    return $rc
}

run_all() {
    if [ -z "${INFER_COMMIT:-}" ]; then
        # the GPU machine's copy of the working tree may carry a stale .git: the reports would name
        # an old commit. Call the suite as INFER_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_suite.sh
        echo "WARNING: INFER_COMMIT is not set; reports will name $(git rev-parse --short HEAD 2>/dev/null || echo 'no') commit"
    fi
    local -a summary=()
    local failed=0 suite_start name start rc secs
    suite_start=$(date +%s)
    setup_python_path
    for name in "${SECTIONS[@]}"; do
        if [[ " ${SUITE_SKIP:-} " == *" $name "* ]]; then
            summary+=("$name skip 0")
            continue
        fi
        if ! declare -F "section_$name" >/dev/null; then
            echo "unknown section: $name (known: $(declare -F | sed -n 's/^declare -f section_//p' | tr '\n' ' '))"
            summary+=("$name unknown 0")
            failed=1
            continue
        fi
        echo
        echo "=================================================================== $name"
        start=$(date +%s)
        run_section "$name"
        rc=$?
        secs=$(( $(date +%s) - start ))
        echo "=== $name: exit $rc in ${secs}s"
        summary+=("$name $rc $secs")
        [ "$rc" -ne 0 ] && failed=1
    done

    local total=$(( $(date +%s) - suite_start ))
    echo
    {
        echo "section exit seconds"
        printf '%s\n' "${summary[@]}"
        echo "total $failed $total"
    } | { if command -v column >/dev/null; then column -t; else cat; fi; }
    {
        echo "{\"failed\": $failed, \"seconds\": $total, \"sections\": ["
        local sep="" s n r t
        for s in "${summary[@]}"; do
            read -r n r t <<<"$s"
            [[ "$r" =~ ^[0-9]+$ ]] || r="\"$r\""
            printf '%s{"name": "%s", "exit": %s, "seconds": %s}' "$sep" "$n" "$r" "$t"
            sep=", "
        done
        echo "]}"
    } >"$OUT/summary.json"
    return "$failed"
}

pack_if_needed() {
    local n
    n=$(find "$OUT" -type f | wc -l)
    if [ "$n" -gt "$MAX_OUT_FILES" ]; then
        echo "$n files in \$OUT > $MAX_OUT_FILES: packing all but suite.log and summary.json into reports.tar.gz"
        (cd "$OUT" && find . -type f ! -name suite.log ! -name summary.json ! -name reports.tar.gz -print0 \
            | tar --null -czf reports.tar.gz --remove-files -T -)
    fi
}

if [ "$#" -gt 0 ]; then
    SECTIONS=("$@")
fi
run_all 2>&1 | tee "$OUT/suite.log"
status=${PIPESTATUS[0]}
pack_if_needed 2>&1 | tee -a "$OUT/suite.log"
exit "$status"
