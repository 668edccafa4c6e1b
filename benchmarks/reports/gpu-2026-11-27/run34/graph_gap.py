"""GPU run 34: how much of a batch-1 decode step is outside its CUDA graph.

Measures, in one process on one engine (every phase 8-9 flag + pdl): the engine's TPOT (single_stream's
bench_infer), then the batch-1 graph replayed back to back (no host work, no copies, no sampler), then the
graph + the greedy sampler, each timed with CUDA events over many replays. The difference between the
step and the replay is what the step spends outside the graph (input copies, the placeholder patch, the
block-table copy, sampling, the token's copy to the host, the gaps between them).
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
from single_stream import bench_infer, random_prompt  # noqa: E402

from infer.llm import LLM  # noqa: E402

model = sys.argv[1]
flags = dict(batching="continuous", kv_cache="paged", fused_kernels=True, cuda_graphs=True, async_scheduling=True,
             pdl=True)
llm = LLM(model, device="cuda", dtype="bfloat16", progress=False, max_model_len=300, **flags)
prompt = random_prompt(llm.engine.loaded.config.vocab_size, 128, 0)
r = bench_infer(llm, prompt, 128, 3)
runner = llm.engine.runner
g = runner.graphs
graph = g.graphs[1]


def timed(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n



replay = timed(graph.replay)
logits = g.logits[1][:1]


def replay_argmax():
    graph.replay()
    torch.argmax(logits, dim=-1)


ra = timed(replay_argmax)
print(f"{model}: engine tpot {r['tpot_ms']:.3f} ms; graph replay alone {replay:.3f} ms; replay + torch.argmax {ra:.3f} ms;"
      f" outside the graph {r['tpot_ms'] - replay:.3f} ms", flush=True)
