"""Step traces (``EngineConfig.trace``, :mod:`infer.engine.step_trace`).

A scripted run on the shipped SmolLM2-135M (float32, CPU) that exercises every event a step records:
continuous batching admits requests mid-flight, chunked prefill splits prompts beside decodes, a
12-block KV pool forces a preemption (and evictions), and a shared prefix gives prefix-cache hits.
The references are the engine's own: what ``Scheduler.schedule`` returned (spied on), its counters
(steps, prefill tokens, preemptions, prefix hits, evictions), and each request's final output (its
tokens, cached tokens, finish reason). A sequence's recorded chunks must tile its tokens: each starts
where the last ended (or at the cached prefix after an admission), the last ends one token short of
prompt + output (the last sampled token is never run), and it sampled once per output token. The trace
file is checked against the Trace Event Format's rules (keys per phase type, ``ts`` monotonic per
track, ``dur >= 0``, slices nested) and against the records.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infer.config import EngineConfig
from infer.engine.step_trace import COUNTS, StepRecorder
from infer.sampling import SamplingParams
from tests.test_batching import make_engine

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 4
NUM_BLOCKS = 12
BLOCK_BYTES = 2 * 30 * 3 * 64 * 4 * BLOCK  # SmolLM2-135M: K and V, 30 layers, 3 KV heads of 64, float32
KW = dict(kv_cache="paged", block_size=BLOCK, batching="continuous", max_model_len=40, max_num_seqs=4,
          prefix_caching=True, chunked_prefill=True, max_num_batched_tokens=12,
          kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_BYTES)
SHARED = list(range(100, 112))  # three full blocks every prompt but r2's starts with
# (arrival step, prompt, max_tokens): r2 arrives while r0 and r1 decode; the pool cannot hold all three
# to the end, so the last admitted (r2) is preempted; r3 shares r0's prefix and waits behind r2
SCRIPT = [(0, SHARED + [7, 8, 9], 10), (0, SHARED + [11, 12, 13, 14, 15], 10), (2, list(range(300, 314)), 8),
          (6, SHARED + [21], 6)]
STEP_NAMES = {"prefill", "decode", "mixed", "outputs only"}
SEQ_NAMES = {"prefill", "prefill chunk", "recompute", "decode"}
EPS = 0.01  # microseconds


def scripted_run(engine):
    """Drive the script; returns (request id -> final output, what ``Scheduler.schedule`` returned at each
    step: ``[(request id, index, num_computed_tokens, num_tokens), ...]``)."""
    seen = []
    real = engine.scheduler.schedule

    def spy():
        out = real()
        seen.append([(s.seq.request.request_id, s.seq.index, s.seq.num_computed_tokens, s.num_tokens) for s in out])
        return out

    engine.scheduler.schedule = spy
    pending, done, step = list(enumerate(SCRIPT)), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens) = pending.pop(0)
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               request_id=f"r{i}")
        for out in engine.step(stream=False):
            done[out.request_id] = out
        step += 1
        assert step < 200, "no progress"
    return done, [s for s in seen if s]


def walk_sequence(records, rid: str) -> dict:
    """Follow request ``rid``'s sequence 0 through the records: its chunks must tile its tokens.
    Returns what it ran: prefill and decode tokens, samples, admissions (cached tokens), preemptions."""
    at, got = None, {"prefill": 0, "decode": 0, "samples": 0, "admissions": [], "preemptions": 0, "last_end": None}
    for rec in records:
        if rid in rec.preempted:
            at = None
            got["preemptions"] += 1
        for a_rid, index, cached, _ in rec.admitted:
            if a_rid == rid and index == 0:
                assert at is None, f"{rid} admitted twice without a preemption (step {rec.index})"
                at = cached
                got["admissions"].append(cached)
        for s in rec.seqs:
            if s.request_id != rid:
                continue
            assert at is not None, f"{rid} ran in step {rec.index} before it was admitted"
            assert s.start == at, f"{rid}, step {rec.index}: starts at {s.start}, its cache holds {at}"
            at = s.context_len
            got[s.kind] += s.num_tokens
            got["samples"] += s.samples
            got["last_end"] = at
    return got


def check_trace_format(trace: dict) -> list[dict]:
    """The Trace Event Format's rules for the phase types a step trace uses; returns the events."""
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    named_procs, named_threads, last_ts, open_slices = set(), set(), {}, {}
    for e in trace["traceEvents"]:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int), e
        ph = e["ph"]
        if ph == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), e
            assert set(e["args"]) == ({"name"} if e["name"].endswith("_name") else {"sort_index"}), e
            if e["name"].startswith("thread"):
                assert isinstance(e["tid"], int)
                named_threads.add((e["pid"], e["tid"]))
            else:
                named_procs.add(e["pid"])
            continue
        assert isinstance(e["ts"], (int, float)), e
        if ph == "C":
            track = ("counter", e["pid"], e["name"])
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        else:
            assert ph in ("X", "i"), e
            assert isinstance(e["tid"], int), e
            track = (e["pid"], e["tid"])
            assert track in named_threads and e["pid"] in named_procs, f"unnamed track: {e}"
            if ph == "i":
                assert e["s"] in ("t", "p", "g"), e
            stack = open_slices.setdefault(track, [])
            while stack and stack[-1] <= e["ts"] + EPS:  # (ts and dur are rounded to 1 ns apart)
                stack.pop()
            if ph == "X":
                assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
                end = e["ts"] + e["dur"]
                assert not stack or end <= stack[-1] + EPS, f"{e} overlaps its enclosing slice (ends {stack[-1]})"
                stack.append(end)
        assert e["ts"] >= last_ts.get(track, float("-inf")), f"ts goes back on {track}: {e}"
        last_ts[track] = e["ts"]
    return trace["traceEvents"]


def check_trace_against_records(events: list[dict], records, num_blocks: int, budget: int) -> None:
    steps = [e for e in events if e["pid"] == 1 and e.get("tid") == 1 and e["ph"] == "X" and e["name"] in STEP_NAMES]
    assert [e["args"]["step"] for e in steps] == [r.index for r in records]
    for e, rec in zip(steps, records):
        assert e["name"] == rec.name and e["args"]["tokens"] == rec.num_tokens <= budget == e["args"]["budget"]
        assert {k: e["args"][k] for k in COUNTS} == rec.counts
    kv = [e["args"] for e in events if e["ph"] == "C" and e["name"] == "KV cache blocks"]
    assert len(kv) == len(records) and all(sum(a.values()) == num_blocks for a in kv)
    assert [a["used"] for a in kv] == [r.kv_used for r in records]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
               and e["pid"] == 2}
    per_track = {}
    for e in events:
        if e["pid"] == 2 and e["ph"] == "X" and e["name"] in SEQ_NAMES:
            per_track.setdefault(threads[e["tid"]], []).append((e["args"]["step"], e["args"]["tokens"], e["name"]))
    want = {}
    for rec in records:
        for s in rec.seqs:
            want.setdefault(s.request_id, []).append((rec.index, s.num_tokens, s.kind))
    assert {rid: [(i, n) for i, n, _ in v] for rid, v in per_track.items()} == {
        rid: [(i, n) for i, n, _ in v] for rid, v in want.items()}
    for rid, v in per_track.items():  # decode events are the records' decodes; the other names are prefills
        assert [name == "decode" for _, _, name in v] == [kind == "decode" for _, _, kind in want[rid]]


def test_a_scripted_run_records_what_the_scheduler_did(smollm2, tmp_path):
    path = tmp_path / "trace.json"
    eng = make_engine(smollm2, trace=str(path), **KW)
    assert eng.kv_manager.num_blocks == NUM_BLOCKS
    done, scheduled = scripted_run(eng)
    records = list(eng.tracer.steps)
    stats = eng.stats()

    # every step the scheduler returned, as it returned it
    worked = [r for r in records if r.seqs]
    assert [[(s.request_id, s.index, s.start, s.num_tokens) for s in r.seqs] for r in worked] == scheduled
    assert len(worked) == stats["num_steps"] and [r.index for r in records] == list(range(len(records)))
    assert sum(s.num_tokens for r in records for s in r.seqs if s.kind == "prefill") == stats["num_prefill_tokens"]
    # the engine's counters, step by step
    assert sum(r.counts["preemptions"] for r in records) == sum(len(r.preempted) for r in records) \
        == eng.num_preemptions >= 1
    assert sum(r.counts["prefix_hit_tokens"] for r in records) == stats["prefix_cache_hits"] > 0
    assert sum(r.counts["evictions"] for r in records) == stats["prefix_cache_evictions"] > 0
    for r in records:
        assert r.num_tokens <= eng.scheduler.max_num_batched_tokens
        assert r.kv_used + r.kv_cached + r.kv_free == NUM_BLOCKS and r.running <= KW["max_num_seqs"]
        assert r.graph is None and r.t_start <= r.t_scheduled <= r.t_forward <= r.t_end
    assert all(a.t_end <= b.t_start for a, b in zip(records, records[1:]))

    # each request's chunks tile its tokens, and add up to its output
    for i, (_, prompt, _) in enumerate(SCRIPT):
        rid, out = f"r{i}", done[f"r{i}"]
        tokens = out.outputs[0].token_ids
        got = walk_sequence(records, rid)
        assert got["last_end"] == len(prompt) + len(tokens) - 1, rid  # the last token is sampled, never run
        assert got["samples"] == len(tokens), rid
        assert got["admissions"][0] == out.num_cached_tokens, rid
        assert got["preemptions"] == len(got["admissions"]) - 1
        if not got["preemptions"]:
            assert got["prefill"] == len(prompt) - out.num_cached_tokens and got["decode"] == len(tokens) - 1
        assert [f for r in records for f in r.finished if f[0] == rid] == [(rid, 0, out.outputs[0].finish_reason)]
    assert any(walk_sequence(records, f"r{i}")["preemptions"] for i in range(len(SCRIPT)))
    assert sum(1 for i in range(1, len(SCRIPT)) if done[f"r{i}"].num_cached_tokens) >= 2  # the shared prefix
    # what the script is for: a chunk beside decodes, a request admitted while others decode
    assert any(any(not s.samples for s in r.seqs) and any(s.kind == "decode" for s in r.seqs) for r in records)
    assert any(r.admitted and any(s.kind == "decode" for s in r.seqs) for r in records)

    eng.shutdown()
    trace = json.loads(path.read_text())
    events = check_trace_format(trace)
    check_trace_against_records(events, records, NUM_BLOCKS, eng.scheduler.max_num_batched_tokens)
    assert trace["otherData"]["steps_kept"] == len(records) and trace["otherData"]["steps_dropped"] == 0
    preempted = [e for e in events if e["pid"] == 2 and e["name"] == "preempted"]
    assert {e["ph"] for e in preempted} == {"i", "X"}  # the instant, then the wait for readmission


def test_the_trace_loads_in_perfettos_trace_processor(smollm2, tmp_path):
    """The scripted run's trace, loaded by the ``perfetto`` package's trace processor, holds every slice
    and instant written. Skipped, with the reason, without the package or without its
    ``trace_processor_shell``: a prebuilt binary that the package downloads from get.perfetto.dev on first
    use, which no package registry ships, so a machine without network access needs
    ``$INFER_TRACE_PROCESSOR`` (the binary's path) or the binary on ``PATH``."""
    try:
        from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig
    except ImportError:
        pytest.skip("the perfetto package is not installed (pip install perfetto)")
    binary = os.environ.get("INFER_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")
    if binary is None:
        pytest.skip("no trace_processor_shell: perfetto downloads it on first use; set $INFER_TRACE_PROCESSOR")
    path = tmp_path / "trace.json"
    eng = make_engine(smollm2, trace=str(path), **KW)
    scripted_run(eng)
    eng.shutdown()
    events = check_trace_format(json.loads(path.read_text()))
    with TraceProcessor(trace=str(path), config=TraceProcessorConfig(bin_path=binary)) as tp:
        slices = next(iter(tp.query("select count(*) as n from slice"))).n
    assert slices == sum(e["ph"] in ("X", "i") for e in events)


def test_async_scheduling_records_each_step_once(smollm2, tmp_path):
    eng = make_engine(smollm2, trace=str(tmp_path / "t.json"), async_scheduling=True, **KW)
    done, scheduled = scripted_run(eng)
    records = list(eng.tracer.steps)
    worked = [r for r in records if r.seqs]
    assert [[(s.request_id, s.index, s.start, s.num_tokens) for s in r.seqs] for r in worked] == scheduled
    assert len(worked) == eng.stats()["num_steps"]
    # a request finishes once, in the step that processed its last token (under async scheduling, the next)
    assert sorted(f[0] for r in records for f in r.finished) == sorted(done)
    assert all(r.t_forward is not None for r in worked)
    for i, (_, prompt, _) in enumerate(SCRIPT):
        tokens = done[f"r{i}"].outputs[0].token_ids
        got = walk_sequence(records, f"r{i}")
        # a sequence that finished in step N - 1 already ran step N (its token is dropped): one more at most
        assert len(prompt) + len(tokens) - 1 <= got["last_end"] <= len(prompt) + len(tokens)
        assert len(tokens) <= got["samples"] <= len(tokens) + 1
    eng.shutdown()
    check_trace_format(json.loads((tmp_path / "t.json").read_text()))


def test_tracing_off_holds_no_recorder_and_on_keeps_a_bounded_ring(smollm2, tmp_path):
    off = make_engine(smollm2, **KW)
    assert off.config.trace is None and off.tracer is None
    assert off.runner.on_executed is None and off.scheduler.on_preempt is None
    with pytest.raises(RuntimeError, match="trace"):
        off.write_trace()
    off.shutdown()

    eng = make_engine(smollm2, trace=str(tmp_path / "t.json"), **KW)
    eng.tracer.max_steps = 3
    eng.add_request(SHARED, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if steps == 2:  # written mid-run, recording goes on
            assert json.loads(Path(eng.write_trace(str(tmp_path / "early.json"))).read_text())["otherData"][
                "steps_kept"] == 2
    assert [r.index for r in eng.tracer.steps] == list(range(steps - 3, steps)) and eng.tracer.dropped == steps - 3

    from infer.llm import LLM

    llm = object.__new__(LLM)  # LLM.close shuts the engine down: the trace is written
    llm.engine = eng
    with llm:
        pass
    trace = json.loads((tmp_path / "t.json").read_text())
    check_trace_format(trace)
    assert trace["otherData"]["steps_dropped"] == steps - 3


def test_the_trace_path_is_checked_and_is_a_server_flag(tmp_path):
    from infer.config import engine_config_from_args
    from infer.server.__main__ import build_parser

    args = build_parser().parse_args(["--trace", str(tmp_path / "run.json")])
    assert engine_config_from_args(args).trace == str(tmp_path / "run.json")
    for bad in ("", str(tmp_path), str(tmp_path / "no-such-dir" / "t.json")):
        with pytest.raises(ValueError, match="trace"):
            EngineConfig(device="cpu", trace=bad).validate()


def test_the_server_writes_its_trace_at_shutdown(tiny_llama, tmp_path):
    import httpx

    from infer.engine import LLMEngine
    from infer.server.app import build_app
    from infer.server.async_engine import AsyncEngine

    path = tmp_path / "server.json"
    cfg = EngineConfig(model=str(tiny_llama.path), device="cpu", dtype="float32", trace=str(path), **KW)
    eng = AsyncEngine(lambda: LLMEngine(cfg, loaded=tiny_llama, progress=False))
    app = build_app(eng, "tiny")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            body = {"model": "tiny", "prompt": SHARED, "max_tokens": 3, "temperature": 0}
            return [(await c.post("/v1/completions", json=body)).status_code for _ in range(2)]

    try:
        assert asyncio.run(go()) == [200, 200]
        assert not path.exists()
    finally:
        eng.shutdown()
    events = check_trace_format(json.loads(path.read_text()))
    finished = [e for e in events if e["name"] == "finished"]
    assert len(finished) == 2 and {e["args"]["finish_reason"] for e in finished} == {"length"}


def test_an_engine_never_shut_down_writes_its_trace_at_exit(tmp_path):
    path = tmp_path / "exit.json"
    script = ("import sys\nfrom infer import LLM, SamplingParams\n"
              "llm = LLM('smollm2-135m', device='cpu', dtype='float32', max_model_len=64, trace=sys.argv[1], "
              "progress=False)\n"
              "llm.generate(['Hello'], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)\n")
    run = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    events = check_trace_format(json.loads(path.read_text()))
    steps = [e["args"]["tokens"] for e in events if e["pid"] == 1 and e["ph"] == "X" and e["name"] in STEP_NAMES]
    assert len(steps) == 3 and steps[1:] == [1, 1]  # the prompt, then two decodes


def test_steps_past_the_bounds_are_dropped_oldest_first():
    class Fake:  # what the recorder reads of an engine
        class scheduler:  # noqa: N801
            num_preemptions, running, waiting = 0, [], []

        class kv_manager:  # noqa: N801
            prefix_cache_hits = offload_hit_tokens = num_free_blocks = 0
            num_blocks = 0
            pool = None

        offloader = None

    rec = StepRecorder("unused.json", max_steps=100, max_seq_entries=5)

    class Item:
        def __init__(self, rid):
            self.seq = type("S", (), {"request": type("R", (), {"request_id": rid})(), "index": 0,
                                      "num_computed_tokens": 0, "num_prompt_tokens": 4, "token_ids": [0] * 4})()
            self.num_tokens, self.forks = 4, []

    for i in range(4):  # 2 sequences a step: 8 entries > 5, so the first two steps go
        rec.begin(Fake)
        rec.scheduled(Fake, [Item(f"a{i}"), Item(f"b{i}")])
        rec.end(Fake)
    assert [r.index for r in rec.steps] == [2, 3] and rec.dropped == 2
