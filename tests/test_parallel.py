"""Tensor and expert parallelism (phases 14-15) on 2 CPU ranks over gloo.

Reference: the same engine with one rank on the same weights (fp32). Checked: greedy tokens of a
dense model with split KV heads (tiny Llama; paged cache, chunked prefill, n = 2 forks, prompt
logprobs: every command the workers run), of one with a single KV head copied to both ranks and
tied embeddings (tiny Gemma 3, fused forward), of Qwen3-MoE with tensor-parallel experts and with
expert parallelism (dynamic and fixed-capacity dispatch); two "machines" on this host (nnodes=2,
node 1 a separate `infer.server --node-rank 1` process); a worker killed mid-request ends the
request with an error and the server reports it (503) instead of hanging; SIGTERM to an engine
process leaves no worker behind; validate_model's reasons.

The layers' collectives are also graded in one process (the exercises): two threads, each with
its own gloo group over a shared in-memory store, play the two ranks.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from infer.config import EngineConfig
from infer.engine import LLMEngine
from infer.errors import ParallelWorkerError
from infer.parallel.state import ParallelState, building_for, shard
from infer.sampling import SamplingParams

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42, 9], list(range(40, 77)), [250, 11]]


def _checkpoint(tmp_path_factory, preset: str) -> Path:
    sys.path.insert(0, str(SCRIPTS))
    from make_synthetic_checkpoint import make_checkpoint

    return make_checkpoint(preset, tmp_path_factory.mktemp(preset), dtype="float32", device="cpu")


def _run(engine: LLMEngine, prompts, params) -> list:
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return reqs


def _tokens(reqs) -> list[list[list[int]]]:
    return [[list(s.output_token_ids) for s in r.seqs] for r in reqs]


def _pair(path: Path, par: dict, **kw):
    """``(one-rank engine, parallel engine)`` on the same checkpoint and flags."""
    base = dict(model=str(path), device="cpu", dtype="float32", max_model_len=128, **kw)
    one = LLMEngine(EngineConfig(**base), progress=False)
    many = LLMEngine(EngineConfig(**base, **par), progress=False)
    return one, many


# ---------------------------------------------------------------------------- dense models


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "tiny-llama")


@pytest.fixture
def llama_tp(llama_path):
    """tiny Llama (4 query heads, 2 KV heads: one per rank), paged, chunked prefill of 16 tokens.
    (One parallel engine per process at a time: torch.distributed's default group.)"""
    one, many = _pair(llama_path, {"tensor_parallel_size": 2}, kv_cache="paged", block_size=8,
                      chunked_prefill=True, max_num_batched_tokens=16, batching="continuous")
    yield one, many
    many.shutdown()


def test_tensor_parallel_dense_greedy_equals_one_rank(llama_tp):
    one, many = llama_tp
    attn = many.runner.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # this rank's share
    assert many.runner.model.lm_head.weight.shape[0] == one.vocab_size // 2
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=2)
    forks = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2)  # the COPY command
    ref = _run(one, PROMPTS, params) + _run(one, [PROMPTS[0]], forks)
    got = _run(many, PROMPTS, params) + _run(many, [PROMPTS[0]], forks)
    assert _tokens(got) == _tokens(ref)
    for a, b in zip(got[:3], ref[:3]):  # prompt logprobs: the LOGITS command over slices
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert [t.token_id for t in pa.top] == [t.token_id for t in pb.top]
            for ta, tb in zip([pa.token, *pa.top], [pb.token, *pb.top]):
                assert ta.token_id == tb.token_id and abs(ta.logprob - tb.logprob) < 1e-4


def test_tensor_parallel_replicated_kv_head_fused(tmp_path_factory):
    """tiny Gemma 3: 4 query heads, 1 KV head (copied to both ranks), tied embeddings, fused ops."""
    path = _checkpoint(tmp_path_factory, "tiny-gemma3")
    one, many = _pair(path, {"tensor_parallel_size": 2}, fused_kernels=True)
    try:
        attn = many.runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert _tokens(_run(many, PROMPTS, GREEDY)) == _tokens(_run(one, PROMPTS, GREEDY))
    finally:
        many.shutdown()


# ---------------------------------------------------------------------------- MoE


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "tiny-qwen3-moe")  # 8 experts, top-2, layer 1 dense


@pytest.mark.parametrize("par", [{"tensor_parallel_size": 2}, {"expert_parallel_size": 2},
                                 {"expert_parallel_size": 2, "all2all_backend": "fixed_capacity"}],
                         ids=["tp", "ep", "ep-fixed-capacity"])
def test_moe_parallel_greedy_equals_one_rank(moe_path, par):
    one, many = _pair(moe_path, par, batching="continuous")
    try:
        experts = many.runner.model.model.layers[0].mlp.experts
        if "expert_parallel_size" in par:  # whole experts, half of them
            assert (experts.num_local_experts, experts.expert_start) == (4, 0)
        else:  # every expert, half its columns
            assert experts.num_local_experts == 8 and experts.down_proj.shape[-1] == 16
        assert _tokens(_run(many, PROMPTS, GREEDY)) == _tokens(_run(one, PROMPTS, GREEDY))
    finally:
        many.shutdown()


# ---------------------------------------------------------------------------- two machines


def test_two_nodes_one_rank_each_equal_one_rank(llama_path):
    """nnodes=2 on one host: node 1 is `python -m infer.server --node-rank 1` (it only runs its rank,
    rank 1), node 0 an engine here (rank 0); they meet at 127.0.0.1:port over gloo and give one rank's
    greedy tokens; node 0's shutdown ends node 1 cleanly."""
    from infer.engine.executor import _free_port

    port = _free_port()
    flags = dict(model=str(llama_path), device="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=2,
                 nnodes=2, master_addr="127.0.0.1", master_port=port)
    argv = [sys.executable, "-m", "infer.server"]
    for name, value in {**flags, "node_rank": 1}.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    node1 = subprocess.Popen(argv, env=os.environ.copy(), stderr=subprocess.PIPE, text=True)
    try:
        node0 = LLMEngine(EngineConfig(**flags, node_rank=0), progress=False)
        try:
            assert node0.workers.procs == []  # every other rank is on node 1
            got = _tokens(_run(node0, PROMPTS, GREEDY))
        finally:
            node0.shutdown()
        assert node1.wait(30) == 0, node1.stderr.read()
    finally:
        node1.kill()
        node1.wait()
    one = LLMEngine(EngineConfig(**{k: v for k, v in flags.items() if k in ("model", "device", "dtype",
                                                                        "max_model_len")}), progress=False)
    assert got == _tokens(_run(one, PROMPTS, GREEDY))


def test_rendezvous_url_of_one_machine_and_of_several(monkeypatch):
    from infer.engine.executor import local_world_size, rendezvous_url

    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29555")
    one = EngineConfig(device="cpu", tensor_parallel_size=2)
    assert rendezvous_url(one).startswith("tcp://127.0.0.1:")  # one machine: torchrun's variables unused
    two = EngineConfig(device="cpu", tensor_parallel_size=4, nnodes=2)
    assert rendezvous_url(two) == "tcp://10.1.2.3:29555" and local_world_size(two) == 2
    assert rendezvous_url(EngineConfig(device="cpu", tensor_parallel_size=4, nnodes=2, master_addr="h",
                                       master_port=1234)) == "tcp://h:1234"  # the fields win
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT")
    assert rendezvous_url(two) == "tcp://127.0.0.1:29500"


# ---------------------------------------------------------------------------- failures


def test_worker_killed_mid_request_fails_it_and_server_reports(llama_tp):
    """Rank 1 is SIGKILLed in the middle of a decode step (after the forward, before the logits'
    gather): the request ends with an error naming the rank, /health says 503, the worker is reaped,
    and the engine refuses later steps at once."""
    pytest.importorskip("fastapi")
    import httpx

    from infer.server.app import build_app
    from infer.server.async_engine import AsyncEngine

    _, many = llama_tp
    worker = many.workers.procs[0]
    logits, calls = many.runner._logits, []

    def dying_logits(*args):
        calls.append(1)
        if len(calls) == 5:
            os.kill(worker.pid, signal.SIGKILL)
        return logits(*args)

    many.runner._logits = dying_logits
    ae = AsyncEngine(many)
    app = build_app(ae, "tiny")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                events = [line async for line in r.aiter_lines() if line]
            for _ in range(100):  # the engine thread stops just after it has ended the streams
                health = await c.get("/health")
                if health.status_code != 200:
                    break
                await asyncio.sleep(0.05)
            return events, health.status_code

    try:
        events, health = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        ae.shutdown()
    assert len(events) >= 3 and '"finish_reason": "length"' not in "".join(events)  # tokens, then the failure
    assert '"error"' in events[-2] and "rank 1" in events[-2], events[-2:]
    assert health == 503
    assert not worker.is_alive() and worker.exitcode == -signal.SIGKILL
    with pytest.raises(ParallelWorkerError, match="rank 1"):
        many.workers.check()


def test_sigterm_leaves_no_worker(llama_path, tmp_path_factory):
    path = llama_path
    script = textwrap.dedent(f"""
        from infer.config import EngineConfig
        from infer.engine import LLMEngine
        if __name__ == "__main__":
            e = LLMEngine(EngineConfig(model={str(path)!r}, device="cpu", tensor_parallel_size=2, max_model_len=64),
                          progress=False)
            print(*[p.pid for p in e.workers.procs], flush=True)
            import time; time.sleep(120)
    """)
    f = tmp_path_factory.mktemp("sigterm") / "engine.py"
    f.write_text(script)
    proc = subprocess.Popen([sys.executable, str(f)], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------------------- validation


def test_validate_rejects_sizes_that_do_not_split_the_model(smollm2, gemma3):
    with pytest.raises(ValueError, match="9 query heads do not split evenly"):
        EngineConfig(tensor_parallel_size=2).validate_model(smollm2.config)
    with pytest.raises(ValueError, match="9 query heads"):  # the engine reads the GGUF header for it, no rank starts
        LLMEngine(EngineConfig(model=str(smollm2.path), device="cpu", tensor_parallel_size=2))
    EngineConfig(tensor_parallel_size=2).validate_model(gemma3.config)  # 4 heads, 1 KV head: copied
    with pytest.raises(ValueError, match="no experts"):
        EngineConfig(expert_parallel_size=2).validate_model(gemma3.config)
    with pytest.raises(ValueError, match="must be equal"):
        EngineConfig(tensor_parallel_size=2, expert_parallel_size=4).validate()
    with pytest.raises(ValueError, match="cuda_graphs with expert_parallel_size > 1"):
        EngineConfig(expert_parallel_size=2, cuda_graphs=True).validate()


def test_a_failed_parallel_start_raises_its_own_error(llama_path):
    """A start that fails before the engine is built reports why (here: a preloaded model, which a
    parallel engine cannot use), not an AttributeError from the cleanup of half-built state."""
    from infer.loader import load_model

    loaded = load_model(str(llama_path), torch.device("cpu"), torch.float32, progress=False)
    with pytest.raises(ValueError, match="preloaded model"):
        LLMEngine(EngineConfig(model=str(llama_path), device="cpu", tensor_parallel_size=2), loaded=loaded,
                  progress=False)


def test_shard_cuts_halves_of_a_stacked_tensor():
    t = torch.arange(2 * 8 * 3).view(2, 8, 3)  # [E, 2I, H]: gate rows 0-3, up rows 4-7
    got = shard(t, (1, 1, 2, 2))
    assert torch.equal(got, torch.cat([t[:, 2:4], t[:, 6:8]], dim=1))
    assert torch.equal(shard(t, (0, 1, 2)), t[1:])


# ---------------------------------------------------------------------------- two ranks as threads


def two_ranks(fn):
    """Run ``fn(rank, state)`` on 2 threads, each a rank with its own gloo group; returns the results."""
    store = dist.HashStore()
    out, errors = [None, None], []

    def group(r):  # what init_process_group builds, without the one-per-process default group
        pg = dist.ProcessGroup(store, r, 2)
        backend = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=30))
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        return pg

    def run(r):
        try:
            pg = group(r)
            with torch.inference_mode():  # grad mode is per thread
                out[r] = fn(r, ParallelState(r, 2, tp=True, group=pg, cpu_group=pg))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _load(module: nn.Module, full: dict[str, torch.Tensor]) -> nn.Module:
    """Fill a rank's module from a full state dict as the loader does (each tensor's shard)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(shard(full[name], getattr(p, "tp_shard", None)))
    return module


def test_column_row_parallel_pair_equals_one_linear():
    from infer.models.layers import RowParallelLinear

    torch.manual_seed(0)
    w1, w2, b2, x = torch.randn(12, 6), torch.randn(5, 12), torch.randn(5), torch.randn(3, 6)
    want = torch.nn.functional.linear(torch.relu(x @ w1.T), w2, b2)
    want_no_bias = torch.nn.functional.linear(torch.relu(x @ w1.T), w2)

    def rank(r, ps):
        with building_for(ps):
            down = RowParallelLinear(6, 5)
            down_no_bias = RowParallelLinear(6, 5, bias=False)  # as Llama's o_proj and down_proj
        up = w1[r * 6:(r + 1) * 6]  # this rank's columns of the first layer (no communication)
        with torch.no_grad():
            down.weight.copy_(w2[:, r * 6:(r + 1) * 6])
            down.bias.copy_(b2)
            down_no_bias.weight.copy_(w2[:, r * 6:(r + 1) * 6])
        h = torch.relu(x @ up.T)
        return down(h), down_no_bias(h)

    for got, got_no_bias in two_ranks(rank):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_no_bias, want_no_bias, rtol=1e-5, atol=1e-5)


def test_vocab_parallel_embedding_equals_one_table():
    from infer.models.layers import VocabParallelEmbedding

    torch.manual_seed(0)
    table, ids = torch.randn(10, 4), torch.tensor([0, 9, 4, 5, 5, 1])

    def rank(r, ps):
        with building_for(ps):
            emb = VocabParallelEmbedding(10, 4)
        return _load(emb, {"weight": table})(ids)

    for got in two_ranks(rank):
        assert torch.equal(got, table[ids])


def test_expert_parallel_moe_equals_all_experts_on_one_rank():
    from infer.config import ModelConfig, RopeConfig
    from infer.models.moe import SparseMoeBlock

    # 6 experts, 3 per rank: an expert's rank is its id // 3 (not // 2, the number of ranks)
    cfg = ModelConfig("qwen3_moe", 64, 8, 16, 1, 2, 2, 4, 1e-6, 64, RopeConfig(1e4), num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=6, norm_topk_prob=True)
    torch.manual_seed(0)
    full = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.5)
    state = dict(full.state_dict())
    for t in (5, 1):  # 5 tokens: chunks of 3 and 2; 1 token: rank 1 has none
        x = torch.randn(t, 8)
        with torch.inference_mode():
            want = full(x)

        rows = [0, 0]  # the rows each rank's experts computed

        def rank(r, ps, x=x, rows=rows):
            ps.ep = True
            with building_for(ps):
                block = _load(SparseMoeBlock(cfg), state)
            forward = block.experts.forward

            def counted(h, *args, **kwargs):
                rows[r] += h.shape[0]
                return forward(h, *args, **kwargs)

            block.experts.forward = counted
            return block(x)

        for got in two_ranks(rank):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # each (token, expert) pair is computed once, by the rank holding the expert: a rank works on
        # its own chunk of the tokens, not on all of them
        assert sum(rows) == t * cfg.num_experts_per_tok, rows


def test_fixed_capacity_dispatch_equals_dynamic_and_drops_only_overflow():
    """all2all_backend='fixed_capacity' on two gloo ranks (threads): with the default (worst-case)
    capacity it equals the dynamic dispatch and one rank holding every expert; with a capacity
    factor that overflows, each dropped pair (beyond the capacity of its destination rank, in token
    order) is exactly the one missing from the sum."""
    from infer.config import ModelConfig, RopeConfig
    from infer.kernels import moe_reference
    from infer.models.moe import SparseMoeBlock
    from infer.parallel.moe import dispatch_capacity

    cfg = ModelConfig("qwen3_moe", 64, 8, 16, 1, 2, 2, 4, 1e-6, 64, RopeConfig(1e4), num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=6, norm_topk_prob=True)
    torch.manual_seed(0)
    full = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.5)
    state = dict(full.state_dict())
    k, w, e_local = 2, 2, 3
    x = torch.randn(7, 8)  # chunks of 4 and 3 tokens
    with torch.inference_mode():
        want = full(x)
        weights, ids = full.route(x)

    def run(all2all, factor=None):
        def rank(r, ps):
            ps.ep, ps.all2all, ps.capacity_factor = True, all2all, factor
            with building_for(ps):
                block = _load(SparseMoeBlock(cfg), state)
            return block(x)
        return two_ranks(rank)

    dynamic, fixed = run("dynamic"), run("fixed_capacity")
    for d, f in zip(dynamic, fixed):
        torch.testing.assert_close(f, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(f, d, rtol=1e-6, atol=1e-7)
    assert dispatch_capacity(4, k, e_local, w) == 8  # worst case: every pair of a chunk to one rank

    # overflow: capacity 2 rows per destination; the reference drops, per source chunk and destination
    # rank, every pair after the first 2 (pairs in token order), computed here with plain loops
    factor = 0.5
    kept = torch.ones_like(weights, dtype=torch.bool)
    for lo, hi in ((0, 4), (4, 7)):
        cap = dispatch_capacity(4, k, e_local, w, factor)
        assert cap == 2
        seen = [0] * w
        for t in range(lo, hi):
            for j in range(k):
                d = int(ids[t, j]) // e_local
                kept[t, j] = seen[d] < cap
                seen[d] += 1
    assert not kept.all(), "the case must overflow"
    with torch.inference_mode():
        want_dropped = moe_reference.fused_experts(x, full.experts.gate_up_proj, full.experts.down_proj,
                                                   weights * kept, ids)
    for got in run("fixed_capacity", factor):
        torch.testing.assert_close(got, want_dropped, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- GPUs (NCCL)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("preset,par", [("tiny-llama", {"tensor_parallel_size": 2}),
                                        ("tiny-qwen3-moe", {"tensor_parallel_size": 2}),
                                        ("tiny-qwen3-moe", {"expert_parallel_size": 2}),
                                        ("tiny-llama", {"tensor_parallel_size": 2, "cuda_graphs": True,
                                                        "fused_kernels": True, "async_scheduling": True}),
                                        ("tiny-qwen3-moe", {"tensor_parallel_size": 2, "cuda_graphs": True}),
                                        ("tiny-llama", {"tensor_parallel_size": 2, "cuda_graphs": True,
                                                        "fused_kernels": True, "async_scheduling": True,
                                                        "pdl": True}),
                                        ("tiny-llama", {"tensor_parallel_size": 2, "all_reduce_backend": "symm_mem"}),
                                        ("tiny-llama", {"tensor_parallel_size": 2, "cuda_graphs": True,
                                                        "fused_kernels": True, "all_reduce_backend": "symm_mem",
                                                        "symm_mem_one_shot_max_bytes": 0}),
                                        ("tiny-llama", {"tensor_parallel_size": 2, "cuda_graphs": True,
                                                        "fused_kernels": True, "async_scheduling": True,
                                                        "all_reduce_backend": "symm_mem"}),
                                        ("tiny-qwen3-moe", {"expert_parallel_size": 2,
                                                            "all2all_backend": "fixed_capacity"}),
                                        ("tiny-qwen3-moe", {"expert_parallel_size": 2, "cuda_graphs": True,
                                                            "all2all_backend": "fixed_capacity"})])
def test_two_gpus_greedy_equals_one_gpu_fp32(tmp_path_factory, preset, par):
    """The same code over NCCL on 2 GPUs (Triton attention and experts), fp32: tokens equal one GPU's
    eager run, also when every rank replays captured decode graphs (3 sequences: bucket 4, one
    padding row) with async scheduling patching the input ids on rank 0, with every rank's kernels
    launched with PDL (Hopper), with the all-reduces on symmetric memory (one-shot, and two-shot
    forced), and with expert parallelism's fixed-capacity dispatch, eager and in graphs."""
    sys.path.insert(0, str(SCRIPTS))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint(preset, tmp_path_factory.mktemp(preset), dtype="float32", device="cuda")
    base = dict(model=str(path), device="cuda", dtype="float32", max_model_len=128, batching="continuous")
    one = LLMEngine(EngineConfig(**base), progress=False)
    ref = _tokens(_run(one, PROMPTS, GREEDY))
    del one
    many = LLMEngine(EngineConfig(**base, **par), progress=False)
    try:
        assert _tokens(_run(many, PROMPTS, GREEDY)) == ref
    finally:
        many.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("flags", [{}, {"cuda_graphs": True, "fused_kernels": True}], ids=["eager", "graphs"])
def test_two_nodes_of_two_gpus_equal_one_gpu_fp32(tmp_path_factory, flags):
    """TP=4 as 2 "nodes" x 2 GPUs of one host (NCCL): node 1 is `python -m infer.server --node-rank 1`
    seeing GPUs 2 and 3, node 0 an engine here on GPUs 0 and 1; one GPU's greedy tokens."""
    from infer.engine.executor import _free_port

    sys.path.insert(0, str(SCRIPTS))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint("tiny-llama", tmp_path_factory.mktemp("two-nodes"), dtype="float32", device="cuda")
    base = dict(model=str(path), device="cuda", dtype="float32", max_model_len=128, batching="continuous", **flags)
    one = LLMEngine(EngineConfig(**base), progress=False)
    ref = _tokens(_run(one, PROMPTS, GREEDY))
    del one
    multi = dict(base, tensor_parallel_size=4, nnodes=2, master_addr="127.0.0.1", master_port=_free_port())
    argv = [sys.executable, "-m", "infer.server"]
    for name, value in {**multi, "node_rank": 1}.items():
        argv += [f"--{name.replace('_', '-')}"] if value is True else [f"--{name.replace('_', '-')}", str(value)]
    node1 = subprocess.Popen(argv, env={**os.environ, "CUDA_VISIBLE_DEVICES": "2,3"}, stderr=subprocess.PIPE, text=True)
    try:
        node0 = LLMEngine(EngineConfig(**multi, node_rank=0), progress=False)
        try:
            assert _tokens(_run(node0, PROMPTS, GREEDY)) == ref
        finally:
            node0.shutdown()
        assert node1.wait(60) == 0, node1.stderr.read()
    finally:
        node1.kill()
        node1.wait()
