"""The throughput benchmark programs (offline_throughput.py, ablate.py, step_profile.py) and what they
share (common.py, workloads.py), at tiny sizes.

These check what the programs count and write, never how fast anything is.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import ablate  # noqa: E402
import common  # noqa: E402
import offline_throughput as ot  # noqa: E402
import serve_bench  # noqa: E402
import step_profile  # noqa: E402
import workloads  # noqa: E402

# ---------------------------------------------------------------------------------- workload


def test_scaled_sizes_follow_nano_vllm_and_explicit_values_win():
    assert workloads.scaled_sizes() == {"num_requests": 256, "min_len": 100, "max_len": 1024,
                                        "min_output_len": 100, "max_output_len": 1024}
    assert workloads.scaled_sizes(0.1) == {"num_requests": 26, "min_len": 10, "max_len": 102,
                                           "min_output_len": 10, "max_output_len": 102}
    s = workloads.scaled_sizes(0.1, num_requests=3, max_len=8, min_output_len=2)  # the scaled min_len 10 is clipped to 8
    assert s == {"num_requests": 3, "min_len": 8, "max_len": 8, "min_output_len": 2, "max_output_len": 8}
    assert workloads.scaled_sizes(1.0, min_len=2000)["max_len"] == 2000
    with pytest.raises(ValueError):
        workloads.scaled_sizes(0.1, min_len=20, max_len=8)
    assert workloads.scaled_sizes(0.001)["num_requests"] >= 1 and workloads.scaled_sizes(0.001)["min_len"] >= 1


def test_workload_lengths_are_in_range_and_deterministic():
    w = workloads.build_workload(200, 10, 20, vocab_size=500, seed=3, min_output_len=2, max_output_len=5)
    assert w.num_requests == 200
    assert all(10 <= len(p) <= 20 for p in w.prompts)
    assert all(2 <= o <= 5 for o in w.output_lens)
    assert {len(p) for p in w.prompts} == set(range(10, 21))  # uniform over the whole range
    assert all(0 <= t <= 499 for p in w.prompts for t in p)  # capped at the vocabulary
    again = workloads.build_workload(200, 10, 20, vocab_size=500, seed=3, min_output_len=2, max_output_len=5)
    assert (again.prompts, again.output_lens) == (w.prompts, w.output_lens)
    other = workloads.build_workload(200, 10, 20, vocab_size=500, seed=4, min_output_len=2, max_output_len=5)
    assert other.prompts != w.prompts
    assert w.prompt_tokens == sum(map(len, w.prompts)) and w.output_tokens == sum(w.output_lens)
    assert w.max_seq_len == max(len(p) + o for p, o in zip(w.prompts, w.output_lens))


def test_workload_at_scale_1_is_nano_vllms():
    # nano-vllm bench.py: seed(0); prompts, then SamplingParams(max_tokens=randint(100, 1024))
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    outs = [rng.randint(100, 1024) for _ in range(256)]
    s = workloads.scaled_sizes(1.0)
    w = workloads.build_workload(s["num_requests"], s["min_len"], s["max_len"], 151936, 0,
                                 s["min_output_len"], s["max_output_len"])
    assert w.prompts == prompts and w.output_lens == outs


def test_engine_overrides_parse_to_field_types_and_round_trip():
    ov = common.parse_overrides("batching=continuous, max_num_seqs=16,max-model-len=none,gpu_memory_utilization=0.5")
    assert ov == {"batching": "continuous", "max_num_seqs": 16, "max_model_len": None,
                  "gpu_memory_utilization": 0.5}
    assert common.parse_overrides(common.format_overrides(ov)) == ov
    assert common.parse_overrides("batching=none") == {"batching": "none"}  # a string field keeps "none"
    assert common.parse_infer_configs("batching=none;batching=static") == [{"batching": "none"}, {"batching": "static"}]
    assert common.parse_infer_configs(None) == [{}]
    with pytest.raises(ValueError, match="not an EngineConfig field"):
        common.parse_overrides("warp_speed=9")
    with pytest.raises(ValueError):
        common.parse_overrides("batching")


# ---------------------------------------------------------------------------------- HF padded batches


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["dynamic-cache", "static-cache"])
def test_hf_padded_batches_count_only_each_requests_own_tokens(compiled):
    from tests.hf_reference import tiny_hf_model

    model = tiny_hf_model("llama").eval()
    wl = workloads.build_workload(5, 2, 6, vocab_size=384, seed=1)
    wl.output_lens = [3, 7, 2, 5, 4]
    widths = [max(len(p) for p in wl.prompts[i:i + 2]) for i in (0, 2, 4)]
    assert ot.hf_static_cache_len(wl, 2) == max(w + o for w, o in zip(widths, [7, 5, 4]))
    r = ot.hf_padded_batches(model, wl, batch_size=2, temperature=0.0, compiled=compiled)
    # batches [3, 7] -> 7 each, [2, 5] -> 5 each, [4] -> 4 (static cache: a dummy row, not counted)
    assert r["generated_tokens"] == 2 * 7 + 2 * 5 + 4
    assert r["output_tokens"] == 21 and r["padding_waste_tokens"] == 7
    assert [q["tokens"] for q in r["requests"]] == wl.output_lens and r["tokens_ok"]
    assert r["hf_batches"] == 3 and r["prompt_tokens"] == wl.prompt_tokens
    assert r["output_tok_per_s"] == pytest.approx(21 / r["wall_s"])
    assert r["total_tok_per_s"] == pytest.approx((21 + wl.prompt_tokens) / r["wall_s"])
    e2e = [q["e2e_ms"] for q in r["requests"]]
    assert e2e[0] == e2e[1] < e2e[2] == e2e[3] < e2e[4]  # a batch answers together, batches in order
    assert all(0 < q["ttft_ms"] <= q["e2e_ms"] for q in r["requests"])


class _OlderTransformers:
    """A model seen through an older transformers (5.17): no ``continuous_batching_context_manager``."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        if name == "continuous_batching_context_manager":
            raise AttributeError(name)
        return getattr(self._model, name)


@pytest.mark.slow
@pytest.mark.parametrize("older", [False, True], ids=["context-manager", "init-start-stop"])
def test_hf_continuous_batching_gives_each_request_its_own_length(older):
    from tests.hf_reference import tiny_hf_model

    model = tiny_hf_model("llama").eval()
    if not ot.hf_cb_available(model):
        pytest.skip("this transformers has no continuous batching")
    if older:
        model = _OlderTransformers(model)
        assert not hasattr(model, "continuous_batching_context_manager") and ot.hf_cb_available(model)
    wl = workloads.build_workload(5, 2, 6, vocab_size=384, seed=1)
    wl.output_lens = [3, 7, 2, 5, 4]
    # A bounded cache: left to size itself, transformers takes 60% of the free RAM (~14 GB here).
    # every request here holds at most 6 + 7 tokens: one 256-token page each; 250 + 7 tokens take two
    assert ot.hf_cb_blocks_for(wl) == 5
    assert ot.hf_cb_blocks_for(workloads.Workload([[1] * 250, [1] * 6], [7, 3], {})) == 3
    r = ot.run_hf_cb(model, wl, temperature=0.0, progress=False, warmup=False, num_blocks=ot.hf_cb_blocks_for(wl),
                     max_batch_tokens=64)
    assert r["errors"] == [] and r["tokens_ok"]
    assert [q["tokens"] for q in r["requests"]] == wl.output_lens  # no padding: each stops at its own length
    assert r["output_tokens"] == sum(wl.output_lens)


def test_decode_interference_streams_then_long_prompts_at_fixed_offsets():
    from workloads import build_requests

    reqs = build_requests("decode-interference", 3, 8, 50, seed=0, token_prompts=True, long_len=300,
                          long_prompts=2, long_output_len=4, long_start_s=1.5, long_interval_s=2.0)
    assert [(r.kind, r.input_len, r.output_len, r.extra["arrival_s"]) for r in reqs] == [
        ("stream", 8, 50, 0.0)] * 3 + [("long", 300, 4, 1.5), ("long", 300, 4, 3.5)]
    assert [len(r.prompt) for r in reqs] == [8, 8, 8, 300, 300]

    def rec(kind, ttft, itl):
        return {"success": True, "kind": kind, "ttft": ttft, "itl": itl, "e2e": ttft + sum(itl), "send_s": 0.0,
                "end_s": ttft + sum(itl), "output_tokens": len(itl) + 1, "prompt_tokens": 8, "input_len": 8,
                "tpot": sum(itl) / len(itl) if itl else None, "error": None}

    agg = serve_bench.aggregate([rec("stream", 0.1, [0.01, 0.02, 0.5]), rec("stream", 0.1, [0.01, 0.01]),
                                 rec("long", 0.7, [0.03])], float("inf"), "decode-interference")
    assert agg["stream_completed"] == 2 and agg["long_completed"] == 1
    assert agg["stream_itl_max_ms"] == pytest.approx(500.0)  # the long prefill's stall, streams only
    assert agg["stream_itl_p50_ms"] == pytest.approx(10.0)
    assert agg["long_ttft_p50_ms"] == pytest.approx(700.0)


def _send(app, body: dict) -> dict:
    """serve_bench.send against an ASGI app, in process."""
    import asyncio

    import httpx

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return await serve_bench.send(c, "/v1/completions", body, chat=False, timeout=60)

    return asyncio.run(go())


def test_serve_bench_token_itl_times_every_token_from_the_real_server(tiny_llama):
    """The in-process server sends a chunk per token, with text or (held back by the detokenizer)
    without; with ``continuous_usage_stats`` every token after the first chunk's gets a gap, while
    per-content-chunk timing sees fewer, longer gaps whenever text was held back."""
    from infer.config import EngineConfig
    from infer.engine import LLMEngine
    from infer.server.app import build_app
    from infer.server.async_engine import AsyncEngine

    cfg = EngineConfig(model=str(tiny_llama.path), device="cpu", dtype="float32", max_model_len=128)
    eng = AsyncEngine(lambda: LLMEngine(cfg, loaded=tiny_llama, progress=False))
    app = build_app(eng, "tiny")
    body = {"model": "tiny", "prompt": [5, 17, 300, 42], "max_tokens": 40, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        per_chunk = _send(app, body)
        per_token = _send(app, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    finally:
        eng.shutdown()
    assert per_chunk["success"] and per_token["success"] and per_token["output_tokens"] == 40
    d = per_token["chunk_tokens"]
    assert sum(d) == 40 and len(d) == per_token["chunks"] and len(per_token["itl"]) == 40 - d[0]
    assert len(per_chunk["itl"]) == per_chunk["chunks"] - 1 <= len(per_token["itl"])
    assert sum(per_token["itl"]) == pytest.approx(per_token["e2e"] - per_token["ttft"], abs=0.05)


def test_serve_bench_token_itl_spreads_a_chunks_gap_over_its_tokens():
    """A scripted stream (the shape vLLM sends with a stream interval > 1): one token, then a
    chunk of two tokens with no text, then one more: per token, the middle gap is split in two
    equal gaps; per content chunk, there is one gap."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    def sse(text: str | None, tokens: int) -> str:
        choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": None}]
        usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
        return f"data: {json.dumps({'choices': choices, 'usage': usage})}\n\n"

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        async def stream():
            for text, tokens in (("a", 1), ("", 3), ("b", 4), (None, 4)):
                yield sse(text, tokens)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    per_chunk = _send(app, body)
    per_token = _send(app, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert per_token["chunk_tokens"] == [1, 2, 1] and per_token["output_tokens"] == 4
    assert len(per_token["itl"]) == 3 and per_token["itl"][0] == per_token["itl"][1]
    assert per_chunk["chunks"] == 2 and len(per_chunk["itl"]) == 1 and per_chunk["chunk_tokens"] == []


# ---------------------------------------------------------------------------------- ablation plan


def test_ablation_configs_are_all_off_each_value_all_on_without_duplicates():
    values = {"a": (False, True), "b": ("x", "y", "z")}
    cs = ablate.ablation_configs(values)
    assert [c["name"] for c in cs] == ["all-off", "a=true", "b=y", "b=z", "all-on"]
    assert ablate.ablation_configs(values, optimize=True)[-1] == {"name": "optimize", "overrides": {"optimize": True},
                                                                  "aliases": []}
    assert [c["overrides"] for c in cs] == [
        {"a": False, "b": "x"}, {"a": True, "b": "x"}, {"a": False, "b": "y"}, {"a": False, "b": "z"},
        {"a": True, "b": "z"},
    ]
    keys = [tuple(sorted(c["overrides"].items())) for c in cs]
    assert len(keys) == len(set(keys))

    one = ablate.ablation_configs({"batching": ("none", "static", "continuous")})
    assert [ablate.display_name(c) for c in one] == ["all-off", "batching=static", "batching=continuous = all-on"]

    picked = ablate.ablation_configs(values, ["b"])  # a is not varied: off everywhere
    assert [c["name"] for c in picked] == ["all-off", "b=y", "b=z"] and picked[2]["aliases"] == ["all-on"]
    assert all(c["overrides"]["a"] is False for c in picked)
    with pytest.raises(ValueError, match="not ablation flags"):
        ablate.ablation_configs(values, ["c"])


def test_speculative_decoding_is_ablated_only_when_named_and_its_json_round_trips():
    """``speculative_config`` (a JSON object) is an opt-in ablation flag: left out of the default set (the
    all-on earlier ablations measured stays as it was), there with ``--flags speculative_config``; its value
    survives ``format_overrides`` / ``parse_overrides`` (the commas inside the JSON do not split the items)
    and becomes one ``--speculative-config`` argument of the server."""
    from common import format_overrides, parse_overrides, server_flags

    from infer.config import EngineConfig

    assert "speculative_config" not in EngineConfig.ablation_values()
    values = EngineConfig.ablation_values(opt_in=["speculative_config"])
    off, on = values["speculative_config"]
    assert off is None and on["method"] == "ngram"
    cs = ablate.ablation_configs(values, ["speculative_config"])
    assert [c["overrides"]["speculative_config"] for c in cs] == [None, on]
    text = format_overrides(cs[1]["overrides"])
    assert parse_overrides(text) == cs[1]["overrides"]
    assert parse_overrides('speculative_config={"method": "ngram", "num_speculative_tokens": 2},max_num_seqs=3') == \
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}, "max_num_seqs": 3}
    flags = server_flags({"speculative_config": on})
    assert flags[0] == "--speculative-config" and json.loads(flags[1]) == on
    EngineConfig(speculative_config=json.loads(flags[1])).validate()
    with pytest.raises(ValueError, match="not a JSON object"):
        parse_overrides("speculative_config=[1, 2]")


def test_ablation_configs_the_engine_rejects_are_skipped_with_the_reason():
    values = {"batching": ("none", "continuous"), "max_num_seqs": (4, 0)}  # max_num_seqs=0 is invalid
    cs = ablate.ablation_configs(values)
    ablate.validate_configs(cs, {"model": "smollm2-135m", "device": "cpu"})
    status = {c["name"]: c["status"] for c in cs}
    assert status == {"all-off": "pending", "batching=continuous": "pending", "max_num_seqs=0": "skipped",
                      "all-on": "skipped"}
    assert all("max_num_seqs" in c["reason"] for c in cs if c["status"] == "skipped")
    assert cs[1]["engine_config"]["batching"] == "continuous" and cs[1]["engine_config"]["max_num_seqs"] == 4
    # all-on is then made of the flags usable here: batching on, max_num_seqs left at its first value
    ablate.usable_all_on(cs, values, None, {"model": "smollm2-135m", "device": "cpu"})
    assert cs[-1]["name"] == "all-on (as asked)" and cs[-1]["status"] == "skipped"
    assert "all-on" in cs[1]["aliases"]  # = batching=continuous


def test_ablate_passes_engine_flags_on_and_refuses_an_ablated_one(capsys):
    given, rest = ablate.split_engine_args(["--max-num-seqs", "16", "--temperature", "0", "--device", "cpu"])
    assert given == {"max_num_seqs": 16, "device": "cpu"} and rest == ["--temperature", "0"]
    assert ablate.server_flags({"batching": "static", "max_model_len": None, "max_num_seqs": 4}) == [
        "--batching", "static", "--max-num-seqs", "4"]
    assert ablate.main(["--dry-run", "--device", "cpu"]) == 0
    names = capsys.readouterr().out
    assert "all-off" in names and "all-on" in names
    with pytest.raises(SystemExit):
        ablate.main(["--dry-run", "--batching", "static"])


def test_ablate_single_runs_single_stream_with_the_fixed_flags_and_its_own_device_flag(tmp_path):
    from argparse import Namespace

    c = {"overrides": {"prefix_caching": True}}
    cmd = ablate.single_command(c, Namespace(model="m"), {"device": "cpu", "max_num_seqs": 4},
                                ["--prompt-lens", "16"], tmp_path / "r.json")
    assert cmd[1].endswith("single_stream.py") and cmd[-2:] == ["--prompt-lens", "16"]
    assert cmd[cmd.index("--infer-configs") + 1] == "max_num_seqs=4,prefix_caching=true"
    assert cmd[cmd.index("--device") + 1] == "cpu" and "--hf" in cmd
    rep = {"rows": [{"engine": "x", "prompt": 16, "ttft_ms": 3.0, "tpot_ms": 2.0, "tok_s": 500.0}]}
    assert ablate.single_figures(rep) == {"ttft_p50_ms": 3.0, "tpot_p50_ms": 2.0, "output_tok_per_s": 500.0,
                                          "prompt_len": 16}


def test_single_stream_gives_each_run_a_new_prompt_so_a_prefix_cache_never_hits(tiny_llama):
    import single_stream

    from infer.llm import LLM

    llm = LLM(str(tiny_llama.path), batching="continuous", kv_cache="paged", prefix_caching=True, block_size=4,
              max_model_len=64)
    prompts = [workloads.random_prompt(tiny_llama.config.vocab_size, 24, seed) for seed in range(3)]
    r = single_stream.bench_infer(llm, prompts, 3)
    assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0
    assert llm.engine.stats()["prefix_cache_hits"] == 0  # the same prompt twice would hit its 6 blocks
    single_stream.bench_infer(llm, prompts[:1] * 2, 3)
    assert llm.engine.stats()["prefix_cache_hits"] > 0


# ---------------------------------------------------------------------------------- end to end


def _check_report(rep: dict, engines: list[str]) -> None:
    for key in ("env", "model", "dtype", "engine_config", "engine_configs", "workload", "ceilings", "results",
                "rows", "skipped"):
        assert key in rep, key
    assert rep["env"]["commit"] and rep["env"]["torch"]
    w = rep["workload"]
    assert {"seed", "num_requests", "min_len", "max_len", "temperature", "ignore_eos"} <= set(w)
    assert [r["engine"] for r in rep["results"]] == engines
    for r in rep["results"]:
        assert r["tokens_ok"] and len(r["requests"]) == w["num_requests"]
        for q in r["requests"]:
            assert q["tokens"] == q["output_len"]
            assert w["min_len"] <= q["prompt_len"] <= w["max_len"]
            assert w["min_output_len"] <= q["output_len"] <= w["max_output_len"]
            assert q["ttft_ms"] is not None and q["e2e_ms"] >= q["ttft_ms"]
        assert r["output_tokens"] == sum(q["output_len"] for q in r["requests"])
        assert r["output_tok_per_s"] > 0 and r["total_tok_per_s"] > r["output_tok_per_s"]


@pytest.mark.slow
def test_offline_throughput_end_to_end_on_smollm2(tmp_path):
    out = tmp_path / "ot.json"
    rc = ot.main(["--engines", "infer", "--num-requests", "3", "--min-len", "4", "--max-len", "8",
                  "--device", "cpu", "--no-progress", "--no-ceilings", "--temperature", "0", "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    _check_report(rep, ["infer"])
    assert rep["ceilings"] is None  # --no-ceilings (they take seconds on this CPU)
    longest = max(q["prompt_len"] + q["output_len"] for q in rep["results"][0]["requests"])
    assert rep["engine_configs"]["infer"]["max_model_len"] == longest  # the KV cache is sized for the workload
    assert out.with_suffix(".md").read_text().count("| infer |") == 1


@pytest.mark.slow
def test_offline_throughput_infer_and_hf_on_the_same_checkpoint(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    model = make_checkpoint("tiny-llama", tmp_path / "tiny", dtype="float32", device="cpu")
    out, png = tmp_path / "ot.json", tmp_path / "ot.png"
    rc = ot.main(["--engines", "infer,hf,hf-compiled", "--model", str(model), "--num-requests", "3", "--min-len", "2",
                  "--max-len", "6", "--hf-batch-size", "2", "--device", "cpu", "--no-progress", "--no-ceilings",
                  "--infer-configs", "max_num_seqs=2", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    rep = json.loads(out.read_text())
    _check_report(rep, ["infer", "hf"])
    assert rep["results"][0]["label"] == "infer[max_num_seqs=2]"
    assert rep["engine_configs"]["infer[max_num_seqs=2]"]["max_num_seqs"] == 2
    assert [s["label"] for s in rep["skipped"]] == ["hf-compiled"]  # GPU only
    assert rep["results"][1]["hf_batches"] == 2 and rep["baseline"] == "hf"
    assert png.stat().st_size > 0


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_step_profile_times_the_steady_decode_batch_and_leaks_no_blocks(tmp_path, kv_cache):
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    model = make_checkpoint("tiny-llama", tmp_path / "tiny", dtype="float32", device="cpu")
    out = tmp_path / "step.json"
    # 4 requests of 4-8 prompt tokens, 20 output tokens each: step 1 prefills all four (one
    # token budget), steps 2-4 are decodes of 4 sequences, 4 tokens; 4 more unsynchronized, 2 more
    # under the profiler, 2 under cProfile
    rc = step_profile.main(["--model", str(model), "--device", "cpu", "--num-requests", "4", "--min-len", "4",
                            "--max-len", "8", "--min-output-len", "20", "--max-output-len", "20", "--skip", "1",
                            "--steps", "3", "--profile-steps", "2", "--unsync-steps", "4", "--host-profile", "2",
                            "--no-progress", "--out", str(out),
                            "--infer-configs", f"batching=continuous,kv_cache={kv_cache}"])
    assert rc == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["label"] == f"infer[batching=continuous,kv_cache={kv_cache}]"
    assert row["steps_timed"] == 3 and row["seqs_per_step"] == 4 and row["tokens_per_step"] == 4
    assert row["step_ms"] == pytest.approx(row["schedule_ms"] + row["execute_ms"] + row["output_ms"])
    assert row["execute_ms"] > 0 and row["profiled_steps"] == 2 and row["device_busy_ms"] is None  # CPU
    assert row["kv_blocks_leaked"] == 0  # the aborted rest gave every block back
    assert any(op["op"] == "aten::mm" or op["op"] == "aten::addmm" for op in row["top_host_ops"])
    # the unsynchronized window: on the CPU nothing runs ahead, so no step waits for a device
    assert row["unsync_steps"] == 4 and row["unsync_wait_ms"] == 0
    assert row["unsync_host_ms"] == pytest.approx(row["unsync_step_ms"]) and row["unsync_step_ms"] > 0
    # cProfile of 2 more steps: one engine step each, which ran one execute
    fns = {f["function"].split(":")[0] + ":" + f["function"].split("(")[-1]: f for f in row["host_functions"]}
    assert fns["llm_engine.py:step)"]["calls_per_step"] == 1
    assert fns["model_runner.py:execute)"]["cum_ms_per_step"] <= fns["llm_engine.py:step)"]["cum_ms_per_step"]


def test_step_profile_mixed_workload_times_only_mixed_steps(tmp_path):
    """--long-len: two streams decode while 40-token prompts always wait, so under a 16-token chunked
    budget every timed step is the two decodes plus a 14-token chunk (a prompt's last chunk and the
    next prompt's first share a step: three or four sequences)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    model = make_checkpoint("tiny-llama", tmp_path / "tiny", dtype="float32", device="cpu")
    out = tmp_path / "mixed.json"
    rc = step_profile.main(["--model", str(model), "--device", "cpu", "--long-len", "40", "--streams", "2",
                            "--stream-prompt-len", "4", "--max-num-batched-tokens", "16", "--skip", "2",
                            "--steps", "8", "--profile-steps", "0", "--unsync-steps", "3", "--no-progress",
                            "--out", str(out), "--infer-configs", "batching=continuous,chunked_prefill=true"])
    assert rc == 0
    rep = json.loads(out.read_text())
    (row,) = rep["results"]
    assert rep["workload"]["long_len"] == 40 and rep["workload"]["streams"] == 2
    assert row["steps_timed"] == 8 and row["tokens_per_step"] == 16 and 3 <= row["seqs_per_step"] <= 4
    assert row["kv_blocks_leaked"] == 0


def test_cpu_gemv_smoke(tmp_path):
    """The program runs, checks every way against F.linear, and reports each product and a per-token sum."""
    import cpu_gemv

    assert cpu_gemv.main(["--quick", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "cpu_gemv.json").read_text())
    assert [r["product"] for r in rep["results"]] == list(cpu_gemv.SHAPES)
    assert all(r["split_k_gb_s"] > 0 and r["linear_row_major_us"] > 0 for r in rep["results"])
    assert set(rep["per_token_ms"]) == {"linear_row_major", "mm_column_major", "split_k"}


def test_hybrid_bench_runs_both_models_then_the_kernels_alone(tmp_path):
    """benchmarks/hybrid.py at tiny shapes: a row per model and context, the floor ratio TPOT over the floor, no
    graph on the CPU; then ``--kernels`` with no contexts times the Gated DeltaNet kernels alone (the decode
    step at batch 1 and 16, the chunked prefill), the state bandwidth being the float32 states' bytes read and
    written over infer's time; neither contexts nor kernels is an error."""
    import hybrid

    from infer.kernels.triton_common import INTERPRET

    out = tmp_path / "engines"
    assert hybrid.main(["--device", "cpu", "--hybrid", "tiny-qwen3.5", "--dense", "tiny-qwen3", "--contexts", "24",
                        "40", "--steps", "3", "--out", str(out)]) == 0
    rows = json.loads((out / "hybrid.json").read_text())["rows"]
    assert [(r["model"], r["context"]) for r in rows] == [("tiny-qwen3.5", 24), ("tiny-qwen3.5", 40),
                                                          ("tiny-qwen3", 24), ("tiny-qwen3", 40)]
    for r in rows:
        assert r["tpot_ms"] > 0 and r["floor_ratio"] == pytest.approx(r["tpot_ms"] / r["floor_ms"])
        assert r["graph_steps"] == "0/3" and (r["state_mib"] > 0) == (r["model"] == "tiny-qwen3.5")
    assert (out / "hybrid.png").exists()
    if INTERPRET:  # infer's Triton decode step on CPU tensors
        out = tmp_path / "kernels"
        assert hybrid.main(["--device", "cpu", "--hybrid", "tiny-qwen3.5", "--contexts", "--kernels",
                            "--kernel-tokens", "64", "--out", str(out)]) == 0
        report = json.loads((out / "hybrid.json").read_text())
        assert report["rows"] == [] and not (out / "hybrid.png").exists()
        decode, prefill = report["kernels"][:2], report["kernels"][2]
        assert [r["op"] for r in decode] == ["decode step, batch 1", "decode step, batch 16"]
        assert prefill["op"] == "chunked prefill, 64 tokens" and prefill["torch_us"] > 0
        sys.path.insert(0, str(ROOT / "scripts"))
        from make_synthetic_checkpoint import PRESETS

        cfg = PRESETS["tiny-qwen3.5"].fields
        for r, b in zip(decode, (1, 16)):
            state = 2 * b * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4
            assert r["infer_state_gb_s"] == pytest.approx(state / r["infer_triton_us"] / 1e3)
    with pytest.raises(SystemExit):
        hybrid.main(["--device", "cpu", "--contexts"])


def test_server_path_traces_every_point_of_a_request_in_causal_order(tmp_path):
    """benchmarks/server_path.py on a tiny checkpoint with the engine in its own process: every point of a
    streamed request's path is traced for every request (the hooks reach the spawned engine process too), and
    the medians follow the request's causal order (each point happens after the one that causes it, in every
    request, so in the medians too)."""
    import server_path

    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    model = make_checkpoint("tiny-llama", tmp_path / "tiny", dtype="float32", device="cpu")
    out = tmp_path / "path.json"
    assert server_path.main(["--model", str(model), "--requests", "6", "--warmup", "2", "--prompt-len", "16",
                             "--output-len", "4", "--engine-args", "dtype=float32", "--server-args=--engine-process",
                             "--out", str(out)]) == 0
    rows = {r["point"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(server_path.POINTS) and all(r["requests"] == 6 for r in rows.values())
    chain = ["app", "body", "handler", "submit", "pipe_send", "engine_add", "engine_added", "first_step_end",
             "engine_out_sent", "first_out", "sse_send", "client"]
    medians = [rows[p]["median_ms"] for p in chain]
    assert medians == sorted(medians) and medians[0] > 0
    assert rows["engine_added"]["median_ms"] <= rows["accepted"]["median_ms"]
    assert rows["first_step_end"]["median_ms"] <= rows["second_step_end"]["median_ms"]
    assert out.with_suffix(".png").exists()


# ---------------------------------------------------------------------------------- greedy agreement

def test_greedy_agreement_counts_divergences_and_their_margins():
    import greedy_agreement as ga

    base = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]]
    margins = [[0.5, 0.5, 0.5, 0.5], [2.0, 0.01, 3.0, 3.0], [0.5, 0.5, 0.5, 0.5]]
    other = [[1, 2, 3, 4], [5, 9, 9, 9], [1, 1, 1, 2]]
    r = ga.compare(base, margins, other, tie_nats=0.2)
    assert (r["identical"], r["requests"]) == (1, 3)
    assert [(d["request"], d["first_diff"], d["near_tie"]) for d in r["diverged"]] == [(1, 1, True), (2, 3, False)]
    assert not r["all_near_ties"] and r["max_margin_at_divergence_nats"] == 0.5


def test_greedy_agreement_fp32_flags_give_identical_tokens(tmp_path):
    """In float32 on the CPU the fused forward and the overlapped loop change no greedy token."""
    import greedy_agreement as ga

    out = tmp_path / "ga.json"
    base = "batching=continuous,kv_cache=paged"
    rc = ga.main(["--num-prompts", "3", "--prompt-len", "12", "--output-len", "16", "--min-identical", "1.0",
                  "--infer-configs", f"{base};{base},fused_kernels=true,async_scheduling=true", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["passed"]
    assert report["results"][1]["identical_share"] == 1.0


def test_step_profile_stream_builds_every_requests_output_at_every_step(tmp_path):
    # --stream steps as the server does (step(stream=True)): one output per request per step,
    # against none while nothing finishes without it
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    model = make_checkpoint("tiny-llama", tmp_path / "tiny", dtype="float32", device="cpu")
    calls = {}
    for stream in (False, True):
        out = tmp_path / f"step{stream}.json"
        rc = step_profile.main(["--model", str(model), "--device", "cpu", "--num-requests", "4", "--min-len", "4",
                                "--max-len", "8", "--min-output-len", "20", "--max-output-len", "20", "--skip", "1",
                                "--steps", "3", "--profile-steps", "0", "--unsync-steps", "0", "--host-profile", "2",
                                "--top", "200", "--no-progress", "--out", str(out),
                                "--infer-configs", "batching=continuous,kv_cache=paged"] + (["--stream"] if stream else []))
        assert rc == 0
        (row,) = json.loads(out.read_text())["results"]
        assert row["label"].endswith(" stream (delta)") == stream and row["kv_blocks_leaked"] == 0
        calls[stream] = sum(f["calls_per_step"] for f in row["host_functions"] if f["function"].endswith("(make_output)"))
    assert calls == {False: 0, True: 4}


# ---------------------------------------------------------------------------------- results plots


def test_plot_results_reads_the_table_under_its_heading_and_plots_its_numbers(tmp_path):
    import plot_results

    results = tmp_path / "r.md"
    results.write_text("# t\n\n## first\n\n| a | b |\n|---|---|\n| x | 9 |\n\n"
                       "## decode\n- Command: `python benchmarks/x.py`\n\n"
                       "| model | eager | graphs |\n|---|---|---|\n| `Qwen3-0.6B` | 3.33 ms | 0.935 ms |\n"
                       "| Qwen3-4B | 7,650 | n/a |\n\nText after the table.\n\n## after\n")
    header, rows = plot_results.read_table(results, "decode")
    assert header == ["model", "eager", "graphs"]
    assert rows == [["`Qwen3-0.6B`", "3.33 ms", "0.935 ms"], ["Qwen3-4B", "7,650", "n/a"]]
    assert [plot_results.value(c) for c in ("3.33 ms", "7,650", "1.7x", "-2e-3", "n/a")] == [3.33, 7650.0, 1.7,
                                                                                               -0.002, None]
    with pytest.raises(ValueError, match="no '## missing' heading"):
        plot_results.read_table(results, "missing")
    with pytest.raises(ValueError, match="no table"):
        plot_results.read_table(results, "after")
    out = tmp_path / "p.png"
    assert plot_results.main([str(results), "--table", "decode", "--y", "eager", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="not in the table"):  # "graphs" has a cell that is no number: not default
        plot_results.plot(header, rows, ["speed"], None, "t", False, tmp_path / "q.png")


# ---------------------------------------------------------------------------------- step-trace pictures


def test_plot_trace_reads_back_the_scripted_arrivals_tokens(tiny_llama, tmp_path):
    """plot_trace.py's scripted workload, recorded and read back: the prefill tokens are the prompts'
    (3 short, the long one, 2 sharing its first tokens), the decode tokens every requested token but
    each request's first (its prefill samples it); with chunked prefill no step exceeds the budget;
    without a step trace it refuses; the picture is a PNG."""
    import argparse
    import json

    import plot_trace

    args = argparse.Namespace(device="cpu", short_len=8, long_len=40, shared_len=32, output_len=6,
                              scenario="mixed", fillers=0, filler_len=0)
    prompts = 3 * args.short_len + args.long_len + 2 * (args.shared_len + 8)
    outputs = 3 * args.output_len + args.output_len // 2 + 2 * args.output_len
    columns = []
    for name, cfg in [("whole", {}), ("chunked", {"chunked_prefill": True, "max_num_batched_tokens": 16})]:
        path = tmp_path / f"{name}.json"
        plot_trace.record(str(tiny_llama.path), {"batching": "continuous", "kv_cache": "paged", "dtype": "float32",
                                                 **cfg}, args, str(path))
        steps = plot_trace.load_steps(json.loads(path.read_text()))
        assert sum(s["prefill"] for s in steps) == prompts and sum(s["decode"] for s in steps) == outputs - 6
        assert max(s["running"] for s in steps) <= 5 and steps[-1]["kv_used"] >= 0
        if cfg:
            assert max(s["prefill"] + s["decode"] for s in steps) <= 16 == steps[0]["budget"]
        columns.append((name, steps))
    plot_trace.plot(columns, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="not a step trace|step trace"):
        plot_trace.load_steps({"traceEvents": [{"ph": "X", "name": "matmul", "pid": 1, "ts": 0, "dur": 1}]})


def _trace_args(**kw):
    import argparse

    base = dict(device="cpu", short_len=8, long_len=40, shared_len=32, output_len=8, scenario="mixed",
                fillers=4, filler_len=16, warmup=False)
    return argparse.Namespace(**{**base, **kw})


def test_plot_trace_static_batch_holds_newcomers_until_its_longest_member_ends(tiny_llama, tmp_path):
    """The ``static`` scenario read back per request: under static batching the batch's members run
    1/4..4/4 of ``output_len`` steps each, and the two newcomers (arrivals at steps 4 and 10) wait from
    their arrival until the step after the longest member's last, then run; under continuous batching
    they run at their arrival step. With ``warmup`` (static) the first run is left out of the trace (its
    steps numbered from 0, only the second run's six requests). Every panel draws."""
    import plot_trace

    got = {}
    for policy in ("static", "continuous"):
        args = _trace_args(scenario="static", warmup=policy == "static", output_len=16)
        path = tmp_path / f"{policy}.json"
        plot_trace.record(str(tiny_llama.path), {"batching": policy, "max_num_seqs": 4, "dtype": "float32",
                                                 "batch_wait_timeout_ms": 0}, args, str(path))
        trace = json.loads(path.read_text())
        steps = plot_trace.load_steps(trace)
        reqs = plot_trace.load_requests(trace, steps)
        assert steps[0]["step"] == 0 and len(reqs) == 6
        got[policy] = (steps, reqs)
    steps, reqs = got["static"]
    first, newcomers = reqs[:4], reqs[4:]
    assert [len(r["runs"]) for r in first] == [4, 8, 12, 16]  # prefill + max_tokens - 1 decodes, from step 0
    assert all(r["runs"][0] == (0, "prefill") and not r["waits"] for r in first)
    end = max(step for r in first for step, _ in r["runs"])
    for r, arrival in zip(newcomers, (4, 10)):
        assert r["waits"] == [(arrival, end, "queued")] and r["runs"][0] == (end + 1, "prefill")
    for r, arrival in zip(got["continuous"][1][4:], (4, 10)):
        assert not r["waits"] and r["runs"][0] == (arrival, "prefill")
    plot_trace.plot([("static", steps)], str(tmp_path / "all.png"), plot_trace.PANELS, [reqs])
    assert (tmp_path / "all.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_trace_offload_scenario_restores_the_evicted_prefix(tiny_llama, tmp_path):
    """The ``offload`` scenario in a 10-block cache: the fillers evict the long prompt's cached blocks.
    Without a tier the last request prefills its whole prompt; with ``kv_offload=host`` its shared
    blocks come back from the host tier (``restored``) and it prefills only the rest; the host tier's
    counter ends at the blocks copied down (a tier that never fills loses none)."""
    import plot_trace
    import torch

    args = _trace_args(scenario="offload", fillers=5)
    block = 16 * tiny_llama.config.kv_bytes_per_token(torch.float32)
    last_prefill = {}
    for mode in ("none", "host"):
        path = tmp_path / f"{mode}.json"
        plot_trace.record(str(tiny_llama.path), {"batching": "continuous", "kv_cache": "paged", "dtype": "float32",
                                                 "prefix_caching": True, "kv_cache_memory_bytes": 10 * block,
                                                 "kv_offload": mode}, args, str(path))
        steps = plot_trace.load_steps(json.loads(path.read_text()))
        assert not any(s["preemptions"] for s in steps)
        last_prefill[mode] = [s["prefill"] for s in steps if s["prefill"]][-1]
        if mode == "none":
            assert all(s["host_blocks"] is None and not s["offloaded"] for s in steps)
        else:
            restored = sum(s["restored"] for s in steps)
            assert restored == args.shared_len // 16 and steps[-1]["host_blocks"] == sum(s["offloaded"] for s in steps)
    assert last_prefill == {"none": args.shared_len + 8, "host": 8}
