"""Speculative decoding with a draft model (phase 12, ``speculative_config={"method": "draft", ...}``).

A smaller model with the same tokenizer proposes ``k`` tokens per sequence by decoding greedily, ``k``
forwards of the draft per step of the target (Leviathan et al., arXiv:2211.17192; Chen et al.,
arXiv:2302.01318; vLLM's ``draft_model`` method). The target verifies them in one forward, as for the
n-gram proposer (:mod:`infer.engine.spec_decode`): the draft only changes how many tokens a step gives,
never which ones, so a draft of any quality is lossless.

The draft has its own KV cache with the same blocks as the target's (as many, of the same size) and
reads the target's block tables, so one allocator serves both: token ``p`` of a sequence has its
target K/V and its draft K/V at the same slot of the two caches. ``seq.draft_num_computed_tokens``
says how many of its tokens the draft cache holds. Each round, for every sequence that proposes::

    catch up + draft 1:  tokens draft_num_computed .. L-1 (the accepted tokens since the last round,
                         or the whole prompt), one extend forward; argmax of the last row -> d_1
    drafts 2 .. k:       one decode forward each over the batch: d_j at position L-2+j -> d_{j+1}

Draft positions past the sequence's end need blocks that the target's next verify step would take
anyway, so they are reserved now (:meth:`~infer.engine.kv_cache_manager.KVCacheManager.allocate_slots`);
when the pool is short, a sequence proposes only what its blocks hold. After the verify step, the
draft's K/V of rejected drafts is forgotten by lowering ``draft_num_computed_tokens`` to the target's
``num_computed_tokens`` (the output processor). A preempted sequence starts over (its blocks are gone).

With ``cuda_graphs`` the draft's runner captures its own decode graphs, and both forwards replay them
with every token a decode row (:meth:`~infer.engine.cuda_graphs.CUDAGraphRunner.replay_rows`): the drafts
2 .. k are decode steps, and a catch-up of a few tokens (the accepted drafts and the token after them) is
one row per token, each attending its context. A catch-up too wide for the buckets (the first one, over
the whole prompt) runs eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from infer.config import SpeculativeConfig
from infer.engine.model_runner import ModelRunner
from infer.engine.sequence import Sequence
from infer.engine.spec_decode import can_speculate, draft_budget
from infer.kernels import fused_ops
from infer.loader import load_model

__all__ = ["DraftProposer"]


class DraftProposer:
    """Proposes with a draft model: ``k`` greedy tokens per sequence (module docstring).

    Args:
        spec: the parsed ``speculative_config`` (method ``draft``).
        engine: the :class:`~infer.engine.llm_engine.LLMEngine` (its runner's KV-cache geometry, its
            config, its block manager and its vocabulary).

    Raises:
        ValueError: the draft's vocabulary differs from the target's (it would propose other tokens),
            or it cannot hold the engine's context.
    """

    def __init__(self, spec: SpeculativeConfig, engine) -> None:
        config = engine.config
        self.k = spec.num_speculative_tokens
        self.kv = engine.kv_manager
        self.max_model_len = engine.max_model_len
        target = engine.runner
        loaded = load_model(spec.model, config.resolved_device(), config.resolved_dtype(), progress=False)
        if loaded.config.vocab_size != engine.vocab_size:
            raise ValueError(f"speculative_config: the draft model {spec.model!r} has a vocabulary of "
                             f"{loaded.config.vocab_size} tokens, the target {engine.vocab_size}; a draft must share "
                             "the target's tokenizer")
        if loaded.config.max_position_embeddings < self.max_model_len:
            raise ValueError(f"speculative_config: the draft model {spec.model!r} holds "
                             f"{loaded.config.max_position_embeddings} positions, fewer than max_model_len="
                             f"{self.max_model_len}")
        backend = config.resolved_attention_backend()
        loaded.model.set_fused_ops(fused_ops(backend) if config.fused_kernels else None, self.max_model_len)
        graphs = config.cuda_graphs and target.graphs is not None
        self.runner = ModelRunner(loaded, target.kv_cache.num_blocks, target.kv_cache.block_size,
                                  contiguous=config.kv_cache != "paged", attention_backend=backend,
                                  max_model_len=self.max_model_len, cuda_graphs=graphs,
                                  cuda_graph_max_batch_size=target.graphs.sizes[-1] if graphs else 256)
        self.runner.capture_cuda_graphs(progress=False)
        self.loaded = loaded
        self.graph_steps = 0  # forwards that replayed a decode graph (the rest ran eagerly)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> None:
        """Set ``seq.spec_token_ids`` of each of ``seqs`` (running, its last token sampled) to the draft's
        greedy continuation (``[]`` for a sequence that may not speculate)."""
        bs = self.kv.block_size
        work: list[tuple[Sequence, int]] = []
        for seq in seqs:
            seq.spec_token_ids = []
            k = draft_budget(seq, self.k, self.max_model_len) if can_speculate(seq) else 0
            if not k:
                continue
            last = len(seq.token_ids) - 1  # the position of the newest token (not in either cache yet)
            if not self.kv.allocate_slots(seq, k):  # positions last .. last + k - 1 get draft K/V
                k = min(k, len(seq.block_table) * bs - last)
            if k > 0:
                work.append((seq, k))
        if not work:
            return
        # catch up and draft 1: one extend per sequence over the tokens the draft has not seen
        firsts = [seq.draft_num_computed_tokens for seq, _ in work]
        ids = [t for (seq, _), f in zip(work, firsts) for t in seq.token_ids[f:]]
        positions = [p for (seq, _), f in zip(work, firsts) for p in range(f, len(seq.token_ids))]
        lengths = [len(seq.token_ids) - f for (seq, _), f in zip(work, firsts)]
        tokens = self._step(work, ids, positions, firsts, lengths)
        for (seq, _), t in zip(work, tokens):
            seq.spec_token_ids.append(t)
            seq.draft_num_computed_tokens = len(seq.token_ids)
        # drafts 2 .. k: decode steps over the sequences that want more
        for j in range(1, max(k for _, k in work)):
            work = [(seq, k) for seq, k in work if k > j]
            if not work:
                break
            firsts = [len(seq.token_ids) - 1 + j for seq, _ in work]
            tokens = self._step(work, [seq.spec_token_ids[-1] for seq, _ in work], firsts, firsts, [1] * len(work))
            for (seq, _), t in zip(work, tokens):
                seq.spec_token_ids.append(t)
                seq.draft_num_computed_tokens += 1

    def _step(self, work, ids: list[int], positions: list[int], firsts: list[int], lengths: list[int]) -> list[int]:
        """One forward of the draft over the sequences of ``work`` (``lengths[i]`` tokens of sequence ``i``
        from position ``firsts[i]``); the argmax token after each sequence's last one."""
        r = self.runner
        tables = [seq.block_table for seq, _ in work]
        if r.graphs is not None:  # every token a decode row of the draft's own decode graphs
            slots = r.kv_cache.slot_mapping(tables, firsts, lengths)
            logits = r.graphs.replay_rows(ids, positions, slots, np.repeat(np.arange(len(work)), lengths), tables)
            if logits is not None:
                self.graph_steps += 1
                last = np.cumsum(lengths) - 1
                return logits[r._to_device(last.tolist(), torch.int64)].argmax(dim=-1).tolist()
        meta = r.runs_metadata(tables, firsts, lengths)
        hidden = r._forward(r._to_device(ids, torch.int64), r._to_device(positions, torch.int64), meta)
        logits = r._logits(hidden, [s - 1 for s in meta.query_start_loc_cpu[1:]])
        return logits.argmax(dim=-1).tolist()
