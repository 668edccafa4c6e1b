"""GPU run 36: what the host side of a batch-1 decode step adds on the device. Times, in one process:
(1) the engine's TPOT as single_stream.py measures it (generate_stream, 128 tokens); (2) the bucket-1 decode graph
replayed back to back (the forward and LM head alone); (3) the graph + the greedy sampler's two kernels; (4) (3) +
the token's copy to pinned memory + the next step's input copy from pinned memory, as the engine orders them.
Also checks that a Triton kernel can read a pinned host tensor directly (UVA, no cudaMemcpy).

usage: graph_only.py MODEL_DIR [EngineConfig overrides as k=v,...]"""
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from offline_throughput import parse_infer_configs  # noqa: E402

from infer.llm import LLM  # noqa: E402
from infer.sampling import SamplingParams  # noqa: E402
from infer.sampling.triton_sampler import argmax_logprob  # noqa: E402


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


host = torch.arange(1, 65, dtype=torch.int64).pin_memory()
dev = torch.zeros(64, dtype=torch.int64, device="cuda")
try:
    _copy[(1,)](host, dev, 64, BLOCK=64)
    torch.cuda.synchronize()
    print("UVA read of pinned memory by a Triton kernel:", "OK" if torch.equal(dev.cpu(), host) else "WRONG VALUES")
    host[:] = 7
    _copy[(1,)](host, dev, 64, BLOCK=64)
    _copy[(1,)](dev * 2, host, 64, BLOCK=64)  # and a write into pinned memory
    torch.cuda.synchronize()
    print("after a host write, and a kernel's write to pinned memory:", dev[:3].tolist(), host[:3].tolist())
except Exception as e:  # noqa: BLE001
    print("UVA read failed:", type(e).__name__, str(e)[:200])

model = sys.argv[1]
ov = parse_infer_configs(sys.argv[2])[0] if len(sys.argv) > 2 else {}
llm = LLM(model, device="cuda", dtype="bfloat16", progress=False, max_model_len=264, **ov)
prompt = list(range(1000, 1128))
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
tpots = []
for _ in range(4):
    torch.cuda.synchronize()
    first = None
    for out in llm.generate_stream(prompt, params):
        if first is None and out.outputs[0].delta_token_ids:
            first = time.perf_counter()
    tpots.append((time.perf_counter() - first) / 127 * 1e3)
print(f"engine TPOT: {statistics.median(tpots[1:]):.4f} ms ({', '.join(f'{t:.4f}' for t in tpots[1:])})")

runner = llm.engine.runner.graphs
graph, logits = runner.graphs[1], runner.logits[1]
pinned_tok = torch.empty(1, dtype=torch.int64, pin_memory=True)
pinned_in = runner.packed.cpu().pin_memory()  # the last step's inputs: the same attention work every replay
n_in = int(runner.packed.shape[0])


def loop(kind: str, n: int = 200) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        torch.cuda.synchronize()
        s.record()
        for _ in range(n):
            if kind != "graph":
                runner.packed[:8].copy_(pinned_in[:8], non_blocking=True) if kind == "memcpy" else None
            graph.replay()
            if kind != "graph":
                tok, _, lp = argmax_logprob(logits)
                if kind == "memcpy":
                    pinned_tok.copy_(tok, non_blocking=True)
        e.record()
        torch.cuda.synchronize()
    return s.elapsed_time(e) / n


for kind in ("graph", "sampler", "memcpy", "graph", "sampler", "memcpy"):
    print(f"{kind}: {loop(kind) * 1e3:.1f} us per step")
