"""GPU run 23: the host pieces of a 256-sequence decode step that changed, old way against new, on one step.

Not a product benchmark: a one-off comparison on the host of the GPU machine. The engine runs the
offline workload (Qwen3-0.6B shapes, every flag) into its steady decode batch; one step's
``scheduled`` list is kept and each piece is timed on it in a loop (the device synchronized before
each call, medians of 300 calls):

* the general path's inputs (``sorted``, ``_flatten``, ``slot_mapping``, the four lists written into
  the staging buffer, the kept block-table rows) against ``stage_decodes`` (the decode graphs' path);
* a rebuild of the sampling tensors, the general way against the stateless one.

    python benchmarks/reports/gpu-2026-11-25/run23/host_parts.py MODEL_DIR
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
import offline_throughput as ot  # noqa: E402

from infer import SamplingParams  # noqa: E402
from infer.engine.cuda_graphs import bucket_for, stage_decodes  # noqa: E402
from infer.engine.model_runner import BlockTableRows  # noqa: E402

CUDA = torch.cuda.is_available()


def timeit(fn, reps: int = 300) -> float:
    """Median microseconds of ``fn()``, the device idle before each call."""
    times = []
    for _ in range(reps):
        if CUDA:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def main() -> None:
    model = sys.argv[1]
    vocab = 151936 if CUDA else 49152
    wl = ot.build_workload(256, 100, 1024, vocab, 0, 512, 512)
    dev = dict(device="cuda", dtype="bfloat16", cuda_graphs=True) if CUDA else dict(device="cpu", dtype="float32")
    llm = ot.make_llm(model, dict(batching="continuous", kv_cache="paged", fused_kernels=True, async_scheduling=True,
                                  max_num_seqs=256, max_num_batched_tokens=16384, **dev), wl, progress=False)
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
            measure(runner, scheduled, eos_ids)
        return execute(scheduled, eos_ids, prev)

    runner.execute = keep
    engine.step(stream=False)


@torch.inference_mode()
def measure(runner, scheduled, eos_ids) -> None:
    b = len(scheduled)
    assert all(item.num_tokens == 1 for item in scheduled), "not a decode-only step"
    bs = bucket_for(b, [8 * k for k in range(1, 33)])
    seqs = [item.seq for item in scheduled]
    width = max(len(s.block_table) for s in seqs)
    h = np.zeros(4 * bs + b * width, dtype=np.int64)
    kept_old, kept_new = BlockTableRows(2 * bs + 2, width), BlockTableRows(2 * bs + 2, width)
    bsz = runner.kv_cache.block_size

    def general():
        sched = sorted(scheduled, key=lambda item: item.num_tokens != 1)
        ids, positions, starts, seq_lens, tables, firsts, sample_at, sampled = runner._flatten(sched)
        slots = runner.kv_cache.slot_mapping(tables, firsts, [s.num_tokens for s in sched])
        for k, (values, pad) in enumerate(((ids, 0), (positions, 0), (slots, -1), (seq_lens, 0))):
            h[k * bs: k * bs + b] = values
            h[k * bs + b: (k + 1) * bs] = pad
        kept_old.gather(tables, width, h[4 * bs:].reshape(b, width))

    rows = {
        "inputs, general path (sort, _flatten, slot_mapping, 4 lists, kept table rows)": timeit(general),
        "inputs, stage_decodes": timeit(lambda: stage_decodes(seqs, kept_new, bsz, h, bs)),
        "sampling tensors rebuilt, general": timeit(lambda: runner._build_sampling_tensors(seqs, eos_ids), 100),
        "sampling tensors rebuilt, stateless": timeit(lambda: runner._build_sampling_tensors(seqs, eos_ids, True), 100),
    }
    print(f"{b} sequences, bucket {bs}, table width {width}\n\n| piece | us |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")


if __name__ == "__main__":
    main()
