"""Run 27 call 7: each kernel's share of a batch-1 decode step's critical path, from an nsys GPU trace (CSV of
`nsys stats --report cuda_gpu_trace`, CUDA graphs traced per node). With PDL a kernel starts before the one before
it ends, so its duration includes its wait; what it adds to the step is the time between the previous kernel's
end and its own (the "end delta"). Per kernel name over the steady decode steps: calls, mean end delta (us), mean
duration (us), and their sums; kernels of one name are told apart by grid and block size."""
import csv
import sys
from collections import defaultdict

rows = list(csv.DictReader(open(sys.argv[1])))
key = {k.split(" (")[0]: k for k in rows[0]}
start, dur, name = key["Start"], key["Duration"], key["Name"]
grid = [key[k] for k in ("GrdX", "GrdY", "GrdZ", "BlkX") if k in key]  # tells the projections apart


def label(r):
    return r[name][:40] + ("" if not grid else " " + "x".join(r[g] for g in grid))


ks = sorted(((int(r[start]), int(r[dur]), label(r)) for r in rows if not r[name].startswith("[CUDA")),
            key=lambda t: t[0])
ends = [s + d for s, d, _ in ks]
# the steady region: the last 40% of the kernels (decode steps inside graphs, after the prefill and warm-up)
first = int(len(ks) * 0.6)
stats = defaultdict(lambda: [0, 0.0, 0.0])
prev_end = max(ends[:first])
for (_, d, n), e in zip(ks[first:], ends[first:]):
    st = stats[n]
    st[0] += 1
    st[1] += max(0, e - prev_end) / 1e3
    st[2] += d / 1e3
    prev_end = max(prev_end, e)
span = (max(ends[first:]) - ks[first][0]) / 1e3
print(f"kernels {len(ks) - first}, span {span:.0f} us")
print("| kernel | calls | end delta, us per call | duration, us per call | end delta, us in all |")
print("|---|---|---|---|---|")
for n, (c, delta, d) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
    print(f"| {n} | {c} | {delta / c:.2f} | {d / c:.2f} | {delta:.0f} |")
