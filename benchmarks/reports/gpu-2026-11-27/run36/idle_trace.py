"""GPU run 36: where the device idles in single_stream.py's own loop (generate_stream, batch 1, no per-step
synchronization, unlike step_profile.py). Profiles one 128-token generation after a warm-up one and reports the
device's idle time between decode steps: the gaps no device event covers (kernels overlap under PDL, so the union
of their intervals is what counts), the largest ones named by the events on either side.

usage: idle_trace.py MODEL_DIR [EngineConfig overrides as k=v,...]"""
import sys
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
from offline_throughput import parse_infer_configs  # noqa: E402

from infer.llm import LLM  # noqa: E402
from infer.sampling import SamplingParams  # noqa: E402

model = sys.argv[1]
ov = parse_infer_configs(sys.argv[2])[0] if len(sys.argv) > 2 else {}
llm = LLM(model, device="cuda", dtype="bfloat16", progress=False, max_model_len=264, **ov)
prompt = list(range(1000, 1128))
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
for _ in range(2):
    list(llm.generate_stream(prompt, params))
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    list(llm.generate_stream(prompt, params))
    torch.cuda.synchronize()
ev = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith("ProfilerStep")]
ev.sort(key=lambda e: e.time_range.start)
lm_heads = [e for e in ev if e.name.startswith("_skinny") and e.time_range.end - e.time_range.start > 100]
# decode steps 10 .. last-10: from the end of LM head i to the end of LM head i + 1
first, last = lm_heads[10].time_range.end, lm_heads[-10].time_range.end
steps = len(lm_heads) - 20
busy_end, idle, gaps = None, 0.0, defaultdict(lambda: [0, 0.0])
prev_name = None
for e in ev:
    s, t = e.time_range.start, e.time_range.end
    if t <= first or s >= last:
        prev_name = e.name[:36]
        busy_end = t if busy_end is None else max(busy_end, t)
        continue
    if busy_end is not None and s > busy_end:
        key = f"{prev_name} -> {e.name[:36]}"
        gaps[key][0] += 1
        gaps[key][1] += s - busy_end
        idle += s - busy_end
    busy_end = t if busy_end is None else max(busy_end, t)
    prev_name = e.name[:36]
span = last - first
print(f"{steps} decode steps, {span / steps:.1f} us per step, device idle {idle / steps:.1f} us per step "
      f"({100 * idle / span:.2f}%)")
print("| gap (previous event -> next event) | count | us per step |\n|---|---|---|")
for k, (c, d) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:15]:
    print(f"| {k} | {c} | {d / steps:.2f} |")
