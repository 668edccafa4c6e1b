"""The model runner decides *how* a scheduled step runs: tensors, KV cache, forward, sampling.

Input: the scheduler's ``[(sequence, num_new_tokens), ...]``. It flattens every sequence's
new tokens into ``input_ids[T]`` / ``positions[T]``, builds the attention metadata (where
each sequence starts, its context length, the KV slots its new tokens go to), runs one
forward, computes logits only where a token will be sampled (the last new token of each
sequence whose prompt is complete), and samples all of them in one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.attention import AttentionMetadata, ContiguousKVCache, TorchAttentionBackend
from infer.engine.scheduler import ScheduledSeq
from infer.loader import LoadedModel
from infer.sampling import SamplerOutput, SamplingTensors, sample


@dataclass
class StepResult:
    """What one forward produced.

    Attributes:
        sampled: the scheduled sequences that sampled a token, in order.
        sampler_output: their tokens and logprobs (device tensors).
        prompt_logprobs: per sequence index in ``sampled`` order that asked for them:
            ``(logprobs [L-1] f32, top_ids [L-1, K], top_logprobs [L-1, K])`` for the prompt
            positions computed this step (CPU tensors).
    """

    sampled: list[ScheduledSeq]
    sampler_output: SamplerOutput | None
    prompt_logprobs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class ModelRunner:
    """Owns the model on its device and the KV cache.

    Args:
        loaded: the model from :func:`infer.loader.load_model`.
        max_model_len: tokens per cache row.
        num_rows: cache rows (sequences that can hold cache space at once).
    """

    def __init__(self, loaded: LoadedModel, max_model_len: int, num_rows: int) -> None:
        self.model = loaded.model
        cfg = loaded.config
        self.config = cfg
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kv_cache = ContiguousKVCache(
            cfg.num_layers, num_rows, max_model_len, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device
        )
        self.model.set_attention_backend(TorchAttentionBackend())
        self.vocab_size = cfg.vocab_size

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], eos_ids: list[int]) -> StepResult:
        """Run one step over ``scheduled`` and sample the sequences that are ready to."""
        ids: list[int] = []
        positions: list[int] = []
        starts, seq_lens, rows, firsts = [0], [], [], []
        sample_at: list[int] = []
        sampled: list[ScheduledSeq] = []
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            first = seq.num_computed_tokens
            ids.extend(seq.token_ids[first : first + n])
            positions.extend(range(first, first + n))
            starts.append(starts[-1] + n)
            seq_lens.append(first + n)
            rows.append(seq.cache_row)
            firsts.append(first)
            if first + n >= seq.num_prompt_tokens:  # the prompt is complete: sample
                sample_at.append(starts[-1] - 1)
                sampled.append(item)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            kv_cache=self.kv_cache,
            slot_mapping=self.kv_cache.slot_mapping(rows, firsts, [s.num_tokens for s in scheduled], dev),
            cache_rows_cpu=rows,
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
        )
        prompt_lp = self._prompt_logprobs(scheduled, starts, hidden)
        if not sampled:
            return StepResult([], None, prompt_lp)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_at, device=dev)])
        tensors = self._sampling_tensors([s.seq for s in sampled], eos_ids)
        return StepResult(sampled, sample(logits, tensors), prompt_lp)

    def _sampling_tensors(self, seqs, eos_ids: list[int]) -> SamplingTensors:
        suppress = []
        for seq in seqs:
            p = seq.params
            ban: list[int] = []
            if seq.num_output_tokens < p.min_tokens:
                ban = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(eos_ids))
            suppress.append(ban)
        return SamplingTensors.from_params(
            [s.params for s in seqs],
            seeds=[s.seed for s in seqs],
            steps=[s.num_output_tokens for s in seqs],
            prompt_ids_list=[s.token_ids[: s.num_prompt_tokens] for s in seqs],
            output_ids_list=[s.output_token_ids for s in seqs],
            suppress_list=suppress,
            vocab_size=self.vocab_size,
            device=self.device,
        )

    def _prompt_logprobs(self, scheduled, starts, hidden):
        """Prompt logprobs of sequences that asked for them (only sequence index 0 of a request)."""
        out = {}
        for i, item in enumerate(scheduled):
            seq = item.seq
            k = seq.params.prompt_logprobs
            if k is None or seq.index != 0 or seq.num_computed_tokens >= seq.num_prompt_tokens:
                continue
            s = starts[i]
            first = seq.num_computed_tokens
            end = min(first + item.num_tokens, seq.num_prompt_tokens)
            # position p predicts token p + 1; the last prompt position predicts the first output
            n_pred = end - first - (1 if end == seq.num_prompt_tokens else 0)
            if n_pred <= 0:
                continue
            lp = torch.log_softmax(self.model.compute_logits(hidden[s : s + n_pred]).float(), dim=-1)
            targets = torch.tensor(seq.token_ids[first + 1 : first + 1 + n_pred], device=lp.device)
            chosen = lp.gather(1, targets[:, None])[:, 0]
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
            ranks = (lp > chosen[:, None]).sum(-1) + 1
            out[id(seq)] = (chosen.cpu(), ranks.cpu(), top_i.cpu(), top_v.cpu())
        return out
