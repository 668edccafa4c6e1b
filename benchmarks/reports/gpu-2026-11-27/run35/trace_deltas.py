"""GPU run 35: each kernel's share of a batch-1 decode step's critical path, from torch.profiler's device events
(run 27's trace_deltas.py, with each kernel named by its place in the layer as the engine now runs it: after the
decode attention come o (+ residual), the norm, gate/up + SiLU, down (+ residual), the next layer's norm, QKV, the
QK norm + RoPE). With PDL a kernel starts before the one before it ends, so its duration includes its wait; what it
adds to the step is the time from the previous kernel's end to its own (the "end delta"). Runs step_profile.py's
main with its arguments."""
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import step_profile  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

table = step_profile._kernel_table
AFTER_ATTENTION = ("o", "norm", "gate_up", "down", "norm", "qkv")


def deltas(prof, device_type, top):
    ev = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith(("ProfilerStep", "Memset"))]
    ev.sort(key=lambda e: e.time_range.start)
    stats = defaultdict(lambda: [0, 0.0, 0.0])
    prev_end = None
    place = None  # kernels since the last decode attention
    for e in ev:
        s, t = e.time_range.start, e.time_range.end
        name = e.name[:40]
        if name.startswith("_paged_decode"):
            place = 0
        elif place is not None and (name.startswith("_skinny") or "norm" in name) and "qk_norm" not in name:
            name += " " + ("lm_head" if t - s > 100 else AFTER_ATTENTION[place] if place < 6 else "?")
            place += 1
        if prev_end is not None:
            st = stats[name]
            st[0] += 1
            st[1] += max(0.0, t - prev_end)
            st[2] += t - s
        prev_end = t if prev_end is None else max(prev_end, t)
    steps = sum(1 for e in ev if e.name.startswith("_skinny") and e.time_range.end - e.time_range.start > 100)
    total = sum(st[1] for st in stats.values())
    print(f"\nend deltas over {len(ev)} device events ({steps} steps), {total:.0f} us in all, {total / max(steps, 1):.0f} per step")
    print("| kernel | calls | end delta, us per call | duration, us per call | end delta, us per step |\n|---|---|---|---|---|")
    for n, (c, d, dur) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"| {n} | {c} | {d / c:.2f} | {dur / c:.2f} | {d / max(steps, 1):.1f} |")
    return table(prof, device_type, top)


step_profile._kernel_table = deltas
sys.exit(step_profile.main())
