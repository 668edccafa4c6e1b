"""Speculative decoding (phase 12): acceptance on real weights, and TPOT against a chosen acceptance rate.

    python benchmarks/speculative.py                  # smollm2-135m on this CPU: both parts, small
    # GPU, Qwen3-8B shapes with every optimization (optimize: async scheduling too, which a speculating engine
    # uses for the steps that verify nothing); synthetic "decisive" weights, whose greedy tokens bf16 rounding cannot flip
    # (only the replay part means anything on synthetic weights)
    python scripts/make_synthetic_checkpoint.py qwen3-8b /tmp/qwen3-8b --random-weights --decisive
    python benchmarks/speculative.py --model /tmp/qwen3-8b --device cuda --dtype bfloat16 --parts replay \\
        --batch-sizes 1 8 --ks 4 --acceptance 0 0.75 1 --output-len 96 \\
        --engine optimize=true,kv_cache_memory_bytes=6000000000 --out /tmp/phase12-gpu/speculative.json
    # the EAGLE-3 head's cost at Qwen3-8B shapes: a random head (acceptance ~0, so this is its price, not
    # its gain), its share of the decode time, against no speculation with the same flags (eagle3 runs
    # without CUDA graphs and needs kv_cache_memory_bytes on CUDA)
    python benchmarks/speculative.py --model /tmp/qwen3-8b --device cuda --dtype bfloat16 --parts acceptance \
        --methods ngram --eagle3-synthetic --k 4 --output-len 128 --rounds 3 \
        --engine kv_cache=paged,batching=continuous,fused_kernels=True,prefix_caching=True,kv_cache_memory_bytes=17179869184 \
        --out /tmp/phase12-gpu/speculative-eagle3.json

Two parts, in one process:

1. **acceptance** (real weights: only meaningful on a real checkpoint): greedy chat prompts of three
   kinds, ``edit`` (rewrite a given text: the answer copies it), ``code`` (change a given function) and
   ``open`` (open-ended questions: nothing to copy), decoded without speculation and with each
   ``--methods`` entry (``ngram``, ``draft:MODEL`` or ``eagle3:HEAD``; ``--eagle3-synthetic`` adds a random
   EAGLE-3 head at the target's shapes, :func:`write_synthetic_eagle3_head`), one request at a time (batch 1)
   and all of a kind together (batch N). Reports ``ms_per_token`` (decode time over output tokens, all
   sequences together: the TPOT at batch 1, the inverse of the throughput above), the mean acceptance
   length (tokens per verify round: 1 + accepted drafts), the acceptance rate and ``propose_share`` (the
   proposer's part of the decode time: a draft model's or a head's forwards), and checks that every output
   is the non-speculative one token for token.
2. **replay** (any weights): the target's own greedy output is recorded, then a benchmark-side proposer
   replays it, each draft right with probability ``a`` (a wrong one is the right id + 1), so the mean
   acceptance length is ``1 + a + a^2 + ... + a^k``: ``ms_per_token`` for every batch size, ``k`` and ``a`` against
   no speculation in the same run. With ``a = 0`` every round verifies ``k`` drafts and keeps none: the
   cost of the verify step's ``k + 1`` tokens against one. The expected speedup is
   ``(1 - a^(k+1)) / (1 - a)`` tokens per round over that cost ratio (Leviathan et al., section 3.3).
   These runs verify at every step (``"backoff": false``); ``speedup_backoff`` is the same setting with the
   engine's default backoff (:func:`infer.engine.spec_decode.record_round`), which stops verifying drafts
   that keep failing. The replay needs the same greedy tokens from a verify step as from a decode step: in
   bf16 plain random weights' near-ties break that (a token flips, every later replayed draft is wrong), so
   on a GPU use a checkpoint made with ``--random-weights --decisive`` (``outputs_differing`` counts such
   flips; 0 there).

Rounds alternate (no speculation, then each setting) so all see the same machine. Writes the JSON report
to ``--out`` (default ``benchmarks/runs/speculative.json``), the Markdown tables (``.md``) and a plot
(``.png``: replay speedup against acceptance beside the formula; acceptance length per prompt kind).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
from common import (
    engine_overrides,
    environment,
    markdown_table,
    out_argument,
    print_row,
    save_figure,
    sync,
    write_report,
)

from infer.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.spec_decode import can_speculate, draft_budget
from infer.sampling import SamplingParams

TEXT = ("The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper "
        "climbed the spiral stairs, trimmed the wick and polished the great lens, so that ships passing in the "
        "dark would see the light and steer clear of the rocks below.")
CODE = ("def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
        "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n    return result\n")
PROMPTS = {
    "edit": [f"Rewrite this text in the past perfect tense, changing nothing else:\n\n{TEXT}",
             f"Repeat the following paragraph exactly, then give it a title:\n\n{TEXT}"],
    "code": [f"Add type hints to this function and return the whole function:\n\n{CODE}",
             f"Rename the variable `chunk` to `part` in this code and return the whole code:\n\n{CODE}"],
    "open": ["Write a short poem about the sea.", "What are three tips for staying healthy?"],
}


def make_engine(args, spec: dict | None, max_num_seqs: int) -> LLMEngine:
    kw = {"kv_cache": "paged", "batching": "continuous", **engine_overrides([args.engine])}
    return LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                                  max_num_seqs=max_num_seqs, speculative_config=spec, **kw), progress=False)


def decode(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
           timed_from: list[float] | None = None) -> tuple[list[list[int]], float, int]:
    """Run ``prompts`` together, greedy; returns (outputs, decode seconds after every prefill, output tokens
    after the first of each). ``timed_from``: a counter set to 0 where the timing starts (the proposer's
    seconds, :func:`_time_proposer`, then count the timed steps only)."""
    reqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    while engine.num_waiting or any(s.num_output_tokens == 0 for r in reqs for s in r.seqs):
        engine.step(stream=False)  # prefills (and the first tokens)
    before = sum(r.seqs[0].num_output_tokens for r in reqs)
    sync(engine.runner.device)
    if timed_from is not None:
        timed_from[0] = 0.0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step(stream=False)
    sync(engine.runner.device)
    outs = [r.seqs[0].output_token_ids for r in reqs]
    return outs, time.perf_counter() - t, sum(map(len, outs)) - before


def acceptance_part(args) -> list[dict]:
    plain = make_engine(args, None, 8)
    ids = {kind: [plain.tokenizer.encode(_chat(plain, p), add_special_tokens=False) for p in ps]
           for kind, ps in PROMPTS.items() if kind in args.kinds}
    methods = {"none": None}
    for m in args.methods + (["eagle3:" + write_synthetic_eagle3_head(plain, args)] if args.eagle3_synthetic else []):
        if m == "ngram":
            methods[m] = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
                          "prompt_lookup_min": args.lookup_min}
        else:
            kind, path = m.split(":", 1)
            methods[m] = {"method": kind, "model": path, "num_speculative_tokens": args.k}
        methods[m]["backoff"] = args.backoff
    engines = {m: plain if spec is None else make_engine(args, spec, 8) for m, spec in methods.items()}
    propose_secs = {m: _time_proposer(eng) for m, eng in engines.items()}
    rows = []
    for kind, prompts in ids.items():
        for batch, groups in (("1", [[p] for p in prompts]), (f"{len(prompts)}", [prompts])):
            times = {m: [] for m in methods}
            shares = {m: [] for m in methods}
            ref = None
            for _ in range(args.rounds):
                for m, eng in engines.items():
                    if eng.spec_stats is not None:
                        eng.spec_stats.reset()
                    outs, secs, n, proposing = [], 0.0, 0, 0.0
                    for g in groups:
                        o, s, t = decode(eng, g, args.output_len, propose_secs[m])
                        outs += o
                        secs, n, proposing = secs + s, n + t, proposing + propose_secs[m][0]
                    ref = ref if m != "none" else outs
                    assert outs == ref, f"{m} changed the output of {kind}"
                    times[m].append(secs / max(n, 1))
                    shares[m].append(proposing / max(secs, 1e-9))
            for m in methods:
                eng = engines[m]
                stats = eng.stats() if eng.spec_stats is not None else {}
                row = {"kind": kind, "batch": batch, "method": m, "ms_per_token": 1e3 * statistics.median(times[m]),
                       "speedup": statistics.median(times["none"]) / statistics.median(times[m]),
                       "mean_acceptance_length": stats.get("spec_decode_mean_acceptance_length", 1.0),
                       "acceptance_rate": stats.get("spec_decode_acceptance_rate", 0.0),
                       "propose_share": statistics.median(shares[m])}
                rows.append(row)
                print_row(row)
    return rows


def _time_proposer(engine: LLMEngine) -> list[float]:
    """Wrap ``engine``'s proposer so that its seconds add up in the returned one-element list (the device
    synchronized around each call; the prefills' proposals count too, a small part)."""
    total = [0.0]
    if engine.proposer is None:
        return total
    propose = engine.proposer.propose

    def timed(seqs):
        sync(engine.runner.device)
        t = time.perf_counter()
        propose(seqs)
        sync(engine.runner.device)
        total[0] += time.perf_counter() - t

    engine.proposer.propose = timed
    return total


def write_synthetic_eagle3_head(engine: LLMEngine, args, draft_vocab: int = 32000, seed: int = 0) -> str:
    """A random EAGLE-3 head for ``engine``'s model in the ``speculators`` layout (published heads' shapes:
    the target's hidden size, heads and MLP width; a ``draft_vocab``-token draft vocabulary with ``d2t``),
    written to ``--eagle3-dir`` (default: a temporary directory); returns its path. Its drafts are random,
    so it measures what the head costs, not what it gains."""
    import json
    import tempfile
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    c = engine.runner.config
    h, v, dv, ffn = c.hidden_size, c.vocab_size, min(draft_vocab, c.vocab_size), c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if args.dtype in ("bfloat16", "bf16") else torch.float32

    def r(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype)

    a = "layers.0."
    w = {"fc.weight": r(h, 3 * h), a + "self_attn.q_proj.weight": r(q, 2 * h), a + "self_attn.k_proj.weight": r(kv, 2 * h),
         a + "self_attn.v_proj.weight": r(kv, 2 * h), a + "self_attn.o_proj.weight": r(h, q),
         a + "mlp.gate_proj.weight": r(ffn, h), a + "mlp.up_proj.weight": r(ffn, h), a + "mlp.down_proj.weight": r(h, ffn),
         "lm_head.weight": r(dv, h)}
    for name in (a + "input_layernorm.weight", a + "hidden_norm.weight", a + "post_attention_layernorm.weight",
                 "norm.weight"):
        w[name] = torch.ones(h, dtype=dtype)
    kept = torch.randperm(v, generator=g)[:dv].sort().values
    w["d2t"] = kept - torch.arange(dv)
    layer = {"model_type": "llama", "hidden_size": h, "num_attention_heads": c.num_heads,
             "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "intermediate_size": ffn, "vocab_size": v,
             "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope.theta}
    out = Path(args.eagle3_dir or tempfile.mkdtemp(prefix="eagle3-head-"))
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "draft_vocab_size": dv,
                                                 "norm_before_residual": True, "transformer_layer_config": layer}))
    return str(out)


def _chat(engine: LLMEngine, text: str) -> str:
    from infer.chat import apply_chat_template

    try:
        return apply_chat_template(engine.tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
    except ValueError:  # a base model without a chat template
        return text + "\n"


class ReplayProposer:
    """Proposes the target's recorded greedy continuation, each draft right with probability ``a``.

    ``inner``: the engine's own proposer (an EAGLE-3 head's), run first for its cost (its forwards, its K/V
    and blocks); its drafts are then replaced by the replayed ones, as many as it made."""

    def __init__(self, refs: dict[int, list[int]], k: int, a: float, vocab: int, max_model_len: int, seed: int = 0,
                 inner=None):
        self.refs, self.k, self.a, self.vocab, self.max_model_len = refs, k, a, vocab, max_model_len
        self.rng = random.Random(seed)
        self.inner = inner
        if inner is not None:
            inner.k = k

    def propose(self, seqs) -> None:
        if self.inner is not None:
            self.inner.propose(seqs)
        for seq in seqs:
            ref = self.refs[tuple(seq.request.prompt_token_ids)]
            k = draft_budget(seq, self.k, self.max_model_len) if can_speculate(seq) else 0
            if self.inner is not None:
                k = len(seq.spec_token_ids)
            at = seq.num_output_tokens
            true = ref[at:at + k]
            seq.spec_token_ids = [t if self.rng.random() < self.a else (t + 1) % self.vocab for t in true]


def replay_part(args) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for b in args.batch_sizes:
        plain = make_engine(args, None, b)
        prompts = [[rng.randrange(100, plain.vocab_size - 1) for _ in range(args.input_len)] for _ in range(b)]
        outs, _, _ = decode(plain, prompts, args.output_len)  # the reference (and a warm-up)
        spec = {"method": "ngram", "num_speculative_tokens": max(args.ks), "backoff": False}
        if args.replay_proposer == "eagle3":  # the head's forwards run (a random head at the model's shapes)
            spec = {**spec, "method": "eagle3", "model": write_synthetic_eagle3_head(plain, args)}
        spec_engine = make_engine(args, spec, b)
        times: dict[tuple, list[float]] = {}
        lengths: dict[tuple, float] = {}
        differ: dict[tuple, int] = {}
        for _ in range(args.rounds):
            times.setdefault(("none", 0, 0.0), []).append(_replay_tpot(plain, prompts, outs, args, 0, 0.0))
            for k in args.ks:
                for a in args.acceptance:
                    for backoff in (False, True):  # every step verifies (the formula's case), or the backoff
                        spec_engine.spec_backoff = backoff
                        times.setdefault(("backoff" if backoff else "replay", k, a), []).append(
                            _replay_tpot(spec_engine, prompts, outs, args, k, a, differ))
                        if not backoff:
                            lengths[k, a] = spec_engine.stats()["spec_decode_mean_acceptance_length"]
        base = statistics.median(times["none", 0, 0.0])
        cost = {k: statistics.median(times["replay", k, 0.0]) / base for k in args.ks if 0.0 in args.acceptance}
        for (method, k, a), ts in times.items():
            if method != "replay":
                continue
            tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
            row = {"batch": b, "k": k, "acceptance": a, "ms_per_token": 1e3 * statistics.median(ts),
                   "ms_per_token_none": 1e3 * base, "speedup": base / statistics.median(ts),
                   "speedup_backoff": base / statistics.median(times["backoff", k, a]),
                   "tokens_per_round": tokens, "measured_acceptance_length": lengths[k, a],
                   "verify_cost": cost.get(k), "expected_speedup": tokens / cost[k] if k in cost else None,
                   "outputs_differing": differ.get((k, a), 0)}
            rows.append(row)
            print_row(row)
        del plain, spec_engine
    return rows


def _replay_tpot(engine, prompts, outs, args, k, a, differ: dict | None = None) -> float:
    """Decode seconds per output token of ``prompts`` (their reference outputs ``outs``); with ``k``, the
    drafts replayed with acceptance probability ``a``.

    In float32 the outputs must equal the reference. In bfloat16 a verify step's ``k + 1`` rows may round
    differently from a one-token decode, and a near-tie can then flip a token (plain random weights give
    many; ``--decisive`` ones none): such outputs are counted in ``differ[k, a]`` (the report's
    ``outputs_differing``), not fatal; after the first differing token the replayed drafts are wrong, so the
    measured acceptance only drops."""
    if k:
        refs = {tuple(p): o for p, o in zip(prompts, outs)}
        inner = getattr(engine.proposer, "inner", engine.proposer)
        engine.proposer = ReplayProposer(refs, k, a, engine.vocab_size, engine.max_model_len,
                                         inner=inner if args.replay_proposer == "eagle3" else None)
        engine.spec_stats.reset()
    got, secs, n = decode(engine, prompts, args.output_len)
    n_diff = sum(g != o for g, o in zip(got, outs))
    if n_diff and args.dtype in ("float32", "fp32", "float"):
        raise AssertionError("speculation changed the output")
    if differ is not None and n_diff:
        differ[k, a] = max(differ.get((k, a), 0), n_diff)
    return secs / max(n, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--engine", default="", help="EngineConfig overrides, e.g. fused_kernels=True,cuda_graphs=True")
    ap.add_argument("--parts", nargs="+", default=["acceptance", "replay"], choices=["acceptance", "replay"])
    ap.add_argument("--methods", nargs="+", default=["ngram"], help="ngram, draft:MODEL and/or eagle3:HEAD_DIR")
    ap.add_argument("--eagle3-synthetic", action="store_true",
                    help="acceptance part: also a random EAGLE-3 head at the model's shapes (its cost, not its gain)")
    ap.add_argument("--eagle3-dir", default=None, help="where --eagle3-synthetic writes the head (default: a temp dir)")
    ap.add_argument("--kinds", nargs="+", default=list(PROMPTS), choices=list(PROMPTS),
                    help="acceptance part: the prompt kinds")
    ap.add_argument("--k", type=int, default=4, help="acceptance part: num_speculative_tokens")
    ap.add_argument("--no-backoff", dest="backoff", action="store_false",
                    help="acceptance part: verify every step's drafts (the backoff off), e.g. to price a proposer")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--ks", type=int, nargs="+", default=[4], help="replay part: the k values")
    ap.add_argument("--replay-proposer", default="ngram", choices=["ngram", "eagle3"],
                    help="replay part: eagle3 runs a random EAGLE-3 head's forwards (the method's cost) before "
                         "its drafts are replaced by the replayed ones")
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.5, 0.8, 1.0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    out_argument(ap, "speculative.json", "JSON report (a .md table and a .png plot beside it)")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    acc = acceptance_part(args) if "acceptance" in args.parts else []
    rep = replay_part(args) if "replay" in args.parts else []
    tables = []
    if acc:
        tables.append(f"Acceptance on {args.model}, greedy, k={args.k}, ngram lookup {args.lookup_min}-{args.lookup_max}, "
                      f"{args.output_len} tokens\n\n" + markdown_table(
                          acc, ["kind", "batch", "method", "ms_per_token", "speedup", "mean_acceptance_length",
                                "acceptance_rate", "propose_share"]))
    if rep:
        tables.append(f"Replayed drafts on {args.model}, {args.input_len}-token prompts, {args.output_len} tokens\n\n"
                      + markdown_table(rep, ["batch", "k", "acceptance", "ms_per_token_none", "ms_per_token", "speedup",
                                             "speedup_backoff", "tokens_per_round", "measured_acceptance_length", "verify_cost",
                                             "expected_speedup", "outputs_differing"]))
    write_report({"args": vars(args), "environment": environment(args.device), "acceptance": acc, "replay": rep},
                 args.out, "\n\n".join(tables))
    if args.out:
        plot(acc, rep, args)


def plot(acc: list[dict], rep: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (acc, rep) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6), squeeze=False)
    axes = list(axes[0])
    if acc:
        ax = axes.pop(0)
        rows = [r for r in acc if r["method"] != "none"]
        labels = [f"{r['kind']}\nb={r['batch']}" for r in rows]
        ax.bar(range(len(rows)), [r["mean_acceptance_length"] for r in rows], color="tab:blue",
               label="mean acceptance length")
        ax.plot(range(len(rows)), [r["speedup"] for r in rows], "o", color="tab:red", label="speedup (time per token)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_title(f"{args.model}: {', '.join(args.methods)}, k={args.k}", fontsize=9)
        ax.legend(fontsize=8)
    if rep:
        ax = axes.pop(0)
        for b in args.batch_sizes:
            for k in args.ks:
                pts = sorted((r["acceptance"], r["speedup"], r["expected_speedup"], r.get("speedup_backoff"))
                             for r in rep if r["batch"] == b and r["k"] == k)
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"batch {b}, k={k} measured")
                if all(p[2] is not None for p in pts):
                    ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=line.get_color(),
                            label=f"batch {b}, k={k} formula")
                if all(p[3] is not None for p in pts):
                    ax.plot([p[0] for p in pts], [p[3] for p in pts], "x", ms=8, color=line.get_color(),
                            label=f"batch {b}, k={k} with the backoff")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("per-draft acceptance probability a")
        ax.set_ylabel("speedup vs no speculation")
        ax.set_title(f"replayed drafts on {args.model} ({args.device})", fontsize=9)
        ax.legend(fontsize=7)
    save_figure(fig, str(args.out).rsplit(".", 1)[0] + ".png")


if __name__ == "__main__":
    main()
