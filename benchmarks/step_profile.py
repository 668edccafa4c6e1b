"""Where one engine step's time goes: host work vs device work, and the top kernels.

    python benchmarks/step_profile.py --scale 0.05                         # CPU, smollm2
    python benchmarks/step_profile.py --model /tmp/infer-ckpt/qwen3-0.6b --device cuda \\
        --dtype bfloat16 --max-num-seqs 256 \\
        --infer-configs "batching=continuous;batching=continuous,kv_cache=paged" --out benchmarks/runs/step_qwen3-0.6b.json

The offline workload of ``offline_throughput.py`` (nano-vllm's, ``--scale`` to shrink it) is
submitted at once; the engine runs ``--skip`` steps (the prefills, so the window below sees
the steady decode batch), then ``--steps`` steps are timed phase by phase, with the device
synchronized at each boundary:

* ``schedule``: the scheduler (admission, KV blocks for the step; host only);
* ``execute``: the model runner (input tensors, forward, sampling; host and device);
* ``output``: the output processor (stop checks, detokenization; host only).

``execute_host_ms`` is the part of ``execute`` before it returns (input tensors built, kernels or
the graph launched, not yet run), and ``host_ms`` = schedule + execute_host + output: the host's
work per step, which async scheduling overlaps with the device's (an upper bound: a launch that
waits on the device counts as host time).

Then ``--unsync-steps`` steps run as the engine runs them, without synchronizing: their wall time
per step, and the part of it the host spent blocked waiting for the device's tokens
(``StepResult.host_outputs``); the rest is host work. With async scheduling the host works while
the device runs, so this window, not the synchronized one, says whether a step is host- or
device-bound: ``device_busy_share_unsync`` is the profiled device time over this window's step.

Then ``--profile-steps`` more steps run under ``torch.profiler``: the device's busy time per
step (the sum of its kernels' times) against the step's wall time says whether the step is
device-bound (busy ~ wall) or host-bound (busy << wall: the GPU waits for Python), and the
top kernels and host ops say where the time goes. Synchronizing at every boundary costs some
overlap, so the per-phase times add up to a little more than an unsynchronized step.
``--stream`` steps as the server does (``step(stream=True)``: an output for every request at every
step, so ``output`` includes building them; each carries what ``--output-kind`` says, by default
``delta`` as the server's streams ask: only what is new). ``--host-profile N`` runs N more steps under cProfile
and lists the functions with the most cumulative host time (cProfile slows Python about 2x: read
the shares, not the times).

Writes the JSON report (environment, workload, arguments, every configuration's row with its top
kernels, host ops and functions) to ``--out`` (default ``benchmarks/runs/step_profile.json``) and the
Markdown tables beside it (``.md``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import (
    environment,
    free_device_memory,
    infer_label,
    make_llm,
    markdown_table,
    model_info,
    out_argument,
    parse_infer_configs,
    sync,
    write_report,
)
from tqdm import tqdm
from workloads import build_workload, scaled_sizes, warmup_workload


def _drive(engine, num_steps: int, device, phases: dict[str, list[float]] | None = None, feed=None) -> int:
    """Run up to ``num_steps`` engine steps (:meth:`LLMEngine.step`); with ``phases``, time each phase.
    ``feed``: called before each step, untimed (:class:`_LongPromptFeed`).

    The phases are timed inside the engine's own step: its scheduler's ``schedule`` and its
    runner's ``execute`` are wrapped on this engine (the device synchronized after each), and
    what follows ``execute`` until the step returns is ``output``.
    """
    marks: dict[str, Any] = {}
    restore = []
    if phases is not None:
        schedule, execute = engine.scheduler.schedule, engine.runner.execute

        def timed_schedule():
            marks["scheduled"] = out = schedule()
            marks["scheduled_at"] = time.perf_counter()
            return out

        def timed_execute(*args):
            marks["launch"] = 0.0
            result = execute(*args)
            marks["launched_at"] = time.perf_counter()  # the host's part: its kernels are queued
            marks["launch_time"] = marks.pop("launch")
            sync(device)
            marks["executed_at"] = time.perf_counter()
            return result

        engine.scheduler.schedule, engine.runner.execute = timed_schedule, timed_execute
        restore = _time_launches(engine, marks)
    done = 0
    try:
        for _ in range(num_steps):
            if feed is not None:
                feed()
            if not engine.has_unfinished_requests():
                break
            if phases is None:
                engine.step(stream=False)
                done += 1
                continue
            marks.clear()
            sync(device)
            t0 = time.perf_counter()
            engine.step(stream=False)
            t3 = time.perf_counter()
            if "executed_at" not in marks:  # nothing was scheduled
                break
            phases["schedule"].append(marks["scheduled_at"] - t0)
            phases["execute"].append(marks["executed_at"] - marks["scheduled_at"])
            phases["execute_host"].append(marks["launched_at"] - marks["scheduled_at"])
            phases["launch"].append(marks["launch_time"])
            phases["output"].append(t3 - marks["executed_at"])
            phases["seqs"].append(len(marks["scheduled"]))
            phases["tokens"].append(sum(item.num_tokens for item in marks["scheduled"]))
            done += 1
    finally:
        if phases is not None:  # back to the classes' own methods
            del engine.scheduler.schedule, engine.runner.execute
        for undo in restore:
            undo()
    return done


def _time_launches(engine, marks: dict[str, Any]) -> list:
    """While ``execute`` runs, add to ``marks["launch"]`` the host time of the calls that launch the
    device's work: every CUDA graph's replay, the eager forward and logits, the sampler, and the start
    of the tokens' copy to the host. The rest of ``execute``'s host part prepares the step's inputs
    (staging them, the block tables, the placeholders, the sampling tensors). Returns undo callables."""
    import infer.engine.model_runner as mr

    def timed(fn):
        def wrapped(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if "launch" in marks:  # inside execute
                    marks["launch"] += time.perf_counter() - t
        return wrapped

    runner, undo = engine.runner, []
    for name in ("_forward", "_logits"):
        setattr(runner, name, timed(getattr(runner, name)))
        undo.append(lambda name=name: delattr(runner, name))
    patched = [(mr, "sample"), (mr.StepResult, "start_copy_to_host")]
    if torch.cuda.is_available():
        patched.append((torch.cuda.CUDAGraph, "replay"))
    for owner, name in patched:
        fn = getattr(owner, name)
        setattr(owner, name, timed(fn))
        undo.append(lambda owner=owner, name=name, fn=fn: setattr(owner, name, fn))
    return undo


def _unsync_window(engine, num_steps: int, device, feed=None) -> dict[str, float]:
    """Run ``num_steps`` steps without synchronizing; returns the mean wall time per step and the
    part of it spent waiting for the device (inside :meth:`StepResult.host_outputs`), in ms."""
    from infer.engine.step import StepResult

    waits: list[float] = []
    host_outputs = StepResult.host_outputs

    def timed_host_outputs(result):
        result.start_copy_to_host()
        if result._ready is not None:
            t = time.perf_counter()
            result._ready.synchronize()
            waits.append(time.perf_counter() - t)
        return host_outputs(result)

    StepResult.host_outputs = timed_host_outputs
    try:
        sync(device)
        t0 = time.perf_counter()
        n = _drive(engine, num_steps, device, feed=feed)
        sync(device)
        wall = time.perf_counter() - t0
    finally:
        StepResult.host_outputs = host_outputs
    if n == 0:
        return {}
    return {"unsync_steps": n, "unsync_step_ms": wall / n * 1e3, "unsync_wait_ms": sum(waits) / n * 1e3,
            "unsync_host_ms": (wall - sum(waits)) / n * 1e3}


def _host_profile(engine, num_steps: int, device, top: int, feed=None) -> list[dict[str, Any]]:
    """cProfile ``num_steps`` steps; the ``top`` functions by cumulative time (ms per step)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    n = _drive(engine, num_steps, device, feed=feed)
    sync(device)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, prim calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][3])
    out = []
    for (file, line, name), (calls, _, tottime, cumtime, _) in rows:
        if len(out) == top:
            break
        if file.endswith("step_profile.py") or name == "<method 'disable' of '_lsprof.Profiler' objects>":
            continue  # this program's own frames
        where = f"{Path(file).name}:{line}({name})" if file != "~" else name
        out.append({"function": where[:80], "calls_per_step": calls / max(n, 1),
                    "cum_ms_per_step": cumtime / max(n, 1) * 1e3, "self_ms_per_step": tottime / max(n, 1) * 1e3})
    return out


def _kernel_table(prof, device_type: str, top: int) -> tuple[float, list[dict[str, Any]], list[dict[str, Any]]]:
    """(device busy seconds, top device kernels, top host ops) from a finished profiler."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    # the kernels themselves (device events); the host ops that launched them carry the same time again
    # (not the profiler's own step ranges, which span the whole step on the device timeline)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and getattr(e, dev_attr, 0.0) > 0
               and not e.key.startswith("ProfilerStep")]
    kernels.sort(key=lambda e: -getattr(e, dev_attr))
    busy_us = sum(getattr(e, dev_attr) for e in kernels)
    host = sorted((e for e in events if not e.key.startswith("ProfilerStep")), key=lambda e: -e.self_cpu_time_total)
    dev_rows = [{"kernel": e.key[:70], "calls": e.count, "device_ms": getattr(e, dev_attr) / 1e3,
                 "share": getattr(e, dev_attr) / busy_us if busy_us else None} for e in kernels[:top]]
    host_rows = [{"op": e.key[:70], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in host[:top]]
    return busy_us / 1e6, dev_rows, host_rows


def _num_kernels(prof) -> int:
    """Device kernels the profiled steps ran (a CUDA graph's kernels counted one by one)."""
    from torch.autograd import DeviceType

    return sum(e.count for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA and not e.key.startswith(("ProfilerStep", "Memcpy", "Memset")))


class _LongPromptFeed:
    """The mixed workload's long prompts (``--long-len``): before each step, tops up to ``depth``
    unfinished prompts of ``long_len`` tokens (``max_tokens=1``), so that with chunked prefill every
    step carries a prompt chunk beside the decoding streams (Sarathi-Serve's mixed batch). Each
    prompt differs in its first token, so no prefix-cache hit shortens it."""

    def __init__(self, engine, long_len: int, token_hi: int, seed: int, depth: int = 2) -> None:
        rng = random.Random(f"{seed}-long")
        self.engine, self.depth, self.hi = engine, depth, token_hi
        self.base = [rng.randint(0, token_hi) for _ in range(long_len)]
        self.live: list = []
        self.added = 0

    def __call__(self) -> None:
        from infer import SamplingParams

        self.live = [r for r in self.live if r.request_id in self.engine.requests]
        while len(self.live) < self.depth:
            prompt = [self.added % (self.hi + 1)] + self.base[1:]
            self.live.append(self.engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
            self.added += 1


def mixed_workload(args, vocab_size: int):
    """``--streams`` decode streams of ``--stream-prompt-len`` prompt tokens, each asking for more
    tokens than every window of this run takes (so the batch stays the same); the long prompts come
    from :class:`_LongPromptFeed` once the streams decode."""
    steps = args.skip + args.steps + args.unsync_steps + 2 * args.profile_steps + args.host_profile + 64
    wl = build_workload(args.streams, args.stream_prompt_len, args.stream_prompt_len, vocab_size, args.seed,
                           min_output_len=steps, max_output_len=steps)
    wl.params.update(long_len=args.long_len, streams=args.streams, stream_prompt_len=args.stream_prompt_len)
    return wl


def profile_config(model: str, overrides: dict[str, Any], wl, args) -> dict[str, Any]:
    from infer import SamplingParams

    llm = make_llm(model, {**args.engine_kwargs, **overrides}, wl.max_seq_len, progress=not args.no_progress)
    engine, device = llm.engine, llm.config.resolved_device()
    # warm up (kernels compiled, allocator primed) on the small workload, as offline_throughput does
    w = warmup_workload(wl)
    llm.generate(w.prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in w.output_lens], use_tqdm=False)
    kind = {}
    if args.stream and "output_kind" in SamplingParams.field_names():  # (older sources: cumulative only)
        from infer import RequestOutputKind

        kind = {"output_kind": RequestOutputKind[args.output_kind.upper()]}
    for p, o in zip(wl.prompts, wl.output_lens):
        engine.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True, temperature=args.temperature, **kind))
    if args.stream:  # as the server runs it: an output (text delta) for every request at every step
        step = engine.step
        engine.step = lambda stream=False: step(stream=True)
    _drive(engine, args.skip, device)
    feed = _LongPromptFeed(engine, wl.params["long_len"], wl.params["token_range"][1], args.seed) \
        if wl.params.get("long_len") else None
    phases: dict[str, list[float]] = {k: [] for k in ("schedule", "execute", "execute_host", "launch", "output",
                                                      "seqs", "tokens")}
    _drive(engine, args.steps, device, phases, feed)
    n = len(phases["schedule"])
    if n == 0:
        raise SystemExit(f"no steps left after --skip {args.skip}: lower it or raise --scale")
    mean = {k: sum(v) / n for k, v in phases.items()}
    unsync = _unsync_window(engine, args.unsync_steps, device, feed) if args.unsync_steps else {}
    prof_steps, prof_wall, busy, dev_rows, host_rows, num_kernels = 0, 0.0, None, [], [], None
    if args.profile_steps:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # one untimed step under the profiler first: its start-up (seconds) is not a step's time
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=args.profile_steps, repeat=1)
        with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
            _drive(engine, 1, device, feed=feed)
            prof.step()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.profile_steps):
                prof_steps += _drive(engine, 1, device, feed=feed)
                prof.step()
            sync(device)
            prof_wall = time.perf_counter() - t0
        busy, dev_rows, host_rows = _kernel_table(prof, device.type, args.top)
        num_kernels = _num_kernels(prof) if device.type == "cuda" else None
    host_functions = _host_profile(engine, args.host_profile, device, 2 * args.top, feed) if args.host_profile else []
    for rid in list(engine.requests):  # the rest is not measured: abort it (frees every KV block)
        engine.abort_request(rid)
    kv = engine.scheduler.kv
    row = {
        "label": infer_label(overrides) + (f" stream ({kind['output_kind'].name.lower() if kind else 'cumulative'})"
                                              if args.stream else ""), "steps_timed": n,
        "seqs_per_step": mean["seqs"], "tokens_per_step": mean["tokens"],
        "schedule_ms": mean["schedule"] * 1e3, "execute_ms": mean["execute"] * 1e3, "output_ms": mean["output"] * 1e3,
        "step_ms": (mean["schedule"] + mean["execute"] + mean["output"]) * 1e3,
        # the host's work per step: scheduling, preparing and launching the step (until execute
        # returns, its kernels queued), and processing the outputs
        "execute_host_ms": mean["execute_host"] * 1e3,
        "host_ms": (mean["schedule"] + mean["execute_host"] + mean["output"]) * 1e3,
        # execute's host part split: launching the device's work (graph replays, eager forward and
        # logits, sampler, the tokens' copy) and the rest, preparing the step's inputs
        "launch_ms": mean["launch"] * 1e3,
        "prepare_ms": (mean["execute_host"] - mean["launch"]) * 1e3,
        # schedule + input preparation + output processing: the host's own work, launches aside
        "host_no_launch_ms": (mean["schedule"] + mean["execute_host"] - mean["launch"] + mean["output"]) * 1e3,
        # medians over the timed steps (a host's hiccups move the means)
        "host_ms_p50": statistics.median(a + b + c for a, b, c in zip(phases["schedule"], phases["execute_host"],
                                                                      phases["output"])) * 1e3,
        "host_no_launch_ms_p50": statistics.median(
            a + b - l + c for a, b, l, c in zip(phases["schedule"], phases["execute_host"], phases["launch"],
                                                phases["output"])) * 1e3,
        "profiled_steps": prof_steps, "kv_blocks_leaked": kv.num_blocks - kv.num_free_blocks,
        "profiled_step_ms": prof_wall / max(prof_steps, 1) * 1e3 if prof_steps else None,
        "device_busy_ms": busy / prof_steps * 1e3 if device.type == "cuda" and prof_steps else None,
        "kernels_per_step": num_kernels / max(prof_steps, 1) if num_kernels is not None else None,
        **unsync,
    }
    if row["device_busy_ms"] is not None:  # of an unprofiled (phase-timed) step: the profiler slows the host
        row["device_busy_share"] = row["device_busy_ms"] / row["step_ms"]
        if unsync:
            row["device_busy_share_unsync"] = row["device_busy_ms"] / row["unsync_step_ms"]
    row["top_kernels"], row["top_host_ops"], row["host_functions"] = dev_rows, host_rows, host_functions
    return row


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default=None, help="cuda if available, else cpu")
    ap.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on GPU (the engine's default)")
    ap.add_argument("--scale", type=float, default=1.0, help="shrinks the nano-vllm workload (0.05 on a CPU)")
    for name in ("num-requests", "min-len", "max-len", "min-output-len", "max-output-len"):
        ap.add_argument(f"--{name}", type=int, default=None, help="overrides the scaled value")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--long-len", type=int, default=0,
                    help="the mixed workload instead of the offline one: --streams decode streams, and prompts of "
                         "this many tokens always waiting, so that with chunked prefill every step is mixed [0: off]")
    ap.add_argument("--streams", type=int, default=32, help="mixed workload: decode streams [32]")
    ap.add_argument("--stream-prompt-len", type=int, default=256, help="mixed workload: their prompt tokens [256]")
    ap.add_argument("--infer-configs", default="batching=continuous;batching=continuous,kv_cache=paged",
                    help="';'-separated EngineConfig overrides, one profile each")
    ap.add_argument("--skip", type=int, default=20, help="steps before the timed window (prefills) [20]")
    ap.add_argument("--steps", type=int, default=30, help="steps timed phase by phase [30]")
    ap.add_argument("--profile-steps", type=int, default=5, help="steps under torch.profiler (0: none) [5]")
    ap.add_argument("--unsync-steps", type=int, default=30,
                    help="steps timed without synchronizing (host work vs waiting for the device) [30]")
    ap.add_argument("--stream", action="store_true",
                    help="step(stream=True), as the server: every request's output at every step")
    ap.add_argument("--output-kind", choices=("cumulative", "delta", "final_only"), default="delta",
                    help="with --stream: what each output carries (RequestOutputKind) [delta, the server's]")
    ap.add_argument("--host-profile", type=int, default=0, help="steps under cProfile (host functions) [0]")
    ap.add_argument("--top", type=int, default=12, help="rows of the kernel and host-op tables [12]")
    ap.add_argument("--no-progress", action="store_true")
    out_argument(ap, "step_profile.json", "JSON report (and .md beside it)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model, cfg = model_info(args.model)
    model = str(model)
    sizes = scaled_sizes(args.scale, args.num_requests, args.min_len, args.max_len, args.min_output_len,
                            args.max_output_len)
    if args.long_len:
        wl = mixed_workload(args, cfg.vocab_size)
    else:
        wl = build_workload(sizes["num_requests"], sizes["min_len"], sizes["max_len"], cfg.vocab_size, args.seed,
                               min_output_len=sizes["min_output_len"], max_output_len=sizes["max_output_len"])
    args.engine_kwargs = {k: v for k, v in (("device", args.device), ("dtype", args.dtype),
                                            ("max_num_seqs", args.max_num_seqs),
                                            ("max_num_batched_tokens", args.max_num_batched_tokens)) if v is not None}
    if args.long_len:
        args.engine_kwargs["max_model_len"] = max(wl.max_seq_len, args.long_len + 16)
    rows = []
    configs = parse_infer_configs(args.infer_configs)
    for overrides in tqdm(configs, desc="configs", disable=args.no_progress):
        rows.append(profile_config(model, overrides, wl, args))
        free_device_memory()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cols = ["label", "seqs_per_step", "tokens_per_step", "schedule_ms", "execute_ms", "output_ms", "step_ms",
            "execute_host_ms", "prepare_ms", "launch_ms", "host_ms", "host_ms_p50", "host_no_launch_ms",
            "host_no_launch_ms_p50", "profiled_step_ms", "device_busy_ms", "device_busy_share", "unsync_step_ms", "unsync_wait_ms",
            "unsync_host_ms", "device_busy_share_unsync", "kernels_per_step"]
    what = (f"mixed workload ({args.streams} streams of {args.stream_prompt_len}-token prompts decoding, "
            f"{args.long_len}-token prompts always waiting)" if args.long_len
            else f"workload scale {args.scale} ({wl.num_requests} requests)")
    table = (f"step profile: {args.model} on {device}, {what}, steps {args.skip + 1}-{args.skip + args.steps} timed, "
             f"{args.profile_steps} profiled\n\n" + markdown_table(rows, cols))
    for r in rows:
        if r["top_kernels"]:
            table += f"\n\ntop device kernels, {r['label']}:\n\n" + markdown_table(r["top_kernels"],
                                                                                  ["kernel", "calls", "device_ms", "share"])
        table += f"\n\ntop host ops (self CPU), {r['label']}:\n\n" + markdown_table(r["top_host_ops"],
                                                                                 ["op", "calls", "self_cpu_ms"])
        if r["host_functions"]:
            table += f"\n\nhost functions under cProfile, {r['label']}:\n\n" + markdown_table(
                r["host_functions"], ["function", "calls_per_step", "cum_ms_per_step", "self_ms_per_step"])
    report = {"benchmark": "step_profile", "model": args.model, "environment": environment(device),
              "workload": {"num_requests": wl.num_requests, **sizes, **wl.params, "seed": args.seed},
              "args": {k: v for k, v in vars(args).items() if k != "engine_kwargs"}, "results": rows}
    write_report(report, args.out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
