"""Phase 17 x phase 9: CUDA graphs for the decode steps of a hybrid model (Qwen3.5).

A decode graph of a hybrid model reads each row's recurrent-state slot from its packed static inputs,
derives on the device whether the slot holds a state yet (``position > 0``), and sends its padding rows
to the state cache's padding slot (:mod:`infer.engine.cuda_graphs`). References: Hugging Face
transformers' ``qwen3_5`` ``generate`` on the CPU (the tiny random ``tiny-qwen3.5`` checkpoint of
scripts/make_synthetic_checkpoint.py), the eager engine, and the state slots a step does not own (they
must come out of a replay bit for bit unchanged).

On the CPU the graph runner's own staging and decode forward run without capture (a stand-in
``replay`` calls :meth:`CUDAGraphRunner._decode_forward` eagerly, the Triton kernels interpreted); on a
GPU (``-m gpu``) the captured graphs run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from infer.config import EngineConfig
from infer.engine.cuda_graphs import CUDAGraphRunner, bucket_for, stage_decodes
from infer.kernels.triton_common import INTERPRET
from infer.sampling import SamplingParams
from tests.hf_reference import hf_qwen35_plain_pytorch
from tests.test_batching import assert_pool_full, drive, make_engine, mixed_workload
from tests.test_generation import hf_greedy

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """``tiny-qwen3.5`` in float32, and HF's model of it on the CPU (HF's reference runs on CPU tensors, through its
    plain-PyTorch rules)."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint("tiny-qwen3.5", tmp_path_factory.mktemp("tiny-qwen3.5-graphs"), dtype="float32",
                           device="cpu")
    with hf_qwen35_plain_pytorch():  # (on a GPU machine with flash-linear-attention: not its kernels on the CPU)
        yield path, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_cpu(tiny_ckpt):
    return _load(tiny_ckpt[0], "cpu")


def _load(path, device: str):
    from infer.loader import load_model

    return load_model(str(path), device=device, dtype=torch.float32, progress=False)


def _assert_state_slots_free(engine) -> None:
    """Every sequence slot back in the free list, once; the padding slot never handed out."""
    kv, state = engine.kv_manager, engine.runner.state_cache
    snapshots = engine.runner.num_snapshot_slots if kv.prefix_caching else 0  # after the sequences' slots
    assert sorted(kv.free_state_slots) == list(range(kv.num_state_slots))
    assert state.num_slots == kv.num_state_slots + snapshots
    assert state.pad_slot == state.num_slots and state.conv.shape[1] == state.num_slots + 1


def _slots_consistent(engine) -> None:
    kv = engine.kv_manager
    held = [s.state_slot for s in engine.scheduler.running]
    assert all(0 <= s < kv.num_state_slots for s in held) and len(set(held)) == len(held)
    assert sorted(held + kv.free_state_slots) == list(range(kv.num_state_slots))


def _guard_other_slots(graphs: CUDAGraphRunner, seen: list[tuple[int, int]]) -> None:
    """Wrap ``graphs.replay``: the state slots the step's sequences do not own (free ones included)
    come out of every replay bit for bit unchanged; note each replay's (rows, bucket)."""
    state, real = graphs.state_cache, graphs.replay

    def replay(seqs, patch=None):
        mine = {s.state_slot for s in seqs}
        others = torch.tensor([i for i in range(state.num_slots) if i not in mine], dtype=torch.int64,
                              device=state.conv.device)
        before = state.conv[:, others].clone(), state.ssm[:, others].clone()
        out = real(seqs, patch)
        assert torch.equal(state.conv[:, others], before[0]) and torch.equal(state.ssm[:, others], before[1]), \
            "a replay wrote a state slot its rows do not own"
        seen.append((len(seqs), bucket_for(len(seqs), graphs.sizes)))
        return out

    graphs.replay = replay


def _uncaptured_graphs(engine, max_batch_size: int) -> CUDAGraphRunner:
    """Give a CPU engine the graph runner's decode route, each bucket's "graph" its decode forward run
    eagerly on the static buffers (what a capture records), and a state cache with the padding slot."""
    from infer.attention.state_cache import RecurrentStateCache

    runner = engine.runner
    state = RecurrentStateCache.for_model(runner.config, runner.state_cache.num_slots, runner.dtype, runner.device,
                                          pad_slot=True)
    runner.state_cache = state
    width = -(-runner.max_model_len // runner.kv_cache.block_size)
    graphs = CUDAGraphRunner(runner.model, runner.kv_cache, max_batch_size, width, runner.max_model_len,
                             attention_backend=runner.attention_backend, state_cache=state)

    class Uncaptured:
        def __init__(self, bs: int) -> None:
            self.bs = bs

        def replay(self) -> None:
            graphs.logits[self.bs] = graphs._decode_forward(self.bs)

    for bs in graphs.sizes:
        graphs.graphs[bs] = Uncaptured(bs)
    runner.graphs = graphs
    return graphs


# prompts (a one-token one among them: its slot is read as zeros) arriving while others decode
CPU_ARRIVALS = [(0, [5, 6, 7], 9), (2, [300] * 9, 3), (3, [42], 2), (4, list(range(200, 212)), 3)]


def _arrivals_give_hf_tokens(engine, graphs: CUDAGraphRunner, hf) -> list[tuple[int, int]]:
    """Drive :data:`CPU_ARRIVALS` (greedy) through ``engine``, its state slots checked every step and the
    graphs' other slots guarded; each request's tokens are HF's. Returns the (batch, bucket) pairs the
    graphs ran."""
    seen: list[tuple[int, int]] = []
    _guard_other_slots(graphs, seen)
    arrivals = [(t, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for t, p, n in CPU_ARRIVALS]
    got = drive(engine, arrivals, check=_slots_consistent)
    for i, (_, prompt, n) in enumerate(CPU_ARRIVALS):
        ref = hf_greedy(hf, prompt, n)
        assert got[i][0][: len(ref)] == ref, f"prompt {i}"
    return seen


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors through Triton kernels need TRITON_INTERPRET=1 (on a GPU "
                    "machine: tests/test_gpu_phases.py)")
def test_decode_graph_inputs_give_hf_tokens_on_cpu(tiny_ckpt, tiny_cpu):
    """The graph route's static inputs (packed state slots, padding rows on the padding slot, flags from
    the positions) run eagerly on the CPU with the Triton kernels interpreted and async scheduling (the
    sampled tokens patched into the packed inputs): batches of 1, 2, 3 (a bucket of 4 with one padding
    row) and 4 sequences, a one-token prompt among decodes; HF's greedy tokens, no replay touching
    another sequence's slot, the padding slot written, and every slot free at the end."""
    _, hf = tiny_ckpt
    loaded = tiny_cpu
    engine = make_engine(loaded, max_model_len=32, max_num_seqs=4, batching="continuous", kv_cache="paged",
                         block_size=8, attention_backend="triton", async_scheduling=True)
    graphs = _uncaptured_graphs(engine, 4)
    assert graphs.sizes == [1, 2, 4] and graphs.num_vectors == 5
    seen = _arrivals_give_hf_tokens(engine, graphs, hf)
    assert (3, 4) in seen, f"no bucket with a padding row: {seen}"
    assert {bucket for _, bucket in seen} == {1, 2, 4}, seen
    pad = engine.runner.state_cache.pad_slot
    assert engine.runner.state_cache.conv[:, pad].abs().sum() > 0, "the padding rows wrote elsewhere"
    assert_pool_full(engine)
    _assert_state_slots_free(engine)


def test_stage_decodes_puts_state_slots_before_the_tables():
    """The fifth vector of a hybrid model's packed step: the rows' state slots, the padding slot past
    them; the block tables after it; a row without a slot is refused (its kernels would write out of
    bounds)."""
    import numpy as np

    from infer.engine.step import BlockTableRows

    class Seq:
        def __init__(self, tokens, computed, table, slot):
            self.token_ids, self.num_computed_tokens, self.block_table, self.state_slot = tokens, computed, table, slot

    seqs = [Seq([1, 2, 3, 4], 3, [5], 2), Seq([9] * 6, 5, [7, 3], 0), Seq([8], 0, [1], 3)]
    bs, pad = 4, 6
    h = np.full(5 * bs + 3 * 2, -7, dtype=np.int64)
    width, rows = stage_decodes(seqs, BlockTableRows(8, 4), 4, h, bs, state_pad_slot=pad)
    assert width == 2 and rows is None
    assert h[:bs].tolist() == [4, 9, 8, 0] and h[bs: 2 * bs].tolist() == [3, 5, 0, 0]
    assert h[2 * bs: 3 * bs].tolist() == [5 * 4 + 3, 3 * 4 + 1, 1 * 4 + 0, -1]
    assert h[3 * bs: 4 * bs].tolist() == [4, 6, 1, 0]
    assert h[4 * bs: 5 * bs].tolist() == [2, 0, 3, pad]
    tables = h[5 * bs:].reshape(3, 2)
    assert tables[0, 0] == 5 and tables[1].tolist() == [7, 3] and tables[2, 0] == 1
    seqs[1].state_slot = -1
    with pytest.raises(RuntimeError, match="no recurrent-state slot"):
        stage_decodes(seqs, BlockTableRows(8, 4), 4, h, bs, state_pad_slot=pad)


def test_hybrid_config_keeps_decode_graphs_and_refuses_prefill_graphs(tiny_cpu):
    """With cuda_graphs (resolved for a CUDA device without needing one) a hybrid model keeps its decode
    graphs and turns the default prefill / mixed-step sizes off with the reason; sizes asked for
    explicitly are an error; the graph runner refuses a state cache without its padding slot."""
    from infer.attention.state_cache import RecurrentStateCache

    model_cfg = tiny_cpu.config
    cuda = torch.device("cuda")
    cfg = EngineConfig(model="x", cuda_graphs=True)
    cfg._resolve_unset(cuda)
    assert cfg.cuda_graph_prefill_max_tokens == 2048
    cfg.validate_model(model_cfg)
    assert cfg.cuda_graphs and (cfg.cuda_graph_prefill_max_tokens, cfg.cuda_graph_mixed_max_tokens) == (0, 0)
    assert "decode graphs only" in cfg.optimization_notes["cuda_graph_prefill_max_tokens"]
    cfg = EngineConfig(model="x", cuda_graphs=True, cuda_graph_prefill_max_tokens=64)
    cfg._resolve_unset(cuda)
    with pytest.raises(ValueError, match="cuda_graph_prefill_max_tokens is not supported for hybrid models"):
        cfg.validate_model(model_cfg)
    state = RecurrentStateCache.for_model(model_cfg, 2, torch.float32, "cpu")
    assert state.pad_slot is None
    with pytest.raises(ValueError, match="padding slot"):
        CUDAGraphRunner(None, None, 4, 4, 32, state_cache=state)


# ---------------------------------------------------------------------------------- fused kernels


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors through Triton kernels need TRITON_INTERPRET=1 (on a GPU "
                    "machine: tests/test_gpu_phases.py)")
def test_fused_forward_gives_hf_logits_and_tokens(tiny_ckpt, tiny_cpu):
    """``fused_kernels`` for the hybrid (norms fused with the residual add, the fused MLP, the LM head
    through ``ops.linear``): teacher-forced logits of a 24-token and a one-token prompt within 1e-4 of
    HF's with the plain-PyTorch ops and with the Triton kernels (interpreted); and an engine with
    fused kernels, chunked prefill (a 16-token budget) and async scheduling gives HF's greedy tokens."""
    from infer.attention import TorchAttentionBackend
    from infer.kernels import fused_reference, fused_triton
    from tests.hf_reference import hf_logits, infer_logits

    _, hf = tiny_ckpt
    model = tiny_cpu.model
    seqs = [[(7 * i + 3) % 500 for i in range(24)], [42]]
    refs = [hf_logits(hf, seq) for seq in seqs]
    try:
        model.set_attention_backend(TorchAttentionBackend())
        for ops in (fused_reference, fused_triton):
            model.set_fused_ops(ops)
            for got, ref in zip(infer_logits(model, seqs), refs):
                assert (got - ref).abs().max().item() <= 1e-4, (ops.__name__, (got - ref).abs().max().item())
    finally:
        model.set_fused_ops(None)
    prompts = [(0, [5, 6, 7], 6), (1, list(range(100, 140)), 5), (2, [42], 4)]
    engine = make_engine(tiny_cpu, max_model_len=64, max_num_seqs=4, batching="continuous", kv_cache="paged",
                         block_size=8, chunked_prefill=True, max_num_batched_tokens=16, async_scheduling=True,
                         fused_kernels=True)
    assert model.ops is fused_reference
    got = drive(engine, [(t, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for t, p, n in prompts],
                check=_slots_consistent)
    for i, (_, prompt, n) in enumerate(prompts):
        ref = hf_greedy(hf, prompt, n)
        assert got[i][0][: len(ref)] == ref, f"prompt {i}"
    assert engine.scheduler.num_chunked_steps > 0
    assert_pool_full(engine)
    model.set_fused_ops(None)


# ---------------------------------------------------------------------------------- on a GPU


@pytest.fixture(scope="module")
def tiny_cuda(tiny_ckpt):
    return _load(tiny_ckpt[0], "cuda")


def _gpu_engine(loaded, **kw):
    from infer.engine import LLMEngine

    paged = dict(kv_cache="paged", block_size=4,
                 kv_cache_memory_bytes=40 * 4 * loaded.config.kv_bytes_per_token(torch.float32)
                 + 16 * loaded.config.state_bytes_per_seq(torch.float32))
    return LLMEngine(EngineConfig(model=str(loaded.path), device="cuda", dtype="float32", max_model_len=128,
                                  batching="continuous", max_num_seqs=16, **paged, **kw), loaded=loaded)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap, fused", [(False, False), (True, True)], ids=["sync", "async-fused"])
def test_cuda_graphs_give_the_eager_and_hf_tokens(tiny_ckpt, tiny_cuda, overlap, fused):
    """Greedy requests arriving over time (batch widths cross the buckets 1, 2, 4, 8, 12, with padding
    rows; prefills run eagerly between), float32 on CUDA: the same tokens through the captured decode
    graphs (with async scheduling and the fused kernels, or neither) as eagerly, both equal
    to HF's ``generate`` on the CPU; no replay writes a slot its rows do not own; slots consistent after
    every step, and at the end every KV block and every state slot free."""
    _, hf = tiny_ckpt
    loaded = tiny_cuda
    arrivals = mixed_workload(loaded.config.vocab_size, 24, seed=3)
    ref = drive(_gpu_engine(loaded, fused_kernels=fused), arrivals)
    eng = _gpu_engine(loaded, cuda_graphs=True, cuda_graph_max_batch_size=12, async_scheduling=overlap,
                      fused_kernels=fused)
    graphs = eng.runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 12] and not graphs.prefill_graphs and not graphs.mixed
    assert graphs.state_cache is eng.runner.state_cache and graphs.num_vectors == 5
    seen: list[tuple[int, int]] = []
    _guard_other_slots(graphs, seen)
    got = drive(eng, arrivals, check=_slots_consistent)
    assert got == ref
    for i, (_, prompt, params) in enumerate(arrivals):
        want = hf_greedy(hf, prompt, params.max_tokens)
        assert got[i][0][: len(want)] == want, f"request {i}"
    assert len(seen) > 10, "no decode step went through a graph"
    assert any(b < bucket for b, bucket in seen), f"no bucket with padding rows: {seen}"
    assert len({bucket for _, bucket in seen}) >= 3, seen
    assert_pool_full(eng)
    _assert_state_slots_free(eng)


@pytest.mark.gpu
def test_cuda_graphs_with_a_padding_bucket_and_a_one_token_prompt(tiny_ckpt, tiny_cuda):
    """The CPU test's arrivals through real captured graphs: three sequences in a bucket of four, a
    one-token prompt (its slot read as zeros) joining decodes in a graph, under ``optimize`` (async
    scheduling, fused kernels, pdl where the GPU has it, chunked prefill, the Triton kernels); HF's tokens."""
    _, hf = tiny_ckpt
    loaded = tiny_cuda
    eng = _gpu_engine(loaded, optimize=True, cuda_graph_max_batch_size=4)
    assert eng.config.cuda_graphs and eng.config.fused_kernels and eng.config.cuda_graph_prefill_max_tokens == 0
    graphs = eng.runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 4]
    seen = _arrivals_give_hf_tokens(eng, graphs, hf)
    assert any(b < bucket for b, bucket in seen), f"no bucket with a padding row: {seen}"
    assert eng.config.prefix_caching  # optimize: the finished prompts' blocks (and snapshots) stay cached
    eng.reset_prefix_cache()
    assert_pool_full(eng)
    _assert_state_slots_free(eng)


#: a 10-token prompt and its 24 greedy tokens; the next turn takes 23 of them in (positions 10..32, computed by
#: decode steps that crossed the 16-token snapshot stride at 16 and 32) and 3 tokens more
SNAPSHOT_PROMPT = [(7 * i + 3) % 500 for i in range(10)]
SNAPSHOT_PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _snapshot_turns(engine, hf) -> tuple[list[list[int]], list]:
    """The two turns' prompts and ``engine``'s outputs for them (cold: no prefix caching), the second HF's."""
    from tests.test_hybrid import _one_at_a_time

    cold = _one_at_a_time(engine, [SNAPSHOT_PROMPT], SNAPSHOT_PARAMS)
    follow = SNAPSHOT_PROMPT + cold[0][0][:23] + [4, 4, 4]
    cold += _one_at_a_time(engine, [follow], SNAPSHOT_PARAMS)
    assert cold[1][0] == hf_greedy(hf, follow, SNAPSHOT_PARAMS.max_tokens)
    return [SNAPSHOT_PROMPT, follow], cold


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors through Triton kernels need TRITON_INTERPRET=1 (on a GPU "
                    "machine: tests/test_gpu_phases.py)")
def test_decode_snapshots_on_the_graph_route_equal_a_cold_run(tiny_ckpt, tiny_cpu):
    """Hybrid prefix caching beside the decode graphs: a decode step whose row ends a snapshot stride (16
    tokens here) goes through its bucket's graph route (run uncaptured on the CPU) and the row's slot is
    copied into its snapshot slot after it (``ModelRunner._copy_decode_snapshots``); a next turn that takes
    the reply in restores the snapshot the decodes left at 32 tokens and gives a cold engine's greedy tokens
    and HF's. With the copy undone the restored state is not the decode's, and the tokens differ (so the
    snapshot steps did take the graph route: the eager forward copies on its own)."""
    from tests.test_hybrid import _one_at_a_time

    _, hf = tiny_ckpt
    flags = dict(max_model_len=64, max_num_seqs=4, batching="continuous", kv_cache="paged", block_size=8,
                 attention_backend="triton")
    prompts, cold = _snapshot_turns(make_engine(tiny_cpu, **flags), hf)

    def warm_run(copy: bool) -> tuple[list, list[int]]:
        engine = make_engine(tiny_cpu, prefix_caching=True, state_snapshot_stride=16, **flags)
        _uncaptured_graphs(engine, 4)
        runner, copies = engine.runner, []
        real = runner.state_cache.copy_slot
        runner.state_cache.copy_slot = lambda src, dst: (copies.append(src.tolist()), copy and real(src, dst))
        routes = []
        runner.on_executed = lambda out: routes.append(out.graph)
        warm = _one_at_a_time(engine, prompts, SNAPSHOT_PARAMS)
        assert routes.count("decode") >= 40, routes
        return warm, copies

    warm, copies = warm_run(copy=True)
    assert warm == [(cold[0][0], 0), (cold[1][0], 32)]  # the hit: 33 cached tokens cut back to the snapshot at 32
    assert len(copies) == 3, copies  # decodes reaching 16 and 32 tokens, then 48 (the next turn's), on the graph route
    broken, _ = warm_run(copy=False)
    assert broken[0] == warm[0] and broken[1][1] == 32 and broken[1][0] != warm[1][0]


@pytest.mark.gpu
def test_cuda_graph_decodes_take_snapshots_that_a_hit_restores(tiny_ckpt, tiny_cuda):
    """The CPU test's snapshots through captured graphs, under ``optimize`` (prefix caching, async scheduling,
    the fused kernels): decodes that end a 16-token stride replay their graph, their slots copied into the
    snapshot slots after it; the next turn restores the one at 32 tokens and gives the eager cold engine's
    tokens and HF's."""
    from tests.test_hybrid import _one_at_a_time

    _, hf = tiny_ckpt
    prompts, cold = _snapshot_turns(_gpu_engine(tiny_cuda), hf)
    eng = _gpu_engine(tiny_cuda, optimize=True, state_snapshot_stride=16, cuda_graph_max_batch_size=4)
    assert eng.config.prefix_caching and eng.runner.graphs is not None
    state, copies, routes = eng.runner.state_cache, [], []
    real = state.copy_slot
    state.copy_slot = lambda src, dst: (copies.append(src.tolist()), real(src, dst))
    eng.runner.on_executed = lambda out: routes.append(out.graph)
    warm = _one_at_a_time(eng, prompts, SNAPSHOT_PARAMS)
    assert warm == [(cold[0][0], 0), (cold[1][0], 32)]
    assert len(copies) == 3 and routes.count("decode") >= 40, (copies, routes)
