"""GPU run 25: the host pieces of a steady 256-sequence decode step (every flag), one by one.

Not a product benchmark: a one-off breakdown on the host of the GPU machine. The engine runs the
offline workload (Qwen3-0.6B shapes, every flag, temperature 0.6) into its steady decode batch; one
step's ``scheduled`` list and previous result are kept, and each piece of ``ModelRunner.execute``'s
host part is timed on them in a loop (the device synchronized before each call; medians of 200):
staging (``stage_decodes``), the placeholders' patch, the graph's launch, the sampler's launch, the
start of the tokens' copy, a rebuild of the sampling tensors; and, to calibrate the host, one
small PyTorch op and one empty Triton kernel.

    python benchmarks/reports/gpu-2026-11-25/run25/host_parts.py MODEL_DIR
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch
import triton

sys.path.insert(0, "benchmarks")
import offline_throughput as ot  # noqa: E402

from infer import SamplingParams  # noqa: E402
from infer.engine import model_runner as mr  # noqa: E402
from infer.engine.cuda_graphs import bucket_for, stage_decodes  # noqa: E402
from infer.engine.model_runner import BlockTableRows  # noqa: E402


@triton.jit
def _noop(x_ptr, n):
    pass


def timeit(fn, reps: int = 200) -> float:
    """Median microseconds of ``fn()``, the device idle before each call."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def main() -> None:
    model = sys.argv[1]
    wl = ot.build_workload(256, 100, 1024, 151936, 0, 512, 512)
    llm = ot.make_llm(model, dict(batching="continuous", kv_cache="paged", fused_kernels=True, async_scheduling=True,
                                  cuda_graphs=True, device="cuda", dtype="bfloat16", max_num_seqs=256,
                                  max_num_batched_tokens=16384), wl, progress=False)
    engine, runner = llm.engine, llm.engine.runner
    for p, o in zip(wl.prompts, wl.output_lens):
        engine.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.6))
    for _ in range(40):  # prefills, then decodes
        engine.step(stream=False)
    execute = runner.execute
    done = []

    def keep(scheduled, eos_ids, prev=None):
        if not done:
            done.append(1)
            measure(runner, scheduled, eos_ids, prev)
        return execute(scheduled, eos_ids, prev)

    runner.execute = keep
    engine.step(stream=False)


@torch.inference_mode()
def measure(runner, scheduled, eos_ids, prev) -> None:
    b = len(scheduled)
    assert all(item.num_tokens == 1 for item in scheduled), "not a decode-only step"
    graphs = runner.graphs
    bs = bucket_for(b, graphs.sizes)
    seqs = [item.seq for item in scheduled]
    width = max(len(s.block_table) for s in seqs)
    h = np.zeros(4 * bs + b * width, dtype=np.int64)
    kept = BlockTableRows(2 * bs + 2, width)
    bsz = runner.kv_cache.block_size
    tensors = runner._build_sampling_tensors(seqs, eos_ids, True)
    greedy = mr.SamplingTensors.from_params([SamplingParams(temperature=0.0)] * b, None, None, None, None, None,
                                            runner.vocab_size, "cuda")
    logits = graphs.logits[bs][:b]
    x = torch.zeros(8, device="cuda")
    result = mr.StepResult(seqs, mr.sample(logits, tensors), {})

    def copy_start():
        result._host = None
        result.start_copy_to_host()

    rows = {
        "calibration: one small PyTorch op (x.add_(1))": timeit(lambda: x.add_(1)),
        "calibration: one empty Triton kernel": timeit(lambda: _noop[(1,)](x, 8)),
        "calibration: torch.empty(256) on the device": timeit(lambda: torch.empty(256, device="cuda")),
        "stage_decodes (kept table rows)": timeit(lambda: stage_decodes(seqs, kept, bsz, h, bs)),
        "_patch (async placeholders)": timeit(lambda: runner._patch(scheduled, range(b + 1), prev)),
        "graph launch (run_packed: table copy + replay)": timeit(lambda: graphs.run_packed(b, bs, width)),
        "graph launch (replay alone)": timeit(lambda: graphs.graphs[bs].replay()),
        "sampler launch, temperature 0.6": timeit(lambda: mr.sample(logits, tensors)),
        "sampler launch, greedy": timeit(lambda: mr.sample(logits, greedy)),
        "start_copy_to_host": timeit(copy_start),
        "sampling tensors rebuilt (stateless)": timeit(lambda: runner._build_sampling_tensors(seqs, eos_ids, True)),
        "sampling tensors reused (steps += 1)": timeit(lambda: tensors.steps.add_(1)),
    }
    print(f"{b} sequences, bucket {bs}, table width {width}\n\n| piece | us |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")


if __name__ == "__main__":
    main()
