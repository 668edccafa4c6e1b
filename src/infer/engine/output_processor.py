"""The one place where sampled tokens become request output.

For every sequence that sampled a token this step: append it, record its logprobs, feed the
incremental detokenizer (now, or when somebody needs the text: :meth:`OutputProcessor.detokenize`),
and decide whether the sequence is finished (EOS, a stop token, a stop string, ``max_tokens``, the
context limit). Every batching mode goes through here, so stop handling and streaming behave the
same whatever the scheduler did.
"""

from __future__ import annotations

import time
from collections import Counter

from infer.engine.histogram import BucketCounts
from infer.engine.sequence import PLACEHOLDER, Request, SeqStatus, Sequence
from infer.engine.step import StepResult
from infer.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprob
from infer.sampling.params import RequestOutputKind
from infer.tokenizer import Tokenizer

_FINISHED = SeqStatus.FINISHED
_INF = float("inf")
_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY

#: upper bounds (seconds) of the inter-token latency histogram (vLLM's ``inter_token_latency_seconds``)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)


class OutputProcessor:
    """Applies a :class:`StepResult` to the sequences and builds :class:`RequestOutput` s.

    Args:
        tokenizer: for the text of logprob tokens.
        eos_token_ids: ids that end generation (unless ``ignore_eos``).
        max_model_len: a sequence reaching it finishes with ``"length"``.
        vocab_size: the width of the model's logits (for structured output's completion check).

    Attributes:
        inter_token_latency: the time between a request's consecutive tokens, one value per
            request per step that gave it a token after its first
            (:class:`~infer.engine.histogram.BucketCounts`; ``infer:inter_token_latency_seconds``).
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int], max_model_len: int,
                 vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._eos_ids = list(eos_token_ids)
        self._vocab_size = vocab_size or tokenizer.vocab_size
        self.inter_token_latency = BucketCounts(INTER_TOKEN_LATENCY_BUCKETS)
        #: speculative decoding (phase 12): a SpecDecodingStats, set by the engine; None without it
        self.spec_stats = None

    def _token(self, token_id: int, logprob: float, rank: int | None) -> TokenLogprob:
        return TokenLogprob(token_id, logprob, rank, self.tokenizer.decode_token(token_id, skip_special_tokens=False))

    @staticmethod
    def advance(scheduled) -> None:
        """Count the step's tokens as computed (their K/V is in the cache once the step ran)."""
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            for fork in item.forks:  # they got a copy of the prompt's K/V this step
                fork.num_computed_tokens = item.seq.num_computed_tokens

    def apply(self, result: StepResult, scheduled, advanced: bool = False) -> list[Sequence]:
        """Advance every scheduled sequence (unless ``advanced``: :meth:`advance` already ran) and
        append the sampled tokens; returns the sequences that finished this step.

        With async scheduling (:class:`~infer.engine.llm_engine.LLMEngine`), a sampled sequence
        already holds a placeholder (-1) where its token goes, which the token replaces; a sequence
        that finished (or was aborted) while this step ran is skipped: its token is dropped.
        """
        if not advanced:
            self.advance(scheduled)
        finished: list[Sequence] = []
        now = time.perf_counter()
        if result.prompt_logprobs:
            for seq, (chosen, ranks, top_i, top_v) in (
                (item.seq, result.prompt_logprobs[id(item.seq)])
                for item in scheduled if id(item.seq) in result.prompt_logprobs
            ):
                self._add_prompt_logprobs(seq, chosen, ranks, top_i, top_v)
        if result.sampler_output is None:
            return finished
        tokens, chosen_lp, top_ids, top_lps = result.host_outputs()  # the step's one device -> host wait
        skip = self._verify(scheduled, result.sampled, tokens) if self.spec_stats is not None else None
        previous: list[float] = []  # the time of the last token of each request that gets another one
        # (this loop runs for every sequence every step: ~1-2 us each is ~0.5 ms at 256 sequences,
        # so it reads plain attributes rather than properties)
        for i, (seq, token) in enumerate(zip(result.sampled, tokens)):
            if seq.status is _FINISHED:
                continue  # async scheduling: it finished (or was aborted) while this step ran
            if skip is not None and (i in skip or seq in finished):
                continue  # speculative decoding: a row after a rejected draft, or after the sequence stopped
            if not -_INF < chosen_lp[i] < _INF:  # NaN: the row had no token to sample (infer.sampling.sampler)
                self._fail_unsamplable(seq)
                finished.append(seq)
                continue
            req = seq.request
            last = req.last_token_time
            if last is None:
                req.first_token_time = now
            elif last != now:  # (n > 1: its other sequences sampled in this step too: one gap per request)
                previous.append(last)
            req.last_token_time = now
            ids = seq.token_ids
            if ids[-1] == PLACEHOLDER:
                ids[-1] = token
            else:
                ids.append(token)
            seq.pending_token_ids.append(token)
            if seq.params.logprobs is not None:
                self._add_logprobs(seq, token, chosen_lp[i], top_ids[i], top_lps[i])
            if seq.detokenizer.stop:  # stop strings are matched on the text as it is made
                seq.pending_text += seq.detokenizer.add_token(token)
            reason = self._check_stop(seq, token)
            if seq.guide is not None and (reason is None or seq.guide_dead_end):
                reason = self._advance_guide(seq, token)
            if reason is not None:
                seq.finish_reason, seq.stop_reason = reason
                if seq.detokenizer.stop_reason is None:
                    self.detokenize(seq)
                    seq.pending_text += seq.detokenizer.finish()
                finished.append(seq)
        if previous:
            self._record_token_gaps(now, previous)
        return finished

    def _verify(self, scheduled, sampled: list[Sequence], tokens: list[int]) -> set[int]:
        """Speculative decoding (phase 12): accept each verifying sequence's drafts
        (:func:`~infer.engine.spec_decode.num_accepted`), count them in :attr:`spec_stats`, and roll its
        ``num_computed_tokens`` back to the accepted ones: the step wrote K/V for the last token and every
        draft, and the positions of rejected drafts hold K/V that must never be read (the next step
        overwrites them). Returns the rows whose tokens are dropped (those after the first rejection); the
        emitted ones (accepted drafts and the token after them) are applied one by one by :meth:`apply`,
        so a stop inside the run ends the sequence exactly where decoding would."""
        from infer.engine.spec_decode import num_accepted, record_round

        skip: set[int] = set()
        row = {id(s): r for r, s in reversed(list(enumerate(sampled)))}  # each sequence's first row
        for item in scheduled:
            draft = item.spec_token_ids
            if not draft:
                # drafts the scheduler found no budget or blocks for: the sequence decoded one token, and a
                # draft model's cache (or an EAGLE-3 head's) holds valid K/V only up to what the target computed
                item.seq.draft_num_computed_tokens = min(item.seq.draft_num_computed_tokens,
                                                         item.seq.num_computed_tokens)
                continue
            seq, first = item.seq, row[id(item.seq)]
            accepted = num_accepted(tokens[first : first + len(draft) + 1], draft)
            self.spec_stats.observe(len(draft), accepted)
            record_round(seq, accepted)
            skip.update(range(first + accepted + 1, first + len(draft) + 1))
            seq.num_computed_tokens -= len(draft) - accepted  # the last token and the accepted drafts stay
            # a draft model's K/V of rejected drafts goes too (infer.engine.draft)
            seq.draft_num_computed_tokens = min(seq.draft_num_computed_tokens, seq.num_computed_tokens)
            seq.spec_token_ids = []
        return skip

    def _fail_unsamplable(self, seq: Sequence) -> None:
        """End ``seq`` with ``finish_reason="error"``: its logits held no finite value to sample from (the
        model's NaN or inf, or a constraint and suppression that allowed nothing). Its token is not
        output; an async-scheduling placeholder for it is dropped."""
        if seq.token_ids[-1] == PLACEHOLDER:
            seq.token_ids.pop()
        seq.finish_reason = "error"
        seq.stop_reason = "no token could be sampled: the logits held no finite value (NaN or inf)"
        if seq.detokenizer.stop_reason is None:
            self.detokenize(seq)
            seq.pending_text += seq.detokenizer.finish()

    def _record_token_gaps(self, now: float, previous: list[float]) -> None:
        """Count each request's gap since its previous token (``previous``: the times of those
        tokens) in :attr:`inter_token_latency`, one histogram update per distinct gap.

        Usually every request got its previous token in the previous step, so ``previous`` holds
        one float object many times: ``list.count`` sees that at C speed (it compares by identity
        first; ~0.5 us for 256 entries, where hashing them into a ``Counter`` takes ~25 us). Only a
        request that skipped steps (preempted, or a step without room for it) adds another time."""
        first = previous[0]
        n = previous.count(first)
        if n == len(previous):
            self.inter_token_latency.observe(now - first, n)
            return
        for last, n in Counter(previous).items():
            self.inter_token_latency.observe(now - last, n)

    @staticmethod
    def detokenize(seq: Sequence) -> None:
        """Catch ``seq``'s detokenizer up with its output tokens (their text joins ``pending_text``).

        Text is made when it is needed: at every step for a sequence with stop strings (they are
        matched on the text), and whenever an output is built (:meth:`make_output`; streaming
        builds one every step). A request that is not streamed and has no stop strings is
        detokenized once, when it finishes, in one warm loop rather than one cache-cold call per
        step (~3.5 against ~1.2 us a token on a CPU): the same ids through the same
        :meth:`~infer.detokenizer.IncrementalDetokenizer.add_token` calls, so the same text.
        """
        d = seq.detokenizer
        ids = seq.token_ids
        start = seq.num_prompt_tokens + len(d.token_ids)
        end = len(ids) - (ids[-1] == PLACEHOLDER)  # async scheduling: a token still on the device
        if start < end and not d.finished:
            add = d.add_token
            seq.pending_text += "".join([add(t) for t in ids[start:end]])

    def _add_logprobs(self, seq: Sequence, token: int, chosen: float, top_ids: list[int], top_lps: list[float]) -> None:
        """Record the sampled token's logprob and the top ``params.logprobs`` alternatives."""
        k = seq.params.logprobs
        ids, lps = top_ids[:k], top_lps[:k]
        rank = ids.index(token) + 1 if token in ids else None
        entry = PositionLogprobs(
            self._token(token, chosen, rank),
            [self._token(t, v, r + 1) for r, (t, v) in enumerate(zip(ids, lps))],
        )
        seq.logprobs.append(entry)
        seq.pending_logprobs.append(entry)
        seq.cumulative_logprob += chosen

    def _advance_guide(self, seq: Sequence, token: int) -> tuple[str, str | None] | None:
        """Structured output (phase 13): move the sequence's automaton over ``token``.

        Returns ``("stop", None)`` when the constraint is complete (the only token it still
        allows is EOS: the sequence ends without spending a step on sampling it), ``None`` otherwise.
        A token the constraint did not allow (only possible through a bug) raises.
        """
        guide = seq.guide
        if seq.guide_dead_end:  # no token continued the constraint (see ModelRunner._token_bitmask)
            return "error", "structured output dead end: no token of the vocabulary continues the constraint"
        if token in self.eos:  # ignore_eos: EOS does not move the automaton
            return None
        guide.advance(token, return_tokens=False)  # (the default returns every allowed token as a list)
        if guide.is_finished():
            from infer.sampling.structured import guide_masks

            if guide_masks(seq, self._eos_ids, self._vocab_size).eos_only(guide):
                return "stop", None
        return None

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str, str | int | None] | None:
        """``(finish_reason, stop_reason)`` if ``seq`` is done after appending ``token``."""
        # >>> EXERCISE stop_check
        p = seq.params
        if token in self.eos and not p.ignore_eos:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
        if seq.detokenizer.stop_reason is not None:
            return "stop", seq.detokenizer.stop_reason
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None
        if len(seq.token_ids) >= self.max_model_len:
            return "length", None
        return None
        # <<< EXERCISE stop_check

    def _add_prompt_logprobs(self, seq: Sequence, chosen, ranks, top_i, top_v) -> None:
        req = seq.request
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]  # nothing predicts the first prompt token
        start = len(req.prompt_logprobs)
        k = seq.params.prompt_logprobs
        for j, (lp, rank) in enumerate(zip(chosen.tolist(), ranks.tolist())):
            token = seq.token_ids[start + j]
            top = [self._token(t, v, r + 1) for r, (t, v) in enumerate(zip(top_i[j].tolist()[:k],
                                                                            top_v[j].tolist()[:k]))]
            req.prompt_logprobs.append(PositionLogprobs(self._token(token, lp, rank), top))

    @staticmethod
    def make_output(req: Request, final_only: bool = False) -> RequestOutput | None:
        """The request's output of this step, or None if it has nothing to say.

        What it carries follows the request's ``params.output_kind``
        (:class:`~infer.sampling.params.RequestOutputKind`): everything so far plus the deltas
        (``CUMULATIVE``), only the deltas (``DELTA``: no O(length) copy of the tokens, text and
        logprobs so far), or nothing until the request finishes (``FINAL_ONLY``). With
        ``final_only`` (a non-streaming caller) every kind behaves as ``FINAL_ONLY``: an output
        is made only when the request has finished, and it is complete.
        """
        finished = req.is_finished
        kind = req.params.output_kind
        if (final_only or kind is _FINAL_ONLY) and not finished:
            return None
        for s in req.seqs:
            OutputProcessor.detokenize(s)
        if not finished and not any(s.pending_token_ids or s.pending_text for s in req.seqs):
            return None
        delta = kind is _DELTA and not final_only
        outs = []
        for s in req.seqs:
            wants_logprobs = s.logprobs is not None
            text, token_ids, logprobs = s.pending_text, s.pending_token_ids, s.pending_logprobs
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=text if delta else s.detokenizer.output_text,
                    # (cumulative: a fresh slice, one O(length) copy per output)
                    token_ids=token_ids if delta else s.output_token_ids,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=(logprobs if delta else list(s.logprobs)) if wants_logprobs else None,
                    cumulative_logprob=s.cumulative_logprob,
                    delta_text=text,
                    delta_token_ids=token_ids,
                    delta_logprobs=logprobs if wants_logprobs else None,
                    num_generated_tokens=s.num_output_tokens,
                )
            )
            s.pending_text, s.pending_token_ids, s.pending_logprobs = "", [], []
        metrics = {"arrival": req.arrival_time}
        if req.first_scheduled_time is not None:
            metrics["first_scheduled"] = req.first_scheduled_time
        if req.first_token_time is not None:
            metrics["first_token"] = req.first_token_time
        if req.finished_time is not None:
            metrics["finished"] = req.finished_time
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=finished,
            prompt_logprobs=req.prompt_logprobs,
            metrics=metrics,
            num_cached_tokens=req.num_cached_tokens,
        )


__all__ = ["OutputProcessor"]
