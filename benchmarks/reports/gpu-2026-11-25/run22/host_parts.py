"""GPU run 22, call 10: where the host part of a 256-sequence decode step goes, piece by piece.

Not a product benchmark: a one-off breakdown of ``ModelRunner.execute``'s host work on the decode
path with CUDA graphs (what ``step_profile.py`` reports as ``execute_host_ms``), without cProfile's
per-call overhead. The engine runs the offline workload into its steady decode batch; one step's
``scheduled`` list is kept, and each piece of the host path is then timed on it in a loop (the
device synchronized before each timing, the medians of 200 calls reported).

    python benchmarks/reports/gpu-2026-11-25/run22/host_parts.py MODEL_DIR [SRC_LABEL]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import offline_throughput as ot  # noqa: E402

from infer import SamplingParams  # noqa: E402

CUDA = torch.cuda.is_available()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timeit(fn, reps: int = 200) -> float:
    """Median microseconds of ``fn()`` over ``reps`` calls, the device idle before each (NaN if it raised)."""
    times = []
    try:
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        sync()
    except Exception as e:  # one broken piece must not hide the others
        print(f"  failed: {type(e).__name__}: {e}")
        return float("nan")
    return 1e6 * statistics.median(times)


def main() -> None:
    model = sys.argv[1]
    wl = ot.build_workload(256, 100, 1024, 151936, 0, 512, 512)
    if not CUDA:  # a dry run of this script's Python on the CPU (smollm2, no graphs), small
        wl = ot.build_workload(64, 16, 32, 49152, 0, 64, 64)
    gpu = dict(device="cuda", dtype="bfloat16", cuda_graphs=True) if CUDA else dict(device="cpu", dtype="float32")
    llm = ot.make_llm(model, dict(batching="continuous", kv_cache="paged", fused_kernels=True, async_scheduling=True,
                                  max_num_seqs=256, max_num_batched_tokens=16384, **gpu), wl, progress=False)
    engine, runner = llm.engine, llm.engine.runner
    for p, o in zip(wl.prompts, wl.output_lens):
        engine.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.6))
    for _ in range(40 if CUDA else 8):  # prefills, then decodes
        engine.step(stream=False)
    execute = runner.execute
    done = []

    def keep(scheduled, eos_ids, prev=None):  # time the pieces on this step's state, then run it
        if not done:
            done.append(1)
            measure(runner, execute, scheduled, eos_ids, prev)
        return execute(scheduled, eos_ids, prev)

    runner.execute = keep
    engine.step(stream=False)
    del runner.execute


@torch.inference_mode()
def measure(runner, execute, scheduled, eos_ids, prev) -> None:
    scheduled = sorted(scheduled, key=lambda item: item.num_tokens != 1)
    print(f"steady step: {len(scheduled)} sequences, {sum(s.num_tokens for s in scheduled)} tokens")
    from infer.engine.model_runner import block_table_array

    ids, positions, starts, seq_lens, tables, firsts, sample_at, sampled = runner._flatten(scheduled)
    slots = runner.kv_cache.slot_mapping(tables, firsts, [s.num_tokens for s in scheduled])
    g = runner.graphs
    width = max(len(t) for t in tables)
    from infer.engine.sequence import PLACEHOLDER

    ids = [0 if t == PLACEHOLDER else t for t in ids]  # (replayed without the previous step's tokens)
    b = len(ids)
    if g is not None:
        from infer.engine.cuda_graphs import bucket_for

        bs = bucket_for(b, g.sizes)
    else:
        bs = 256

    rows = {}
    rows["_flatten"] = timeit(lambda: runner._flatten(scheduled))
    rows["slot_mapping"] = timeit(lambda: runner.kv_cache.slot_mapping(tables, firsts, [s.num_tokens for s in scheduled]))
    if prev is not None and prev.sampler_output is not None:
        rows["_placeholders"] = timeit(lambda: runner._placeholders(scheduled, starts, prev))
    rows["max table width"] = timeit(lambda: max(len(t) for t in tables))
    h = g._staging[0].numpy() if g is not None else __import__("numpy").zeros(1 << 20, dtype="int64")
    rows["block_table_array (into staging)"] = timeit(
        lambda: block_table_array(tables, width, h[4 * bs: 4 * bs + len(tables) * width].reshape(len(tables), width)))

    try:
        from infer.engine.model_runner import BlockTableRows

        kept = BlockTableRows(2 * (bs + 1), max(128, width))
        out = h[4 * bs: 4 * bs + len(tables) * width].reshape(len(tables), width)
        rows["BlockTableRows.gather (kept rows, steady)"] = timeit(lambda: kept.gather(tables, width, out))
    except ImportError:
        pass

    def stage_lists():
        for k, (values, pad) in enumerate(((ids, 0), (positions, 0), (slots, -1), (seq_lens, 0))):
            h[k * bs: k * bs + b] = values
            h[k * bs + b: (k + 1) * bs] = pad

    rows["staging 4 lists"] = timeit(stage_lists)
    rows["sorted(scheduled) (execute's first line)"] = timeit(lambda: sorted(scheduled, key=lambda item: item.num_tokens != 1))
    if g is None:
        print("\n".join(f"{k}: {v:.1f} us" for k, v in rows.items()))
        rows["execute (whole, host part)"] = timeit(lambda: execute(scheduled, eos_ids, prev), 20)
        print(rows["execute (whole, host part)"])
        return
    rows["graphs.replay (whole)"] = timeit(lambda: g.replay(ids, positions, slots, seq_lens, tables, None))
    from infer.engine.cuda_graphs import packed_size

    n = packed_size(b, bs, width)
    packed = g.packed[:n]
    rows["H2D copy of the packed step"] = timeit(lambda: packed.copy_(g._staging[0][:n], non_blocking=True))
    rows["run_packed (3 copies + replay)"] = timeit(lambda: g.run_packed(b, bs, width, packed))
    rows["graph replay alone"] = timeit(lambda: g.graphs[bs].replay())
    logits = g.logits[bs][:b]
    tensors = runner._sampling_tensors(sampled, eos_ids)
    from infer.sampling import sample

    rows["_sampling_tensors (reused)"] = timeit(lambda: runner._sampling_tensors(sampled, eos_ids))
    rows["_build_sampling_tensors (a rebuild)"] = timeit(lambda: runner._build_sampling_tensors(sampled, eos_ids), 50)
    rows["sample (launch)"] = timeit(lambda: sample(logits, tensors))
    out = sample(logits, tensors)
    rows["_result (copy to host started)"] = timeit(lambda: runner._result(sampled, out, {}))
    rows["execute (whole, host part)"] = timeit(lambda: execute(scheduled, eos_ids, prev))
    label = sys.argv[2] if len(sys.argv) > 2 else "src"
    print(f"bucket {bs}, table width {width}")
    print(f"| piece ({label}) | us |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")


if __name__ == "__main__":
    main()
