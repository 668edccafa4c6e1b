"""Step-trace overhead: decode throughput with ``EngineConfig.trace`` off and on, one engine, alternated.

    python benchmarks/trace_overhead.py                                  # smollm2-135m on this CPU
    python benchmarks/trace_overhead.py --batch 1 32 --rounds 8
    python benchmarks/trace_overhead.py --model /path/qwen3-0.6b --device cuda --engine-args optimize=true

One engine (``--engine-args`` FIELD=VALUE overrides; continuous batching by default). For each batch size,
each round adds ``--batch`` greedy requests (random prompts of ``--prompt-len`` tokens from a fixed seed,
``ignore_eos``, ``--output-len`` tokens), runs steps untimed until every one has its first token, then
times the decode steps until they finish: decode tok/s = tokens / seconds. Rounds alternate between no
recorder and a :class:`~infer.engine.step_trace.StepRecorder` (what ``trace=PATH`` makes), so a drift of
the machine's speed hits both; the ratio is the median over the rounds' (off, on) pairs of
``on tok/s / off tok/s`` (1.0: free). On a shared or noisy machine that ratio moves by more than the
recorder costs, so one more round per batch size measures the cost directly: the seconds spent inside the
recorder's hooks per step (``hooks_us``) against the median step (``step_ms``; ``hooks_share`` is their
ratio). The same round also feeds a :class:`~infer.engine.live_view.LiveView` (what the server's
``--live-page`` hooks in) and times its step listener apart (``live_us``: per step, on the engine thread,
its snapshots four times a second included; ``live_share`` against the step) and, afterwards, turning its
events into the page's JSON (``event_us``: per event, on the server's event loop, not the engine thread).
The trace is written once at the end, timed, and its size reported.

Writes the JSON report (commit, hardware, EngineConfig, every round) to ``--out`` (default
``benchmarks/runs/trace_overhead.json``) and the Markdown table beside it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
from common import engine_overrides, environment, make_llm, markdown_table, out_argument, sync, write_report
from workloads import random_prompt

from infer.engine.live_view import LiveView
from infer.engine.step_trace import StepRecorder


def decode_round(engine, prompts: list[list[int]], output_len: int) -> float:
    """Run ``prompts`` to ``output_len`` tokens each; returns the decode tok/s (after every first token)."""
    from infer.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while any(len(r.seqs[0].token_ids) == r.prompt_len for r in reqs):  # prefills, untimed
        engine.step(stream=False)
    device = engine.runner.device
    sync(device)
    before = sum(r.seqs[0].num_output_tokens for r in reqs)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step(stream=False)
    sync(device)
    return (len(reqs) * output_len - before) / (time.perf_counter() - start)


def timed_hooks(engine) -> tuple[StepRecorder, list[float]]:
    """A fresh recorder whose hooks add the seconds they take to the returned one-item list (the recorder's
    own host cost, measured apart from the alternated rounds, whose ratio it would bias)."""
    old = engine.tracer
    rec = StepRecorder(old.path, cuda=old.cuda, budget=old.budget)
    spent = [0.0]

    def timed(fn):
        def hook(*a):
            t = time.perf_counter()
            fn(*a)
            spent[0] += time.perf_counter() - t
        return hook

    for name in ("begin", "scheduled", "executed", "preempted", "finished", "end"):
        setattr(rec, name, timed(getattr(rec, name)))
    return rec, spent


def timed_live_view(engine, run, *run_args) -> tuple[float, float]:
    """``run(*run_args)`` with a :class:`LiveView` listening to the engine's recorder. Returns the microseconds its
    listener took per step (engine thread) and those :meth:`LiveView.step_event` takes per event (reader)."""
    view = LiveView(engine)
    listener = engine.tracer.listeners.pop()
    spent, calls = [0.0], [0]

    def timed(*a):
        t = time.perf_counter()
        listener(*a)
        spent[0] += time.perf_counter() - t
        calls[0] += 1

    engine.tracer.listeners.append(timed)
    try:
        run(*run_args)
    finally:
        engine.tracer.listeners.remove(timed)
    events = [payload for _, kind, payload in view.since(0)[0] if kind == "step"]
    t = time.perf_counter()
    for payload in events:
        view.step_event(*payload)
    event_s = time.perf_counter() - t
    return 1e6 * spent[0] / max(calls[0], 1), 1e6 * event_s / max(len(events), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="short name, .gguf or HF directory")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="sequences decoding together")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=6, help="(off, on) pairs per batch size")
    ap.add_argument("--engine-args", nargs="*", default=[], help="EngineConfig overrides, FIELD=VALUE")
    ap.add_argument("--seed", type=int, default=0)
    out_argument(ap, "trace_overhead.json", "write the JSON report here (and a .md beside it)")
    args = ap.parse_args(argv)

    trace_path = os.path.join(tempfile.mkdtemp(prefix="trace_overhead-"), "trace.json")
    kw = {"batching": "continuous", "max_num_seqs": max(args.batch), "device": args.device, "dtype": args.dtype,
          **engine_overrides(args.engine_args), "trace": trace_path}
    llm = make_llm(args.model, kw, args.prompt_len + args.output_len + 8, progress=True)
    engine = llm.engine
    recorder = engine.tracer
    vocab = engine.vocab_size
    rows, rounds = [], []
    for batch in args.batch:
        prompts = [random_prompt(vocab, args.prompt_len, args.seed + i) for i in range(batch)]
        engine.set_tracer(None)
        decode_round(engine, prompts, args.output_len)  # warm-up
        ratios, tok_s = [], {"off": [], "on": []}
        for r in range(args.rounds):
            pair = {}
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):  # neither always goes first
                engine.set_tracer(recorder if mode == "on" else None)
                pair[mode] = decode_round(engine, prompts, args.output_len)
                tok_s[mode].append(pair[mode])
            ratios.append(pair["on"] / pair["off"])
            rounds.append({"batch": batch, "round": r, **pair})
            print(f"batch {batch} round {r}: off {pair['off']:.1f} tok/s, on {pair['on']:.1f} tok/s, "
                  f"on/off {ratios[-1]:.4f}", flush=True)
        engine.set_tracer(recorder)
        timed, spent = timed_hooks(engine)
        engine.set_tracer(timed)
        live_us, event_us = timed_live_view(engine, decode_round, engine, prompts, args.output_len)
        steps = [r for r in timed.steps if r.seqs]
        step_ms = statistics.median(1e3 * (r.t_end - r.t_start) for r in steps)
        hook_us = 1e6 * spent[0] / len(timed.steps) - live_us  # end() runs the live view's listener
        print(f"batch {batch}: the recorder's hooks take {hook_us:.1f} us per step, the live view's listener "
              f"{live_us:.1f} us (and {event_us:.1f} us per event off the engine thread); a step takes "
              f"{step_ms:.2f} ms")
        rows.append({"batch": batch, "off_tok_s": statistics.median(tok_s["off"]),
                     "on_tok_s": statistics.median(tok_s["on"]), "on_over_off": statistics.median(ratios),
                     "min_ratio": min(ratios), "max_ratio": max(ratios), "step_ms": step_ms, "hooks_us": hook_us,
                     "hooks_share": hook_us / (1e3 * step_ms), "live_us": live_us,
                     "live_share": live_us / (1e3 * step_ms), "event_us": event_us})
    engine.set_tracer(recorder)
    start = time.perf_counter()
    engine.write_trace()
    write_s = time.perf_counter() - start
    size = os.path.getsize(trace_path)
    print(f"trace of {len(recorder.steps)} steps written in {write_s:.2f} s: {size / 1e6:.1f} MB")
    columns = ["batch", "off_tok_s", "on_tok_s", "on_over_off", "min_ratio", "max_ratio", "step_ms", "hooks_us",
               "hooks_share", "live_us", "live_share", "event_us"]
    table = markdown_table(rows, columns)
    report = {"environment": environment(engine.runner.device), "engine_config": llm.config.to_dict(),
              "workload": {k: getattr(args, k) for k in ("batch", "prompt_len", "output_len", "rounds", "seed")},
              "rows": rows, "rounds": rounds,
              "trace": {"steps": len(recorder.steps), "bytes": size, "write_s": write_s}}
    write_report(report, args.out, table)
    llm.close()
    shutil.rmtree(os.path.dirname(trace_path), ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
