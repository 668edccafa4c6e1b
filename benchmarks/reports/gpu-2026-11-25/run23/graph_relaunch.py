"""GPU run 23, call 4: does launching a CUDA graph block the host while the same graph still runs?

One graph of ~5 ms of matmuls is captured twice (two graph execs, A and B). Each case: the device
is idle, then three launches without synchronizing; the host time of each launch is printed
(medians of 20). If relaunching an exec that is still executing waited for it, ``A, A`` would
show ~5 ms on its second launch and ``A, B`` would not.
"""

import statistics
import time

import torch

x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)


def work():
    y = x
    for _ in range(8):
        y = y @ x
    return y


graphs = []
for _ in range(2):
    work()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        work()
    graphs.append(g)
a, b = graphs
torch.cuda.synchronize()
t = time.perf_counter()
a.replay()
torch.cuda.synchronize()
print(f"one replay, device time: {1e3 * (time.perf_counter() - t):.2f} ms")
for name, seq in (("A, A, A", (a, a, a)), ("A, B, A", (a, b, a))):
    times = [[], [], []]
    for _ in range(20):
        torch.cuda.synchronize()
        for i, g in enumerate(seq):
            t = time.perf_counter()
            g.replay()
            times[i].append(time.perf_counter() - t)
    torch.cuda.synchronize()
    print(name, "host ms per launch:", " ".join(f"{1e3 * statistics.median(ts):.3f}" for ts in times))
