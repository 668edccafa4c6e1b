"""Phase 12: speculative decoding with an EAGLE-3 head (``speculative_config`` method ``eagle3``).

References: the same engine without speculation for the tokens (identical, greedy and seeded); for the
head's drafts, an independent plain-PyTorch computation of the published architecture (speculators'
``Eagle3DecoderLayer`` / EAGLE's ``LlamaDecoderLayeremb``: full causal attention recomputed from scratch,
no KV cache) fed with the target's hidden states from Hugging Face transformers
(``output_hidden_states``: entry ``i`` is layer ``i``'s input); a constructed head whose drafts are
known (a target that repeats its last token, and a head that reads it off the target's states).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.config import EngineConfig
from infer.loader import load_model
from infer.sampling import SamplingParams
from tests.test_batching import assert_pool_full, make_engine
from tests.test_chunked_prefill import run
from tests.test_prefix_caching import assert_drained
from tests.test_speculative import KW, assert_rolled_back, workload

HEAD_HIDDEN, HEAD_HEADS, HEAD_KV_HEADS, HEAD_DIM, HEAD_FFN = 128, 4, 2, 32, 192


def eagle3(path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k}


def layer_config(vocab: int, hidden: int = HEAD_HIDDEN) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "num_attention_heads": HEAD_HEADS,
            "num_key_value_heads": HEAD_KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": HEAD_FFN,
            "vocab_size": vocab, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def random_head_weights(vocab: int, draft_vocab: int, target_hidden: int, seed: int, hidden: int = HEAD_HIDDEN,
                        num_aux: int = 3) -> dict[str, torch.Tensor]:
    """A random head in the speculators names; a draft vocabulary of ``draft_vocab`` random target ids
    (``d2t[i] = target_id - i``, ``t2d`` the mask of the kept ids)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    h, q, kv = hidden, HEAD_HEADS * HEAD_DIM, HEAD_KV_HEADS * HEAD_DIM
    a = "layers.0."
    w = {"fc.weight": r(h, num_aux * target_hidden), a + "self_attn.q_proj.weight": r(q, 2 * h),
         a + "self_attn.k_proj.weight": r(kv, 2 * h), a + "self_attn.v_proj.weight": r(kv, 2 * h),
         a + "self_attn.o_proj.weight": r(h, q), a + "mlp.gate_proj.weight": r(HEAD_FFN, h),
         a + "mlp.up_proj.weight": r(HEAD_FFN, h), a + "mlp.down_proj.weight": r(h, HEAD_FFN),
         a + "input_layernorm.weight": 1 + r(h), a + "hidden_norm.weight": 1 + r(h),
         a + "post_attention_layernorm.weight": 1 + r(h), "norm.weight": 1 + r(h), "lm_head.weight": r(draft_vocab, h)}
    kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    w["d2t"] = kept - torch.arange(draft_vocab)
    w["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, kept, True)
    return w


def write_head(path: Path, weights: dict, config: dict, layout: str = "speculators") -> Path:
    """Save a head as the published layouts do: speculators (``layers.0.*``, config with
    ``transformer_layer_config``) or EAGLE/SGLang (``midlayer.*``, a ``LlamaForCausalLMEagle3`` config)."""
    path.mkdir(parents=True, exist_ok=True)
    if layout == "eagle":
        weights = {k.replace("layers.0.", "midlayer."): v for k, v in weights.items()}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def speculators_config(layer: dict, draft_vocab: int, **extra) -> dict:
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": draft_vocab,
            "transformer_layer_config": layer,
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3}], "verifier": {"name_or_path": "tiny"}}, **extra}


@pytest.fixture(scope="module")
def random_head(tiny_llama, tmp_path_factory):
    """A random speculators-layout head for ``tiny_llama``: a 256-token draft vocabulary, hidden_norm
    before the residual (vLLM's default for this layout when the key is left out)."""
    c = tiny_llama.config
    w = random_head_weights(c.vocab_size, 256, c.hidden_size, seed=0)
    return write_head(tmp_path_factory.mktemp("eagle3-head"), w,
                      speculators_config(layer_config(c.vocab_size), 256))


# ----------------------------------------------------------------------------- the reference


def rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_head(w: dict, ids: list[int], feats: torch.Tensor, norm_before_residual: bool):
    """The published head over rows ``0..n-1`` (row ``i``: token ``ids[i]``, feature ``feats[i]``, position
    ``i``), plain PyTorch, causal attention over all rows: ``(norm(h), h)``."""
    a = "layers.0."
    e = w["embed"][torch.tensor(ids)]
    if norm_before_residual:
        f = rms(feats, w[a + "hidden_norm.weight"])
        res = f
    else:
        res, f = feats, rms(feats, w[a + "hidden_norm.weight"])
    x = torch.cat([rms(e, w[a + "input_layernorm.weight"]), f], -1)
    n = x.shape[0]
    q = (x @ w[a + "self_attn.q_proj.weight"].T).view(n, HEAD_HEADS, HEAD_DIM)
    k = (x @ w[a + "self_attn.k_proj.weight"].T).view(n, HEAD_KV_HEADS, HEAD_DIM)
    v = (x @ w[a + "self_attn.v_proj.weight"].T).view(n, HEAD_KV_HEADS, HEAD_DIM)
    inv = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    ang = torch.arange(n).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rot(t):
        half = HEAD_DIM // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    q, k = rot(q), rot(k)
    rep = HEAD_HEADS // HEAD_KV_HEADS
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, -1)
    h = res + o @ w[a + "self_attn.o_proj.weight"].T
    m = rms(h, w[a + "post_attention_layernorm.weight"])
    gate, up = m @ w[a + "mlp.gate_proj.weight"].T, m @ w[a + "mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ w[a + "mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"]), h


def reference_drafts(w: dict, hf_model, tokens: list[int], layers: list[int], k: int,
                     norm_before_residual: bool) -> list[int]:
    """EAGLE-3's greedy drafts after ``tokens`` (the last one not yet run by the target): the target's
    states at positions ``0..L-2`` (Hugging Face's hidden_states[l] is layer l's input), row ``p`` paired
    with token ``p + 1``; each later draft appends a row with the draft and the last row's ``h``."""
    with torch.no_grad():
        hs = hf_model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i][0] for i in layers], -1) @ w["fc.weight"].T
        ids, out = list(tokens[1:]), []
        for _ in range(k):
            normed, h = reference_head(w, ids, feats, norm_before_residual)
            best = int((normed[-1] @ w["lm_head.weight"].T).argmax())
            out.append(best + int(w["d2t"][best]))
            ids.append(out[-1])
            feats = torch.cat([feats, h[-1:]])
    return out


def uncaptured_graphs(model, kv_cache, max_batch_size: int, max_model_len: int):
    """A :class:`~infer.engine.cuda_graphs.CUDAGraphRunner` (decode buckets only) whose "graphs" run the
    bucket's decode forward eagerly on the static buffers (what a capture records): the graph routes' inputs
    and outputs on the CPU."""
    from infer.engine.cuda_graphs import CUDAGraphRunner

    graphs = CUDAGraphRunner(model, kv_cache, max_batch_size, -(-max_model_len // kv_cache.block_size), max_model_len)

    class Uncaptured:
        def __init__(self, bs: int) -> None:
            self.bs = bs

        def replay(self) -> None:
            graphs.logits[self.bs] = graphs._decode_forward(self.bs)

    graphs.graphs = {bs: Uncaptured(bs) for bs in graphs.sizes}
    return graphs


def through_graph_routes(engine, max_batch_size: int = 16) -> list:
    """Give ``engine`` (Triton attention) the target's and the head's decode-graph routes, uncaptured
    (:func:`uncaptured_graphs`); returns the list the target's routes are appended to, step by step."""
    from infer.engine.eagle3 import _HeadForGraphs

    runner, proposer = engine.runner, engine.proposer
    runner.graphs = uncaptured_graphs(runner.model, runner.kv_cache, max_batch_size, runner.max_model_len)
    proposer.graph_model = _HeadForGraphs(proposer.head, max_batch_size)
    proposer.graphs = uncaptured_graphs(proposer.graph_model, proposer.kv_cache, max_batch_size, runner.max_model_len)
    routes = []
    runner.on_executed = lambda out: routes.append(out.graph)
    return routes


@pytest.mark.parametrize("route", ["reference-forward", "fused-kernels", "graph-routes", "async-scheduling"])
def test_the_heads_drafts_match_a_plain_pytorch_eagle3_fed_by_transformers(tiny_llama, random_head, route):
    """After every step, each sequence's drafts are what the published architecture computes from scratch
    over its tokens so far: the catch-up over prompts (two in one step, one prefilled in chunks), the
    feature fed back for drafts 2..k, the draft-to-target map, and the head's KV after rejected drafts
    and after a preemption (the head's cache rebuilt). With fused kernels the target's layers hand the
    residual stream on in two parts, added in place by the next norm: the kept states are copies (and the
    head runs its fused forward; the Triton twins: the GPU tests). Through the graph routes (uncaptured,
    Triton kernels interpreted) the target's verify steps and the head's forwards run as decode rows of
    their decode buckets. With async scheduling (the backoff off, so every
    step after which a sequence can draft runs synchronously) the head reads the step just waited for."""
    fused = route == "fused-kernels"
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama.path, dtype=torch.float32).eval()
    w = {**load_file(str(random_head / "model.safetensors")), "embed": hf.model.embed_tokens.weight.detach()}
    rng = random.Random(11)
    arrivals = [(0, [rng.randrange(10, 1000) for _ in range(n)], SamplingParams(temperature=0.0, max_tokens=m,
                                                                                ignore_eos=True))
                for n, m in ((13, 14), (27, 12), (6, 16))]
    per_block = tiny_llama.config.kv_bytes_per_token(torch.float32) * KW["block_size"]
    engine = make_engine(tiny_llama, speculative_config={**eagle3(random_head), "backoff": route != "async-scheduling"},
                         chunked_prefill=True, fused_kernels=fused, max_num_batched_tokens=20,
                         kv_cache_memory_bytes=per_block * 9, async_scheduling=route == "async-scheduling",
                         attention_backend="triton" if route == "graph-routes" else "torch",
                         **{**KW, "max_model_len": 64})
    routes = through_graph_routes(engine) if route == "graph-routes" else []
    layers = [0, 1, 2]  # EAGLE-3's default (2, L // 2, L - 3) for L = 3 layers, in layer order
    assert engine.runner.model.aux_hidden_state_layers == tuple(layers)
    checked = []

    def check(e):
        for seq in e.scheduler.running:
            if seq.spec_token_ids:
                want = reference_drafts(w, hf, seq.token_ids, layers, len(seq.spec_token_ids), True)
                assert seq.spec_token_ids == want, (seq.request.request_id, len(seq.token_ids))
                checked.append(len(seq.spec_token_ids))

    got = run(engine, arrivals, check=check)
    want = run(make_engine(tiny_llama, **{**KW, "max_model_len": 64}), arrivals)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in want.items()}
    assert engine.num_preemptions > 0 and len(checked) > 15 and max(checked) == 3
    assert_pool_full(engine)
    if route == "graph-routes":
        assert "verify" in routes and engine.proposer.graph_steps > 10, (routes, engine.proposer.graph_steps)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """test_speculative's workload without speculation."""
    return run(make_engine(tiny_llama, **KW), workload(tiny_llama.config.vocab_size))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_and_seeded_outputs_are_identical_with_a_random_head(tiny_llama, random_head, reference,
                                                                    async_scheduling):
    """vLLM's workload of test_speculative (greedy, seeded, n = 2, logprobs, penalties, min_tokens) with
    preemption, prefix caching and chunked prefill, and one request aborted mid-decode: the tokens of
    the engine without speculation, and every block back in the pool. With async scheduling the steps of
    sequences the backoff pauses run ahead of the host, so the head misses their hidden states (positions
    it skips: only its acceptance can suffer)."""
    per_block = tiny_llama.config.kv_bytes_per_token(torch.float32) * KW["block_size"]
    engine = make_engine(tiny_llama, speculative_config=eagle3(random_head, 4), prefix_caching=True,
                         chunked_prefill=True, max_num_batched_tokens=24, kv_cache_memory_bytes=per_block * 12,
                         async_scheduling=async_scheduling, **{**KW, "max_model_len": 80})
    aborted = []

    def check(e):
        assert_rolled_back(e)
        seq = next((s for s in e.scheduler.running if s.request.request_id == "r3" and s.num_output_tokens > 3), None)
        if seq is not None and not aborted:
            aborted.append(e.abort_request("r3"))

    got = run(engine, workload(tiny_llama.config.vocab_size), check=check)
    assert aborted == [True]
    assert {rid: v["tokens"] for rid, v in got.items() if rid != "r3"} == \
        {rid: v["tokens"] for rid, v in reference.items() if rid != "r3"}
    assert engine.num_preemptions > 0
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0
    assert_drained(engine)


# ----------------------------------------------------------------------------- a head that is always right


@pytest.fixture(scope="module")
def repeating_target(tiny_llama, tmp_path_factory):
    """``tiny_llama`` with every layer's o_proj and down_proj zeroed (each layer the identity) and the
    LM head tied to the embedding: the next token is always the last one (``e_t`` is nearest itself)."""
    path = tmp_path_factory.mktemp("repeating")
    for f in Path(tiny_llama.path).iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    w = load_file(str(path / "model.safetensors"))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    save_file(w, str(path / "model.safetensors"))
    return load_model(str(path), device="cpu", dtype=torch.float32, progress=False), w


@pytest.fixture(scope="module")
def always_right(repeating_target, tmp_path_factory):
    """The EAGLE/SGLang layout (``midlayer.*``, ``LlamaForCausalLMEagle3``, aux layers in ``eagle_config``):
    fc passes layer 2's input through, the head's attention and MLP add nothing, and its norm and LM head
    are the target's, so every draft is the target's next token. Returns ``(loaded target, head directory,
    arrivals, the target's outputs without speculation)``."""
    loaded, tw = repeating_target
    c = loaded.config
    h = c.hidden_size
    w = random_head_weights(c.vocab_size, c.vocab_size, h, seed=1)
    w["fc.weight"] = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], 1)
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        w[name] = torch.zeros_like(w[name])
    w.update({"norm.weight": tw["model.norm.weight"], "lm_head.weight": tw["lm_head.weight"],
              "d2t": torch.zeros(c.vocab_size, dtype=torch.long)})
    del w["t2d"]
    config = {"architectures": ["LlamaForCausalLMEagle3"], **layer_config(c.vocab_size),
              "rms_norm_eps": c.rms_norm_eps, "draft_vocab_size": c.vocab_size,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    head = write_head(tmp_path_factory.mktemp("always-right") / "head", w, config, layout="eagle")
    rng = random.Random(12)
    arrivals = [(i, [rng.randrange(10, 1000) for _ in range(n)], SamplingParams(temperature=0.0, max_tokens=13,
                                                                                ignore_eos=True))
                for i, n in enumerate((9, 21, 4))]
    want = run(make_engine(loaded, **KW), arrivals)
    assert all(len(set(v["tokens"][0])) == 1 for v in want.values())  # the target repeats
    return loaded, head, arrivals, want


def assert_always_accepted(engine, always_right) -> None:
    """Run ``always_right``'s arrivals through ``engine``: the target's tokens, every draft accepted (each
    verify round takes all k and the bonus token), every block back in the pool."""
    _, _, arrivals, want = always_right
    got = run(engine, arrivals, check=assert_rolled_back)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in want.items()}
    s = engine.stats()
    assert s["spec_decode_num_draft_tokens"] > 0 and s["spec_decode_acceptance_rate"] == 1.0
    assert engine.runner.model.aux_hidden_state_layers == (0, 1, 2)
    assert_pool_full(engine)


def test_a_head_that_reads_the_next_token_off_the_target_is_always_accepted(always_right):
    loaded, head, _, _ = always_right
    assert_always_accepted(make_engine(loaded, speculative_config=eagle3(head, 4), **KW), always_right)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("change, match", [
    ("hidden", "reads target hidden states of size 64, but the target's hidden size is 128"),
    ("vocab", "vocabulary of 2048 tokens, the target 1024"),
    ("missing", "missing weights: layers.0.self_attn.k_proj.weight"),
    ("no_d2t", "missing weights: d2t"),
    ("layers", "reads target layers \\[0, 1, 7\\], but the target has 3 layers"),
    ("shape", "fc.weight is \\[128, 256\\]"),
    ("not_eagle3", "not an EAGLE-3 head"),
])
def test_a_head_that_does_not_fit_the_target_is_refused(tiny_llama, tmp_path, change, match):
    c = tiny_llama.config
    vocab, target_hidden = (2048 if change == "vocab" else c.vocab_size), (64 if change == "hidden" else 128)
    w = random_head_weights(vocab, 64, target_hidden, seed=2)
    extra = {"target_hidden_size": target_hidden}
    if change == "missing":
        del w["layers.0.self_attn.k_proj.weight"]
    elif change == "no_d2t":
        del w["d2t"]
    elif change == "layers":
        extra["eagle_aux_hidden_state_layer_ids"] = [0, 1, 7]
    elif change == "shape":
        w["fc.weight"] = w["fc.weight"][:, :256]
    config = speculators_config(layer_config(vocab), 64, **extra)
    if change == "not_eagle3":
        config = {"architectures": ["LlamaForCausalLM"], **layer_config(vocab)}
    head = write_head(tmp_path / "head", w, config)
    with pytest.raises(ValueError, match=match):
        make_engine(tiny_llama, speculative_config=eagle3(head), **KW)


def test_eagle3_config_is_parsed_and_refused_where_it_cannot_run():
    spec = EngineConfig(device="cpu", speculative_config=eagle3("/some/head", 2)).validate().speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("eagle3", "/some/head", 2)
    with pytest.raises(ValueError, match="method 'eagle3' needs model"):
        EngineConfig(device="cpu", speculative_config={"method": "eagle3", "num_speculative_tokens": 2}).validate()
    for flags, match in ((dict(tensor_parallel_size=2), "'eagle3' with tensor/expert parallelism"),
                         (dict(kv_cache="paged", prefix_caching=True, kv_offload="host"), "'eagle3' with kv_offload"),
                         (dict(enable_lora=True), "enable_lora")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(device="cpu", speculative_config=eagle3("h"), **flags).validate()
    # on a CUDA device (checked here without one): graphs and async scheduling are allowed (the target's graphs
    # write the hidden states into a fixed buffer; steps that speculate run synchronously)
    c = EngineConfig(device="cpu", cuda_graphs=True, async_scheduling=True, kv_cache_memory_bytes=1 << 30,
                     speculative_config=eagle3("h"))
    c._validate_speculative(torch.device("cuda"))
    c = EngineConfig(device="cpu", attention_backend="triton", moe_backend="triton", speculative_config=eagle3("h"))
    assert c._why_not("cuda_graphs", torch.device("cuda")) is None
    assert c._why_not("async_scheduling", torch.device("cuda")) is None


def test_the_benchmark_runs_a_synthetic_head_at_the_targets_shapes(tiny_llama, tmp_path):
    """benchmarks/speculative.py --eagle3-synthetic at tiny sizes: the head it writes loads for the target
    (shapes, d2t), the outputs stay the target's (the program checks), and the proposer's share of the
    decode time is reported."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import speculative as bench

    args = bench.parse_args(["--model", str(tiny_llama.path), "--parts", "acceptance", "--methods", "ngram",
                             "--eagle3-synthetic", "--eagle3-dir", str(tmp_path / "head"), "--k", "2",
                             "--output-len", "5", "--rounds", "1", "--max-model-len", "256"])
    rows = [r for r in bench.acceptance_part(args) if r["method"].startswith("eagle3:")]
    assert len(rows) == 2 * len(bench.PROMPTS)
    assert all(0 < r["propose_share"] < 1 and r["mean_acceptance_length"] >= 1 for r in rows)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == tiny_llama.config.vocab_size  # (min(32000, 1024))
    # the replay part with the head's forwards run first: its drafts replaced, as many as it made
    args = bench.parse_args(["--model", str(tiny_llama.path), "--parts", "replay", "--replay-proposer", "eagle3",
                             "--eagle3-dir", str(tmp_path / "head2"), "--batch-sizes", "2", "--ks", "3",
                             "--acceptance", "0", "1", "--input-len", "8", "--output-len", "9", "--rounds", "1",
                             "--max-model-len", "64"])
    rows = {r["acceptance"]: r for r in bench.replay_part(args)}
    assert rows[0.0]["measured_acceptance_length"] == 1.0
    assert rows[1.0]["measured_acceptance_length"] == 4


@pytest.mark.gpu
def test_eagle3_on_gpu_with_triton_attention_and_fused_kernels(tiny_llama, random_head):
    """float32 on the GPU, Triton attention (the head's too) and fused kernels: a random head changes no
    token (the head's K/V written and read by the Triton kernels through the target's block tables)."""
    rng = random.Random(13)
    arrivals = [(i, [rng.randrange(10, 1000) for _ in range(n)], SamplingParams(temperature=0.0, max_tokens=24,
                                                                                ignore_eos=True))
                for i, n in enumerate((9, 40, 17, 3))]
    flags = dict(attention_backend="triton", fused_kernels=True, kv_cache_memory_bytes=1 << 24, **KW)
    loaded = load_model(str(tiny_llama.path), device="cuda", dtype=torch.float32, progress=False)
    want = run(make_engine(loaded, **flags), arrivals)
    engine = make_engine(loaded, speculative_config=eagle3(random_head, 4), **flags)
    got = run(engine, arrivals, check=assert_rolled_back)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in want.items()}
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0
    assert_pool_full(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_eagle3_with_cuda_graphs_on_gpu(always_right, async_scheduling):
    """The target on CUDA graphs (decode, verify, prefill and mixed routes captured, float32, Triton attention,
    fused kernels), and the head on its own: the captured forwards write the kept hidden states into the
    fixed buffer at replay, so the always-right head still drafts the target's next token every time; with
    async scheduling too (a step run ahead of the host keeps a copy of the last one's states)."""
    cpu, head, _, _ = always_right
    loaded = load_model(str(cpu.path), device="cuda", dtype=torch.float32, progress=False)
    engine = make_engine(loaded, speculative_config=eagle3(head, 4), attention_backend="triton", fused_kernels=True,
                         cuda_graphs=True, async_scheduling=async_scheduling, kv_cache_memory_bytes=1 << 24, **KW)
    routes = []
    engine.runner.on_executed = lambda out: routes.append(out.graph)
    assert_always_accepted(engine, always_right)
    assert "verify" in routes and None not in routes and engine.proposer.graph_steps > 5, routes
