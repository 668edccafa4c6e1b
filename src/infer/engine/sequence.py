"""Requests and sequences: the engine's bookkeeping for what is being generated.

A *request* (one prompt, one :class:`~infer.sampling.SamplingParams`) owns ``n``
*sequences* (vLLM's terms). The scheduler moves sequences between states; the model runner
reads ``token_ids[num_computed_tokens:]`` as the tokens to run next; the output processor
appends sampled tokens and decides when a sequence is finished.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from infer.detokenizer import IncrementalDetokenizer
from infer.lora.request import LoRARequest
from infer.outputs import PositionLogprobs
from infer.sampling import SamplingParams

PLACEHOLDER = -1  # async scheduling: a sampled token still on the device (see LLMEngine)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generated continuation of a prompt.

    Attributes:
        token_ids: prompt tokens followed by the generated ones (the model's input stream).
        num_prompt_tokens: length of the prompt part of ``token_ids``.
        num_computed_tokens: how many of ``token_ids`` have their K/V in the cache.
        seed: the sequence's random stream (the request's seed, offset by ``index``).
        block_table: the KV-cache blocks it holds while running, in order (empty otherwise):
            token ``p`` is in block ``block_table[p // block_size]`` (see
            :mod:`infer.engine.kv_cache_manager`).
        block_hashes: prefix caching (phase 7): the keys of its full blocks so far (see
            :mod:`infer.engine.prefix_cache`); ``num_cached_blocks``: how many blocks at the
            start of ``block_table`` already have their key in the cache.
        state_slot: hybrid models (phase 17): its slot of the recurrent-state cache while it runs
            (-1 otherwise), held like its blocks (see :mod:`infer.engine.kv_cache_manager`).
            ``state_restore``: after a prefix hit, the snapshot slot (:mod:`infer.engine.state_snapshots`)
            its first step copies into ``state_slot`` before running (-1: none).
    """

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    seed: int
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    state_slot: int = -1  # hybrid models (phase 17): its recurrent-state slot while running, else -1
    # hybrid prefix caching (phase 17): the snapshot slot its next step starts its state from (a prefix hit), else -1
    state_restore: int = -1
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    # what was produced since the last output was handed out (streaming deltas)
    pending_token_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list[PositionLogprobs] = field(default_factory=list)
    # structured output (phase 13): the sequence's outlines_core.Guide (its automaton state),
    # advanced with each sampled token; None for an unconstrained sequence
    guide: Any = None
    guide_dead_end: bool = False
    guide_masks: Any = None  # its recent states' bitmasks (infer.sampling.structured.GuideMasks)
    # speculative decoding (phase 12): the proposer's draft tokens for the next step (verified then)
    spec_token_ids: list[int] = field(default_factory=list)
    # a draft model's proposer: how many of token_ids the draft's KV cache holds (infer.engine.draft)
    draft_num_computed_tokens: int = 0
    # the backoff (infer.engine.spec_decode.record_round): verify rounds in a row that accepted nothing,
    # and the steps it is still to skip speculating
    spec_misses: int = 0
    spec_pause: int = 0
    # the request's sampling parameters, and whether they penalize tokens already seen (the
    # sampler then needs the sequence's tokens on the host every step); read per sequence per
    # step by the scheduler, the runner and the output processor, so plain attributes
    params: SamplingParams = field(init=False, repr=False)
    has_penalties: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.params = self.request.params
        self.has_penalties = (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                              or p.frequency_penalty != 0.0)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True until the whole prompt has been run through the model."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V is not in the cache yet: 1 when decoding; the prompt before the
        prefill; the prompt and every generated token after a preemption (recompute)."""
        return len(self.token_ids) - self.num_computed_tokens


@dataclass(eq=False)
class Request:
    """A prompt, its sampling parameters and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    # timestamps (``time.perf_counter``): added; first admitted by the scheduler (the end of its
    # queueing; a preempted request keeps its first); its first and latest sampled tokens; finished
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    #: prefix caching: prompt tokens found in the cache at its first admission (None before it)
    num_cached_tokens: int | None = None
    #: LoRA (phase 16): the adapter its tokens run with, or None for the base model
    lora_request: LoRARequest | None = None

    @property
    def lora_int_id(self) -> int | None:
        """The adapter's ``lora_int_id``, or None for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        if len(self.seqs) == 1:  # the usual n = 1 (asked for per request every step)
            return self.seqs[0].status is SeqStatus.FINISHED
        return all(s.is_finished for s in self.seqs)

    @property
    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def shares_prefill(self) -> bool:
        """True while no sequence has generated a token: sequence 0's prefill serves them all.

        (After a preemption, sequences that already generated tokens each recompute their own.)
        """
        return all(s.num_output_tokens == 0 for s in self.seqs)
