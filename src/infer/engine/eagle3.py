"""Speculative decoding with an EAGLE-3 head (phase 12, ``speculative_config={"method": "eagle3", ...}``).

A draft model re-reads the whole context with its own small transformer. An EAGLE-3 head (Li et al.,
arXiv:2503.01840; :mod:`infer.models.eagle3`) is one decoder layer that starts from what the target
already computed: the hidden states of three target layers (a low, a middle and a high one) at every
position the target just ran, fused by ``fc``. It drafts better than n-gram lookup (it predicts from
the target's own features, not from repeats) for about the cost of one extra layer per draft token.

How it runs here. The target's forward writes the inputs of the three layers
(:meth:`~infer.models.layers.CausalLM.keep_aux_hidden_states`) for every row of the step into one fixed
buffer, so CUDA graphs replay the writes too; the runner notes the step's layout
(:attr:`~infer.engine.model_runner.ModelRunner.aux_steps`; under async scheduling, where the next step runs
before this one is applied, a copy of its rows). After the output processor has accepted (rolling
``num_computed_tokens`` back past rejected drafts), the proposer takes, for every running sequence of those
steps, the rows whose positions the target kept::

    catch up + draft 1:  positions draft_num_computed .. L-2 (the accepted ones of this step, a prompt
                         chunk, or the whole prompt): tokens t[p+1], features fc(target states at p);
                         one extend forward of the head; the last row (position L-2) drafts d_1
    drafts 2 .. k:       one decode forward each: position L-3+j, token d_{j-1}, the head's own
                         feature from the row before -> d_j

The head's KV cache works like the ``draft`` method's (:mod:`infer.engine.draft`): one layer, as many
blocks as the target's, read through the target's block tables, with ``seq.draft_num_computed_tokens``
saying how far it holds K/V made from *target* features. Drafts 2..k write K/V from the head's own
features at positions L-1 .. L+k-3, which never count as computed: the next round rewrites them from
the target's features. Positions the head never saw (a prefix-cache hit, a fork of ``n > 1``) are
skipped: the blocks hold what the sequence that computed them wrote there (for a prefix hit, the same
tokens) or stale values, which can only lower acceptance. Whatever the head drafts, the target
verifies it, so the output never changes.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import numpy as np
import torch

from infer.attention import KVCache, make_attention_backend
from infer.config import ModelConfig, SpeculativeConfig
from infer.engine.cuda_graphs import CUDAGraphRunner
from infer.engine.sequence import SeqStatus, Sequence
from infer.engine.spec_decode import can_speculate, draft_budget
from infer.errors import ModelLoadError
from infer.kernels import fused_ops
from infer.loader.hf import iter_safetensors, read_config, safetensors_files
from infer.models.eagle3 import Eagle3Head, default_aux_layers, parse_eagle3_config

__all__ = ["Eagle3Proposer", "load_eagle3_head"]

log = logging.getLogger("infer")


def _checkpoint_name(name: str) -> str | None:
    """A stored tensor's name in :class:`Eagle3Head` (the EAGLE layout's ``midlayer.`` is ``layers.0.``),
    or None for tensors the head does not use (``t2d``, a trainer's ``verifier_*`` copies)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name == "t2d" or name.startswith("verifier"):
        return None
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def load_eagle3_head(path: str | Path, target, target_cfg: ModelConfig, device: torch.device,
                     dtype: torch.dtype) -> tuple[Eagle3Head, tuple[int, ...]]:
    """Load an EAGLE-3 head (either published layout, :mod:`infer.models.eagle3`) for ``target``.

    Args:
        path: the head's directory (``config.json`` and ``*.safetensors``).
        target: the target :class:`~infer.models.layers.CausalLM` (a head without ``embed_tokens``
            shares its embedding); target_cfg: its config.

    Returns:
        ``(head, layers)``: the head on ``device`` in ``dtype`` (``d2t`` int64), and the target layers
        whose inputs it reads, in increasing order.

    Raises:
        ValueError: the head does not fit the target (its hidden size or vocabulary differs, a layer id is
            out of range), or its weights are missing or misshapen; each message names what differs.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config: the EAGLE-3 head {str(path)!r} is not a directory with a config.json")
    try:
        cfg = parse_eagle3_config(read_config(path), str(path / "config.json"))
        stored = {}
        for name, t in iter_safetensors(safetensors_files(path)):
            key = _checkpoint_name(name)
            if key is not None:
                stored[key] = t
    except ModelLoadError as e:
        raise ValueError(f"speculative_config: the EAGLE-3 head cannot be read: {e}") from None
    what = f"speculative_config: the EAGLE-3 head {str(path)!r}"
    if cfg.target_hidden_size != target_cfg.hidden_size:
        raise ValueError(f"{what} reads target hidden states of size {cfg.target_hidden_size}, but the target's "
                         f"hidden size is {target_cfg.hidden_size}: it was trained for another model")
    if cfg.layer.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"{what} has a vocabulary of {cfg.layer.vocab_size} tokens, the target "
                         f"{target_cfg.vocab_size}: it was trained for another model")
    num_layers = target_cfg.num_layers
    layers = tuple(sorted(set(cfg.aux_layer_ids))) if cfg.aux_layer_ids else default_aux_layers(num_layers)
    if any(not 0 <= i < num_layers for i in layers):
        raise ValueError(f"{what} reads target layers {list(layers)}, but the target has {num_layers} layers")
    fc = stored.get("fc.weight")
    if fc is None:
        raise ValueError(f"{what} is missing weights: fc.weight")
    want_in = len(layers) * cfg.target_hidden_size
    if tuple(fc.shape) != (cfg.layer.hidden_size, want_in):
        raise ValueError(f"{what}: fc.weight is {list(fc.shape)}, but {len(layers)} target layers of "
                         f"{cfg.target_hidden_size} into a hidden size of {cfg.layer.hidden_size} need "
                         f"{[cfg.layer.hidden_size, want_in]}")
    with torch.device("meta"):
        head = Eagle3Head(cfg, len(layers), fc_bias="fc.bias" in stored)
    expected = head.state_dict()
    optional = {"embed_tokens.weight", "d2t"}
    missing = [n for n in expected if n not in stored and n not in optional]
    if missing:
        raise ValueError(f"{what} is missing weights: {', '.join(missing)}")
    if "d2t" not in stored and cfg.draft_vocab_size != cfg.layer.vocab_size:
        raise ValueError(f"{what} is missing weights: d2t (its draft vocabulary of {cfg.draft_vocab_size} tokens "
                         f"needs the map to the target's {cfg.layer.vocab_size})")
    if "embed_tokens.weight" not in stored and cfg.layer.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"{what} has no embed_tokens and a hidden size of {cfg.layer.hidden_size}, so it cannot "
                         f"share the target's embedding ({target_cfg.hidden_size})")
    wrong = [f"{n} {list(stored[n].shape)} (expected {list(t.shape)})" for n, t in expected.items()
             if n in stored and stored[n].shape != t.shape]
    if wrong:
        raise ValueError(f"{what} has weights of the wrong shape: {', '.join(wrong)}")
    unused = sorted(set(stored) - set(expected))
    if unused:
        log.warning("EAGLE-3 head %s: ignoring tensors %s", path, ", ".join(unused))
    state = {n: (t.to(device) if n == "d2t" else t.to(device, dtype)) for n, t in stored.items() if n in expected}
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
        mapped = torch.arange(cfg.draft_vocab_size, device=device) + state["d2t"]
        if int(mapped.min()) < 0 or int(mapped.max()) >= target_cfg.vocab_size:
            raise ValueError(f"{what}: d2t maps draft tokens outside the target's vocabulary of "
                             f"{target_cfg.vocab_size}")
    head.load_state_dict(state, strict=False, assign=True)
    if "d2t" not in state:
        head.d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=device)
    if "embed_tokens.weight" not in state:
        head.embed_tokens = target.model.embed_tokens
    head.set_rope(device)
    return head.eval(), layers


class Eagle3Proposer:
    """Proposes with an EAGLE-3 head: ``k`` greedy tokens per sequence (module docstring).

    Args:
        spec: the parsed ``speculative_config`` (method ``eagle3``).
        engine: the :class:`~infer.engine.llm_engine.LLMEngine` (its runner's model and KV-cache geometry,
            its config, its block manager).

    Raises:
        ValueError: the head does not fit the target (:func:`load_eagle3_head`).
    """

    def __init__(self, spec: SpeculativeConfig, engine) -> None:
        config = engine.config
        self.k = spec.num_speculative_tokens
        self.kv = engine.kv_manager
        self.max_model_len = engine.max_model_len
        self.target = target = engine.runner
        device, dtype = target.device, target.dtype
        self.head, layers = load_eagle3_head(spec.model, target.model, target.config, device, dtype)
        lc = self.head.config.layer
        self.kv_cache = KVCache(1, target.kv_cache.num_blocks, target.kv_cache.block_size, lc.num_kv_heads,
                                lc.head_dim, dtype, device, contiguous=target.kv_cache.contiguous)
        backend = config.resolved_attention_backend()
        self.head.set_attention_backend(make_attention_backend(backend, device))
        self.head.set_fused_ops(fused_ops(backend) if config.fused_kernels else None, self.max_model_len)
        # every target forward writes those layers' inputs into one fixed buffer, rows in the step's flat order:
        # an eager step, and each CUDA-graph route (captured after this, LLMEngine._init_rest) alike
        rows = engine.scheduler.max_num_batched_tokens
        target.model.keep_aux_hidden_states(layers, max(rows, target.graphs.max_rows) if target.graphs else rows)
        # with CUDA graphs, the head's forwards replay decode graphs of its own, every token a decode row
        self.graphs = self.graph_model = None
        if target.graphs is not None:
            width = -(-self.max_model_len // self.kv_cache.block_size)
            self.graph_model = _HeadForGraphs(self.head, target.graphs.sizes[-1])
            self.graphs = CUDAGraphRunner(self.graph_model, self.kv_cache, target.graphs.sizes[-1], width,
                                          self.max_model_len)
            self.graphs.capture(progress=False)
        self.graph_steps = 0  # forwards that replayed a graph (the rest ran eagerly)
        log.info("EAGLE-3 head %s (%s layout): target layers %s, draft vocabulary %d", spec.model,
                 self.head.config.layout, list(layers), self.head.config.draft_vocab_size)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> None:
        """Catch the head up on the accepted positions of the steps since the last call (every running sequence
        of them, :attr:`~infer.engine.model_runner.ModelRunner.aux_steps`),
        then set ``seq.spec_token_ids`` of each of ``seqs`` (running, its last token sampled) to the head's
        greedy drafts (``[]`` for a sequence that may not speculate or whose last position it lacks)."""
        for seq in seqs:
            seq.spec_token_ids = []
        steps, self.target.aux_steps = self.target.aux_steps, []
        want = {id(s): k for s in seqs
                if (k := draft_budget(s, self.k, self.max_model_len) if can_speculate(s) else 0)}
        kept: list[torch.Tensor] = []
        ids: list[int] = []
        work: list[tuple[Sequence, int, int]] = []  # (sequence, first position, rows); a sequence once per step
        for flat, aux in steps:  # oldest first: each sequence's positions in order
            rows: list[int] = []
            for i, item in enumerate(flat.scheduled):
                seq = item.seq
                if seq.status is not SeqStatus.RUNNING or seq.guide is not None or seq.has_penalties:
                    continue  # (a guide or penalties: it never speculates, can_speculate)
                start = flat.starts[i]
                first = flat.positions[start]
                end = min(first + flat.starts[i + 1] - start, seq.num_computed_tokens)  # past it: rejected drafts
                begin = max(first, seq.draft_num_computed_tokens)  # (before `first`: a prefix hit, skipped)
                if end <= begin:
                    continue
                rows.extend(range(start + begin - first, start + end - first))
                ids.extend(seq.token_ids[begin + 1 : end + 1])  # row p pairs the state at p with token p + 1
                work.append((seq, begin, end - begin))
                seq.draft_num_computed_tokens = end
            if rows:
                kept.append(aux[self.target._to_device(rows, torch.int64)])
        if not work:
            return
        hidden = self.head.combine_hidden_states(kept[0] if len(kept) == 1 else torch.cat(kept))
        last = list(itertools.accumulate(n for _, _, n in work))  # each sequence's last row, plus one
        drafting = [(j, seq) for j, (seq, begin, n) in enumerate(work)
                    if id(seq) in want and begin + n == len(seq.token_ids) - 1]
        tokens, feats = self._step(work, ids, hidden, [last[j] - 1 for j, _ in drafting])
        if drafting:
            self._draft_more([(seq, self._reserve(seq, want[id(seq)])) for _, seq in drafting], tokens, feats)

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Blocks for drafts 2..k's K/V (positions L-1 .. L+k-3, which the verify step takes anyway); fewer
        drafts when the pool is short. Returns how many drafts ``seq`` makes."""
        if k > 1 and not self.kv.allocate_slots(seq, k - 1):
            k = min(k, len(seq.block_table) * self.kv.block_size - (len(seq.token_ids) - 1) + 1)
        return k

    def _draft_more(self, live: list[tuple[Sequence, int]], tokens: torch.Tensor, feats: torch.Tensor) -> None:
        """Given draft 1 of each sequence of ``live`` (``(sequence, drafts it makes)``; ``tokens`` int64 ``[N]`` and
        the features ``feats`` ``[N, H]`` on the device), drafts 2..k: one decode forward of the head per draft,
        each row fed its last draft and the head's own feature from the step before. The drafts stay on the
        device until the last forward is launched, then are read back at once (no wait between forwards)."""
        steps = [(live, tokens)]
        for j in range(2, max(k for _, k in live) + 1):
            keep = [i for i, (_, k) in enumerate(live) if k >= j]
            if len(keep) < len(live):
                at = self.target._to_device(keep, torch.int64)
                tokens, feats = tokens[at], feats[at]
                live = [live[i] for i in keep]
            work = [(seq, len(seq.token_ids) - 3 + j, 1) for seq, _ in live]
            tokens, feats = self._step(work, tokens, feats)
            steps.append((live, tokens))
        drafts = iter(torch.cat([t for _, t in steps]).tolist())
        for rows, _ in steps:
            for seq, _ in rows:
                seq.spec_token_ids.append(next(drafts))

    def _step(self, work: list[tuple[Sequence, int, int]], ids: list[int] | torch.Tensor, hidden: torch.Tensor,
              pick: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the head over ``work`` (``(sequence, first position, rows)``, back to back; ``ids`` the
        ``T`` input tokens, on the host or the device; ``hidden`` ``[T, H]``, each row's feature): the greedy
        draft tokens (target ids, int64 on the device) and the features ``h`` (``[N, H]``) of the rows ``pick``
        (None: every row). With CUDA graphs, every row a decode row of the head's own decode graphs (as a draft
        model's, :mod:`infer.engine.draft`; device ids patched in after the staging); a catch-up wider than
        the largest bucket (a whole prompt) runs eagerly."""
        r = self.target
        t = len(ids)
        firsts = [f for _, f, _ in work]
        lengths = [n for _, _, n in work]
        tables = [seq.block_table for seq, _, _ in work]
        positions = [p for f, n in zip(firsts, lengths) for p in range(f, f + n)]
        on_device = isinstance(ids, torch.Tensor)
        tokens = None
        if self.graphs is not None and t <= self.graphs.sizes[-1]:
            self.graph_model.feats[:t].copy_(hidden)
            tokens = self.graphs.replay_rows([0] * t if on_device else ids, positions,
                                             self.kv_cache.slot_mapping(tables, firsts, lengths),
                                             np.repeat(np.arange(len(work)), lengths), tables,
                                             (None, ids) if on_device else None)
            feats = self.graph_model.feats_out[:t]
        if tokens is None:
            meta = r.runs_metadata(tables, firsts, lengths, self.kv_cache)
            normed, feats = self.head(ids if on_device else r._to_device(ids, torch.int64), hidden,
                                      r._to_device(positions, torch.int64), meta)
            if pick is not None:
                normed = normed[r._to_device(pick, torch.int64)]
            tokens = self.head.draft_token_ids(normed)
        else:
            self.graph_steps += 1
            if pick is not None:
                tokens = tokens[r._to_device(pick, torch.int64)]
        if pick is not None:
            feats = feats[r._to_device(pick, torch.int64)]
        return tokens, feats


class _HeadForGraphs(torch.nn.Module):
    """The head as :class:`~infer.engine.cuda_graphs.CUDAGraphRunner` captures a model: :meth:`forward`
    ``(ids, positions, meta)`` reads each row's feature from :attr:`feats` (staged before a replay) and writes
    the row's new feature ``h`` to :attr:`feats_out`; :meth:`compute_logits` returns what the graph hands back,
    the draft tokens (target ids, int64 ``[T]``) rather than logits. Both buffers ``[max_rows, H]``."""

    def __init__(self, head: Eagle3Head, max_rows: int) -> None:
        super().__init__()
        self.head = head
        w = head.fc.weight
        self.feats = torch.zeros(max_rows, head.config.layer.hidden_size, dtype=w.dtype, device=w.device)
        self.feats_out = torch.zeros_like(self.feats)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        t = input_ids.shape[0]
        normed, h = self.head(input_ids, self.feats[:t], positions, meta)
        self.feats_out[:t].copy_(h)
        return normed

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head.draft_token_ids(normed)
