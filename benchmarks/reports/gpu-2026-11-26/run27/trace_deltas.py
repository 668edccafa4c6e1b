"""Run 27 call 7b: each kernel's share of a batch-1 decode step's critical path, from torch.profiler's device events
(CUPTI; a CUDA graph's kernels one by one) during benchmarks/step_profile.py's profiled steps. With PDL a kernel
starts before the one before it ends, so its duration includes its wait; what it adds to the step is the time from
the previous kernel's end to its own (the "end delta"). Per kernel (the skinny GEMMs told apart by their place in a
layer): calls, mean end delta and duration (us). Runs step_profile.py's main with its arguments."""
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import step_profile  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

table = step_profile._kernel_table


def deltas(prof, device_type, top):
    ev = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith(("ProfilerStep", "Memset"))]
    ev.sort(key=lambda e: e.time_range.start)
    stats = defaultdict(lambda: [0, 0.0, 0.0])
    prev_end = None
    run = 0  # skinny GEMMs in a row: o, gate/up, down, then the next layer's QKV (or the LM head, > 100 us)
    for e in ev:
        s, t = e.time_range.start, e.time_range.end
        name = e.name[:40]
        run = run + 1 if name.startswith("_skinny") else 0
        if run:
            name += " " + ("lm_head" if t - s > 100 else ("o", "gate_up", "down", "qkv")[min(run, 4) - 1])
        if prev_end is not None:
            st = stats[name]
            st[0] += 1
            st[1] += max(0.0, t - prev_end)
            st[2] += t - s
        prev_end = t if prev_end is None else max(prev_end, t)
    total = sum(st[1] for st in stats.values())
    print(f"\nend deltas over {len(ev)} device events, {total:.0f} us in all")
    print("| kernel | calls | end delta, us per call | duration, us per call | end delta, us in all |\n|---|---|---|---|---|")
    for n, (c, d, dur) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"| {n} | {c} | {d / c:.2f} | {dur / c:.2f} | {d:.0f} |")
    return table(prof, device_type, top)


step_profile._kernel_table = deltas
sys.exit(step_profile.main())
