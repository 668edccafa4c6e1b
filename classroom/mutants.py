"""Plausible wrong solutions of every exercise (mutants), which the grader must FAIL.

A grading test that a wrong solution passes misleads a student ("PASS") and an instructor
(the score). So for each exercise of :mod:`classroom.exercises` this module keeps a few mistakes
students really make (an off-by-one, an inclusive instead of an exclusive bound, a forgotten
flag or case, rebinding a list the caller holds instead of editing it), each written as small
edits of the reference solution: ``(reference text, wrong text)`` pairs applied inside the
exercise's region. ``python -m classroom mutants`` grades each one in a workspace of its
own with that exercise's tests; ``tests/test_exercise_mutants.py`` requires every one to FAIL (and
every reference to PASS). A mutant whose reference text is no longer in the region is an error,
so the list cannot silently go stale when the code changes.

The idea is mutation testing (DeMillo, Lipton and Sayward 1978, "Hints on Test Data Selection"),
with hand-written mutants rather than generated ones: each is a mistake worth catching.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """One wrong solution: ``edits`` applied, in order, to the reference region of ``exercise``."""

    exercise: str
    name: str
    mistake: str  # what the student got wrong, in a few words
    edits: tuple[tuple[str, str], ...]

    @property
    def id(self) -> str:
        return f"{self.exercise}.{self.name}"


def apply_mutant(text: str, mutant: Mutant) -> str:
    """The source file ``text`` with ``mutant``'s edits made inside its exercise's region.

    Raises:
        ValueError: an edit's reference text is not found exactly once in the region (the
            reference changed: update the mutant), or the edit changes nothing.
    """
    from classroom.exercises import region_text, replace_region

    body = region_text(text, mutant.exercise)
    for old, new in mutant.edits:
        if body.count(old) != 1 or old == new:
            raise ValueError(f"mutant {mutant.id}: {old!r} occurs {body.count(old)} times in the region "
                             f"of {mutant.exercise} (must be once); update the mutant")
        body = body.replace(old, new)
    return replace_region(text, mutant.exercise, body)


def _m(exercise: str, name: str, mistake: str, *edits: tuple[str, str]) -> Mutant:
    return Mutant(exercise, name, mistake, tuple(edits))


_ALL = [
    # ---------------------------------------------------------------- phase 0
    _m("rms_norm", "eps_outside_root", "eps added after the square root",
       ("torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)",
        "1.0 / (h.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps)")),
    _m("rms_norm", "gemma_without_unit_offset", "Gemma scaled by w instead of (1 + w)",
       ("(1.0 + weight.float())", "weight.float()")),
    _m("rms_norm", "llama_casts_last", "Llama's weight applied in float32, cast last (HF casts first)",
       ("return weight * h.to(dtype)", "return (weight.float() * h).to(dtype)")),
    _m("apply_rope", "rotate_half_sign", "rotate_half([a, b]) = [b, -a]",
       ("torch.cat((-x[..., half:], x[..., :half]), dim=-1)", "torch.cat((x[..., half:], -x[..., :half]), dim=-1)")),
    _m("apply_rope", "adjacent_pairs", "pairs (2i, 2i+1) (the GPT-J layout) with rotate-half angles",
       ("rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)",
        "rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)")),
    # ---------------------------------------------------------------- phase 1
    _m("top_p", "inclusive_cumsum", "inclusive running sum: the token that crosses top_p is dropped",
       ("torch.nn.functional.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))", "sorted_probs.cumsum(dim=-1)")),
    _m("top_p", "reaches_inclusive", "keeps a token whose mass before it equals top_p (<= for <)",
       ("(mass_before < top_p[:, None])", "(mass_before <= top_p[:, None])")),
    _m("top_p", "ties_by_rank", "cuts by sorted rank, so ties with the last kept token depend on sort order",
       ("    smallest_kept = sorted_probs.gather(1, num_kept - 1)  # [B, 1]\n"
        "    remove = (probs < smallest_kept) & (top_p[:, None] < 1.0)\n",
        "    order = probs.argsort(dim=-1, descending=True, stable=True)\n"
        "    rank = torch.empty_like(order).scatter_(1, order, torch.arange(probs.shape[1]).expand_as(order))\n"
        "    remove = (rank >= num_kept) & (top_p[:, None] < 1.0)\n")),
    _m("stop_check", "forgets_ignore_eos", "EOS stops even when the request sets ignore_eos",
       ("if token in self.eos and not p.ignore_eos:", "if token in self.eos:")),
    _m("stop_check", "max_tokens_off_by_one", "max_tokens checked with > (one token too many)",
       ("seq.num_output_tokens >= p.max_tokens", "seq.num_output_tokens > p.max_tokens")),
    _m("stop_check", "stop_token_without_reason", "a stop token id finishes without saying which",
       ('return "stop", token', 'return "stop", None')),
    # ---------------------------------------------------------------- phase 2
    _m("sampling_or_reject", "only_unsupported_fields", "only UnsupportedField caught: a bad value is a 500",
       ("    except ValueError as e:\n        raise Reject(error_response(400, str(e), _param_of(e))) from None\n",
        "")),
    _m("sampling_or_reject", "param_not_named", "the 400 does not name the bad field",
       ("error_response(400, str(e), _param_of(e))", "error_response(400, str(e), None)")),
    _m("chat_sse", "no_done", "the stream never sends data: [DONE]",
       ('yield "data: [DONE]\\n\\n"', "return")),
    _m("chat_sse", "index_ends_twice", "a choice that finished keeps getting chunks",
       ("                if c.index in ended:\n                    continue\n", "")),
    _m("chat_sse", "no_usage_chunk", "stream_options.include_usage ignored",
       ("if self.include_usage and last is not None:", "if False:")),
    _m("abort_request", "engine_not_told", "the engine keeps running the aborted request",
       ("known = self.engine.abort_request(rid)", "known = req is not None")),
    _m("abort_request", "not_recorded", "the abort is not counted as a finished request",
       ("            self._record_finished(final)\n", "")),
    # ---------------------------------------------------------------- phase 3
    _m("batch_ready", "full_batch_off_by_one", "a full batch waits for the timeout (> for >=)",
       ("if queued >= self.max_num_seqs:", "if queued > self.max_num_seqs:")),
    _m("batch_ready", "counts_requests", "counts requests, not their n sequences",
       ("queued = sum(len(r.seqs) for r in waiting)", "queued = len(waiting)")),
    _m("batch_ready", "ignores_running", "starts a new batch while one is running",
       ("if running or not waiting:", "if not waiting:")),
    _m("flatten_batch", "forks_not_sampled", "the forks of a shared prefill are not sampled",
       ("for s in (seq, *item.forks):", "for s in (seq,):")),
    _m("flatten_batch", "positions_from_zero", "positions restart at 0 each step",
       ("positions.extend(range(first, first + n))", "positions.extend(range(n))")),
    _m("flatten_batch", "samples_first_token", "samples at the sequence's first new token, not its last",
       ("sample_at.append(starts[-1] - 1)", "sample_at.append(starts[-2])")),
    # ---------------------------------------------------------------- phase 4
    _m("admission", "schedules_prompt_len", "schedules prompt_len tokens itself (a preempted request must recompute "
       "its generated tokens too)",
       ("            budget = self._admit(request, budget, scheduled)\n",
        "            self.kv.admit(request)\n"
        "            for s in request.unfinished_seqs:\n"
        "                s.status = SeqStatus.RUNNING\n"
        "                self.running.append(s)\n"
        "            if request.prompt_len <= budget:\n"
        "                scheduled.append(ScheduledSeq(request.seqs[0], request.prompt_len, request.seqs[1:]))\n"
        "                budget -= request.prompt_len\n")),
    _m("admission", "static_stops_at_budget", "static batching stops at a prompt that does not fit this step",
       ("if need > budget and not self.policy.admits_past_budget:", "if need > budget:")),
    _m("admission", "none_admits_many", "'none' admits every waiting request at once",
       ("            if self.policy.one_request_at_a_time:\n                break\n", "")),
    _m("decode_attention", "gqa_interleaved", "query heads grouped as [G, kv_heads] (interleaved), not [kv_heads, G]",
       ("q.view(n, hkv, h // hkv, d)", "q.view(n, h // hkv, hkv, d).transpose(1, 2)")),
    _m("decode_attention", "no_mask", "keys past the sequence's length are attended",
       ("attn_mask=mask[:, None, None, :]", "attn_mask=None")),
    _m("top_k", "kth_off_by_one", "the threshold is the (k+1)-th value",
       ("sorted_logits.gather(1, (k - 1)[:, None])", "sorted_logits.gather(1, k.clamp(max=vocab_size - 1)[:, None])")),
    _m("top_k", "ties_removed", "removes the k-th token too (<= for <)",
       ("logits.masked_fill(logits < kth,", "logits.masked_fill(logits <= kth,")),
    _m("top_k", "no_lower_clamp", "k = 0 not clamped to 1",
       ("top_k.clamp(min=1, max=vocab_size)", "top_k.clamp(max=vocab_size)")),
    # ---------------------------------------------------------------- phase 5
    _m("block_free", "no_double_free_check", "a double free goes unnoticed",
       ("            if self.ref_counts[b] < 1:\n"
        "                raise RuntimeError(f\"block {b} is already free (double free)\")\n", "")),
    _m("block_free", "freed_while_shared", "a block goes back on the free list while a fork still holds it",
       ("if self.ref_counts[b] == 0:", "if self.ref_counts[b] <= 1:")),
    _m("block_free", "list_not_heap", "appended to the free list (allocate no longer hands out the lowest)",
       ("heapq.heappush(self.free_blocks, b)", "self.free_blocks.append(b)")),
    _m("slot_mapping", "forgets_block_size", "block id added, not multiplied by block_size",
       ("base = table[block] * bs + offset", "base = table[block] + offset")),
    _m("slot_mapping", "run_past_end", "the run inside a block ignores where the new tokens end",
       ("run = min(bs - offset, end - p)", "run = bs - offset")),
    _m("slot_mapping", "positions_from_zero", "starts at position 0, not at the first new token",
       ("p, end = start, start + n", "p, end = 0, n")),
    _m("preemption", "rebinds_scheduled", "rebinds `scheduled` instead of editing the caller's list",
       ("scheduled[:] = [", "scheduled = [")),
    _m("preemption", "oldest_victim", "preempts the oldest running request, not the newest",
       ("victim = self.running[-1].request", "victim = self.running[0].request")),
    _m("preemption", "victim_stays_scheduled", "the victim's sequences are left in this step's batch",
       ("            scheduled[:] = [s for s in scheduled if s.seq.request is not victim]\n", "")),
    _m("paged_decode_inner_loop", "no_rescale", "the accumulator is not rescaled when the running max grows",
       ("acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot(")),
    _m("paged_decode_inner_loop", "sum_not_rescaled", "the running sum is not rescaled",
       ("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)")),
    _m("paged_decode_inner_loop", "no_key_mask", "keys past the end are scored",
       ("        s = tl.where(valid[None, :], s, float(\"-inf\"))\n", "")),
    _m("paged_decode_inner_loop", "offset_ignores_block", "the row offset ignores the block size",
       ("(tok % BLOCK_SIZE) * stride_ct", "tok * stride_ct")),
    # ---------------------------------------------------------------- phase 6
    _m("chunk_schedule", "no_decode_first", "prefill chunks keep admission order, ahead of later decodes",
       ("            order.sort(key=lambda s: s.num_uncomputed_tokens > 1)", "            pass")),
    _m("chunk_schedule", "forks_on_every_chunk", "the forks join the first chunk, before the prompt is cached",
       ("if seq.index == 0 and last else []", "if seq.index == 0 else []")),
    _m("chunk_key_length", "whole_prompt_keys", "the key length is the whole prompt, not what is cached",
       ("kv_len = first + num_new_tokens", "kv_len = max(first + num_new_tokens, seq.num_prompt_tokens)")),
    _m("chunk_key_length", "samples_at_prompt_end", "samples once the prompt is done, also mid-recompute",
       ("kv_len == len(seq.token_ids)", "kv_len >= seq.num_prompt_tokens")),
    _m("chunk_schedule", "shortest_prefill_first", "prefill chunks go shortest first, not in admission order",
       ("order.sort(key=lambda s: s.num_uncomputed_tokens > 1)", "order.sort(key=lambda s: s.num_uncomputed_tokens)")),
    _m("chunk_schedule", "threshold_ignored", "a chunk is whatever the budget leaves: no per-request cap, and "
       "without chunking a prompt is cut too", ("n = self._chunk(want, budget, seq.num_computed_tokens)", "n = min(want, budget)")),
    _m("chunk_schedule", "budget_not_given_back", "a preemption takes sequences out of the batch but not their "
       "tokens out of the budget spent", ("                budget = self.max_num_batched_tokens - sum(s.num_tokens for s in "
                                           "scheduled)\n", "")),
    _m("chunk_schedule", "preempted_still_runs", "a sequence preempted earlier in this step is scheduled anyway",
       ("if seq.status is not SeqStatus.RUNNING or self._waits_for_shared_prefill(seq):",
        "if self._waits_for_shared_prefill(seq):")),
    _m("chunk_schedule", "unfit_prefill_ends_the_step", "without chunking, a prompt that does not fit ends the step: "
       "the decodes behind it wait", ("                if want == 1 or self.chunked_prefill:\n"
                                       "                    break  # the budget is spent\n"
                                       "                continue  # a prefill that does not fit this step; smaller work may\n",
                                       "                break\n")),
    _m("chunk_key_length", "first_from_the_end", "the chunk is taken as the last num_new_tokens tokens (a decode's view)",
       ("first = seq.num_computed_tokens", "first = len(seq.token_ids) - num_new_tokens")),
    _m("chunk_key_length", "chunk_keys_only", "the queries see their own chunk's keys, not the cached prefix",
       ("kv_len = first + num_new_tokens", "kv_len = num_new_tokens")),
    _m("chunk_key_length", "samples_one_early", "samples when one token is still uncomputed (>= len - 1)",
       ("kv_len == len(seq.token_ids)", "kv_len >= len(seq.token_ids) - 1")),
    _m("chunk_key_length", "samples_at_prompt_end_only", "samples exactly when the prompt completes: never after "
       "a recompute past the prompt", ("kv_len == len(seq.token_ids)", "kv_len == seq.num_prompt_tokens")),
    # ---------------------------------------------------------------- phase 8
    _m("fused_add_rms_norm_kernel", "residual_not_stored", "the new residual is never written back",
       ("    tl.store(res_ptr + row * stride_r + offs, s, mask=mask)\n", "")),
    _m("fused_add_rms_norm_kernel", "norm_of_the_input", "normalizes the row itself, not row + residual",
       ("y = _rms_norm_row(s.to(tl.float32),", "y = _rms_norm_row(x,")),
    _m("fused_add_rms_norm_kernel", "norm_of_the_unrounded_sum", "stores the rounded sum but normalizes the float32 "
       "one (the unfused code normalizes what it stored)", ("y = _rms_norm_row(s.to(tl.float32),", "y = _rms_norm_row(x + r,")),
    _m("fused_add_rms_norm_kernel", "sum_not_rounded", "leaves the rounding of the sum to the store",
       ("s = round_to(x + r, res_ptr.dtype.element_ty, MANUAL_BF16)", "s = x + r")),
    _m("fused_add_rms_norm_kernel", "residual_with_x_stride", "addresses the residual's rows with x's row stride",
       ("r = tl.load(res_ptr + row * stride_r + offs", "r = tl.load(res_ptr + row * stride_x + offs"),
       ("tl.store(res_ptr + row * stride_r + offs", "tl.store(res_ptr + row * stride_x + offs")),
    _m("fused_add_rms_norm_kernel", "x_with_residual_stride", "addresses x's rows with the residual's row stride",
       ("x = tl.load(x_ptr + row * stride_x + offs", "x = tl.load(x_ptr + row * stride_r + offs"),
       ("tl.store(x_ptr + row * stride_x + offs", "tl.store(x_ptr + row * stride_r + offs")),
    _m("fused_add_rms_norm_kernel", "unmasked_stores", "stores the whole BLOCK: the lanes past the row's end too",
       ("tl.store(res_ptr + row * stride_r + offs, s, mask=mask)", "tl.store(res_ptr + row * stride_r + offs, s)"),
       ("tl.store(x_ptr + row * stride_x + offs, y, mask=mask)", "tl.store(x_ptr + row * stride_x + offs, y)")),
    _m("fused_add_rms_norm_kernel", "mean_over_the_block", "the mean square taken over the padded BLOCK, not the N "
       "real elements", ("w, eps, N, UNIT_OFFSET", "w, eps, BLOCK, UNIT_OFFSET")),
    _m("fused_add_rms_norm_kernel", "unmasked_loads", "loads the padding lanes past the row's end too",
       ("x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)", "x = tl.load(x_ptr + row * stride_x + offs)"),
       ("r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)", "r = tl.load(res_ptr + row * stride_r + offs)")),
    # ---------------------------------------------------------------- phase 9
    _m("graph_buckets", "inclusive_range", "range(8, max + 1, 8) then the max again: a size twice",
       ("range(8, max_batch_size, 8)", "range(8, max_batch_size + 1, 8)")),
    _m("graph_buckets", "small_sizes_unchecked", "1, 2, 4 captured even above the largest size",
       ("[b for b in (1, 2, 4) if b < max_batch_size]", "[1, 2, 4]")),
    _m("graph_buckets", "largest_only_if_multiple", "the largest size is captured only when it is a multiple of 8",
       ("    sizes += list(range(8, max_batch_size, 8))\n    sizes.append(max_batch_size)\n",
        "    sizes += list(range(8, max_batch_size + 1, 8))\n")),
    _m("graph_buckets", "powers_of_two", "doubles past 4 (8, 16, 32, ...) instead of every multiple of 8",
       ("    sizes += list(range(8, max_batch_size, 8))\n",
        "    sizes += [1 << k for k in range(3, max_batch_size.bit_length()) if 1 << k < max_batch_size]\n")),
    _m("graph_buckets", "multiples_from_16", "the multiples of 8 start at 16: 8 is never captured",
       ("range(8, max_batch_size, 8)", "range(16, max_batch_size, 8)")),
    _m("graph_buckets", "stops_a_multiple_early", "the multiples of 8 stop one short of the largest size's",
       ("range(8, max_batch_size, 8)", "range(8, max_batch_size - 8, 8)")),
    _m("bucket_for", "decode_pattern_arithmetic", "computes the bucket from the decode sizes' pattern instead of "
       "searching sizes", ("    for size in sizes:\n        if size >= batch_size:\n            return size\n    return None\n",
                           "    if batch_size > sizes[-1]:\n        return None\n"
                           "    if batch_size <= 4:\n        return 1 << (batch_size - 1).bit_length()\n"
                           "    return min(-(-batch_size // 8) * 8, sizes[-1])\n")),
    _m("bucket_for", "largest_that_fits_inside", "rounds down: the largest size not above the batch",
       ("    for size in sizes:\n        if size >= batch_size:\n            return size\n    return None\n",
        "    for size in reversed(sizes):\n        if size <= batch_size:\n            return size\n    return None\n")),
    _m("bucket_for", "guard_reads_the_last", "checks the widest size first, which an empty list does not have",
       ("    for size in sizes:\n", "    if batch_size > sizes[-1]:\n        return None\n    for size in sizes:\n")),
    _m("bucket_for", "index_not_size", "returns the bucket's index in sizes, not its size",
       ("    for size in sizes:\n        if size >= batch_size:\n            return size\n",
        "    for i, size in enumerate(sizes):\n        if size >= batch_size:\n            return i\n")),
    _m("bucket_for", "strict_bound", "a batch that exactly fills a bucket goes to the next one",
       ("if size >= batch_size:", "if size > batch_size:")),
    _m("bucket_for", "widest_instead_of_none", "a batch wider than every graph is sent to the largest one",
       ("    return None\n", "    return sizes[-1]\n")),
    _m("decode_split_plan", "wide_unsplit", "a wide batch never splits: one long context walks all its keys alone",
       ("    return max(1, min(triton.cdiv(max_context, LONG_SPLIT_KEYS), 64)), LONG_SPLIT_KEYS\n",
        "    return 1, 0\n")),
    _m("decode_split_plan", "no_minimum_slice", "a wide batch splits every sequence, short ones into tiny slices",
       ("64)), LONG_SPLIT_KEYS\n", "64)), 0\n")),
    _m("decode_split_plan", "uncapped", "the slice count grows without the 64 cap",
       ("min(triton.cdiv(max_context, LONG_SPLIT_KEYS), 64)", "triton.cdiv(max_context, LONG_SPLIT_KEYS)")),
    _m("decode_split_plan", "narrow_with_minimum", "a narrow batch's slices get the long minimum too",
       ("        return fill, 0\n", "        return fill, LONG_SPLIT_KEYS\n")),
    _m("pdl_wait", "launch_before_wait", "lets the next kernel launch before waiting for the previous one",
       ("        tl.extra.cuda.gdc_wait()\n        tl.extra.cuda.gdc_launch_dependents()\n",
        "        tl.extra.cuda.gdc_launch_dependents()\n        tl.extra.cuda.gdc_wait()\n")),
    _m("pdl_wait", "never_waits", "lets the next kernel launch, but reads before the previous one has finished",
       ("        tl.extra.cuda.gdc_wait()\n", "")),
    _m("pdl_wait", "always", "emits the instructions without PDL too",
       ("    if USE_PDL:\n        tl.extra.cuda.gdc_wait()\n        tl.extra.cuda.gdc_launch_dependents()\n",
        "    tl.extra.cuda.gdc_wait()\n    tl.extra.cuda.gdc_launch_dependents()\n")),
    _m("pdl_wait", "never_lets_the_next_launch", "waits, but never lets the next kernel launch early",
       ("        tl.extra.cuda.gdc_launch_dependents()\n", "")),
    _m("pdl_wait", "inverted_flag", "emits the instructions only without PDL",
       ("    if USE_PDL:\n", "    if not USE_PDL:\n")),
    _m("pdl_wait", "barrier_for_wait", "a block-wide barrier in place of the wait for the previous kernel",
       ("        tl.extra.cuda.gdc_wait()\n", "        tl.debug_barrier()\n")),
    _m("prefill_buckets", "max_twice", "a maximum that is a power of 2 is captured twice",
       ("while t < max_tokens:", "while t <= max_tokens:")),
    _m("prefill_buckets", "starts_at_one", "buckets 1, 2, 4, 8 too: a one-token step is a decode",
       ("    t = 16\n", "    t = 1\n")),
    _m("prefill_buckets", "one_token_graph", "a maximum of 1 captures a one-token prefill graph",
       ("if max_tokens < 2:", "if max_tokens < 1:")),
    _m("prefill_buckets", "multiples_of_16", "steps of 16 (16, 32, 48, ...) instead of doubling",
       ("        t *= 2\n", "        t += 16\n")),
    _m("prefill_buckets", "nothing_below_16", "no graph when the maximum is under 16",
       ("if max_tokens < 2:", "if max_tokens < 16:")),
    _m("prefill_buckets", "two_is_a_decode", "a maximum of 2 captures nothing (<= 2 for < 2)",
       ("if max_tokens < 2:", "if max_tokens <= 2:")),
    _m("prefill_buckets", "maximum_first", "the maximum is put first, not last: the list is not ascending",
       ("    return sizes + [max_tokens]\n", "    return [max_tokens] + sizes\n")),
    _m("overlap_loop", "placeholders_before_processing", "marks the new placeholders before the previous "
       "step's tokens are applied, so those replace the wrong slot",
       ("            outputs += self._process_in_flight(stream)\n", ""),
       ("        self._in_flight = (scheduled, result)\n",
        "        outputs += self._process_in_flight(stream)\n        self._in_flight = (scheduled, result)\n")),
    _m("overlap_loop", "no_device_gather", "the next step's input keeps the placeholder instead of the token",
       ("prev = self._in_flight[1] if self._in_flight is not None else None", "prev = None")),
    _m("overlap_loop", "placeholder_for_finished", "a sequence that finished still gets a placeholder",
       ("            if not seq.is_finished:\n                seq.token_ids.append(PLACEHOLDER)",
        "            seq.token_ids.append(PLACEHOLDER)")),
    _m("overlap_loop", "processes_before_launch", "applies the previous step's tokens before launching this one: "
       "nothing overlaps, and a sequence that finished there is freed under the step about to run it",
       ("            result = self.runner.execute(scheduled, self.eos_token_ids, prev)\n"
        "            self.output_processor.advance(scheduled)\n"
        "            outputs += self._process_in_flight(stream)\n",
        "            outputs += self._process_in_flight(stream)\n"
        "            result = self.runner.execute(scheduled, self.eos_token_ids, prev)\n"
        "            self.output_processor.advance(scheduled)\n")),
    _m("overlap_loop", "placeholders_for_scheduled", "placeholders for the scheduled sequences, not the sampled ones "
       "(a fork gets none, a mid-prompt chunk one)",
       ("        for seq in result.sampled:  # their tokens are on the device: the next step reads them there\n",
        "        for seq in (item.seq for item in scheduled):\n")),
    _m("overlap_loop", "never_advanced", "this step's tokens are never counted as computed",
       ("            self.output_processor.advance(scheduled)\n", "")),
    # ---------------------------------------------------------------- phase 7
    _m("block_hash_chain", "unchained", "every block hashed alone: the same tokens after another prefix collide",
       ("parent = hash_block_tokens(parent, ", "parent = hash_block_tokens(NONE_HASH, ")),
    _m("block_hash_chain", "partial_block_keyed", "the partly filled last block gets a key too",
       ("range(len(hashes), len(token_ids) // block_size)", "range(len(hashes), -(-len(token_ids) // block_size))")),
    _m("block_hash_chain", "known_not_continued", "the chain restarts after the known keys",
       ("parent = hashes[-1] if hashes else NONE_HASH", "parent = NONE_HASH")),
    _m("block_hash_chain", "known_recomputed", "ignores the known keys and hashes the whole stream again (every "
       "growing sequence rehashes all its blocks at every step)",
       ("hashes = list(known or [])", "hashes = []")),
    _m("block_hash_chain", "extra_keys_dropped", "the extra keys are not hashed: an adapter's blocks hit another's",
       ("token_ids[i * block_size : (i + 1) * block_size], extra_keys)", "token_ids[i * block_size : (i + 1) * block_size])")),
    _m("block_hash_chain", "last_token_kept_out", "the lookup's rule (never the last token) applied to the keys: a "
       "stream that fills its last block gets no key for it",
       ("range(len(hashes), len(token_ids) // block_size)", "range(len(hashes), (len(token_ids) - 1) // block_size)")),
    _m("prefix_lookup", "last_token_cached", "a full hit takes the last token from the cache too",
       ("max_blocks = (len(tokens) - 1) // bs", "max_blocks = len(tokens) // bs")),
    _m("prefix_lookup", "skips_misses", "goes on past a miss and takes later cached blocks",
       ("            if block is None:\n                break\n", "            if block is None:\n                continue\n")),
    _m("prefix_lookup", "first_block_tokens", "checks every block against the first block's tokens",
       ("tokens[i * bs : (i + 1) * bs]", "tokens[:bs]")),
    _m("prefix_lookup", "trusts_the_key", "takes the block the key maps to without comparing its tokens",
       ("block = self.pool.lookup(h, tokens[i * bs : (i + 1) * bs])", "block = self.pool.cached.get(h)")),
    _m("prefix_lookup", "prompt_only", "looks up the prompt only: a preempted sequence misses the blocks of the "
       "tokens it generated", ("max_blocks = (len(tokens) - 1) // bs", "max_blocks = (seq.num_prompt_tokens - 1) // bs")),
    _m("prefix_lookup", "takes_the_blocks", "touches the hits during the lookup (which admission asks three times)",
       ("        return hits\n", "        self.pool.touch(hits)\n        return hits\n")),
    _m("prefix_lookup", "full_blocks_minus_one", "always leaves the last full block out, even when the last token is "
       "in a partial block after it", ("max_blocks = (len(tokens) - 1) // bs", "max_blocks = len(tokens) // bs - 1")),
    _m("lru_eviction", "most_recent_first", "evicts the most recently freed block",
       ("self.cached_free.popitem(last=False)", "self.cached_free.popitem()")),
    _m("lru_eviction", "stale_key", "the evicted block keeps its key: a later lookup finds overwritten K/V",
       ("        self._uncache(b)\n", "")),
    _m("lru_eviction", "hook_after_uncache", "on_evict is told after the key is gone",
       ("        if self.on_evict is not None:\n            self.on_evict(self.block_hash[b], b, self.block_tokens[b])\n"
        "        self._uncache(b)\n",
        "        self._uncache(b)\n        if self.on_evict is not None:\n"
        "            self.on_evict(self.block_hash[b], b, self.block_tokens[b])\n")),
    _m("lru_eviction", "hook_always_called", "calls on_evict even when none is set",
       ("        if self.on_evict is not None:\n            self.on_evict(", "        if True:\n            self.on_evict(")),
    _m("lru_eviction", "forgotten_by_hand", "drops the key by hand without bumping the pool's generation: a kept "
       "lookup still returns the evicted block", ("        self._uncache(b)\n",
                                                  "        del self.cached[self.block_hash[b]]\n"
                                                  "        self.block_hash[b] = self.block_tokens[b] = None\n")),
    _m("lru_eviction", "not_counted", "the eviction is not counted (num_evictions, a metric)",
       ("        self.num_evictions += 1\n", "")),
    _m("lru_eviction", "key_map_only", "drops the key from the map, but the block keeps its key and tokens",
       ("        self._uncache(b)\n", "        del self.cached[self.block_hash[b]]\n")),
    _m("lru_eviction", "lowest_id_first", "evicts the cached free block with the lowest id, not the least recently freed",
       ("b, _ = self.cached_free.popitem(last=False)", "b = min(self.cached_free)\n        del self.cached_free[b]")),
    # ---------------------------------------------------------------- phase 10
    _m("tiered_lookup", "device_only_prefix", "stops at the first block the device lacks, never looking below",
       ("        for name, contains in lower_tiers:\n            if contains(h):\n",
        "        for name, contains in lower_tiers[:0]:\n            if contains(h):\n")),
    _m("tiered_lookup", "holes_skipped", "a block no tier holds is skipped instead of ending the prefix",
       ("        else:\n            break\n    return found", "        else:\n            continue\n    return found")),
    _m("tiered_lookup", "slowest_tier_first", "a block in both lower tiers is read from the disk",
       ("        for name, contains in lower_tiers:", "        for name, contains in reversed(lower_tiers):")),
    _m("tiered_lookup", "lower_tier_before_device", "asks the lower tiers first: a block also on the device is "
       "restored from the host", ("        if on_device(h):\n",
                                  "        if on_device(h) and not any(c(h) for _, c in lower_tiers):\n")),
    _m("tiered_lookup", "device_only_before_lower", "after the first lower-tier block only lower tiers are asked",
       ("        if on_device(h):\n", "        if on_device(h) and all(f == \"device\" for f in found):\n")),
    _m("tiered_lookup", "every_tier_listed", "no break once a tier holds the block: it is listed once per tier, "
       "and the walk ends", ("                found.append(name)\n                break\n",
                            "                found.append(name)\n")),
    _m("tiered_lookup", "host_only", "asks the host and never the disk",
       ("        for name, contains in lower_tiers:", "        for name, contains in lower_tiers[:1]:")),
    _m("tiered_lookup", "device_past_hole", "a hole ends only the lower tiers' part: device blocks after it still "
       "count (their prefix is missing)",
       ("    found: list[str] = []\n", "    found: list[str] = []\n    hole = False\n"),
       ("            continue\n        for name", "            continue\n        if hole:\n            continue\n"
        "        for name"),
       ("        else:\n            break\n", "        else:\n            hole = True\n")),
    _m("break_even", "no_fixed_cost", "ignores the fixed latency: restore always wins from one token",
       ("math.floor(Fraction(fixed_latency_s) / saving_per_token) + 1", "1")),
    _m("break_even", "ceil_not_strict", "ceil(fixed / saving): at an exact multiple restore only ties",
       ("math.floor(Fraction(fixed_latency_s) / saving_per_token) + 1",
        "math.ceil(Fraction(fixed_latency_s) / saving_per_token)")),
    _m("break_even", "copy_cost_ignored", "the copy's per-token cost is left out of the saving",
       ("1 / Fraction(prefill_tokens_per_s) - Fraction(kv_bytes_per_token) / Fraction(\n        bandwidth_bytes_per_s)",
        "1 / Fraction(prefill_tokens_per_s) - 0 * Fraction(kv_bytes_per_token) / Fraction(\n        bandwidth_bytes_per_s)")),
    _m("break_even", "floats", "plain division: ints and floats give a float ratio, and a tie that rounds below "
       "the integer counts as a win",
       ("1 / Fraction(prefill_tokens_per_s) - Fraction(kv_bytes_per_token) / Fraction(\n        bandwidth_bytes_per_s)",
        "1 / prefill_tokens_per_s - kv_bytes_per_token / (\n        bandwidth_bytes_per_s)")),
    _m("break_even", "zero_saving_divides", "a zero saving is not 'never': < for <=, then a division by zero",
       ("if saving_per_token <= 0:", "if saving_per_token < 0:")),
    _m("break_even", "ties_win", "floor(fixed / saving) without the + 1: at an exact multiple a tie counts as a win",
       ("math.floor(Fraction(fixed_latency_s) / saving_per_token) + 1",
        "math.floor(Fraction(fixed_latency_s) / saving_per_token)")),
    _m("break_even", "ceil_plus_one", "ceil(fixed / saving) + 1: one token too many unless the ratio is whole",
       ("math.floor(Fraction(fixed_latency_s) / saving_per_token) + 1",
        "math.ceil(Fraction(fixed_latency_s) / saving_per_token) + 1")),
    _m("break_even", "rounded", "round(fixed / saving) + 1 for floor",
       ("math.floor(Fraction(fixed_latency_s) / saving_per_token) + 1",
        "round(Fraction(fixed_latency_s) / saving_per_token) + 1")),
    # ---------------------------------------------------------------- phase 11
    _m("symmetric_quantize", "truncates", "rounds toward zero: an error of up to a whole step",
       ("q = x.round().clamp(-qmax, qmax)", "q = x.trunc().clamp(-qmax, qmax)")),
    _m("symmetric_quantize", "qmax_plus_one", "scale = amax / (qmax + 1): the largest weight is clipped by a "
       "whole step", ("amax / qmax,", "amax / (qmax + 1),")),
    _m("symmetric_quantize", "per_tensor", "one scale for the whole tensor instead of one per block",
       ("scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))",
        "scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).amax().expand(amax.shape)")),
    _m("symmetric_quantize", "zero_block_divides", "a block of zeros gets scale 0 (0 / 0: NaN codes)",
       ("torch.ones_like(amax)", "torch.zeros_like(amax)")),
    _m("per_token_fp8", "per_tensor", "one scale for the whole batch: a row of small values sinks into e4m3's "
       "subnormals", ("amax = xf.abs().amax(dim=-1, keepdim=True)", "amax = xf.abs().amax().expand(xf.shape[0], 1)")),
    _m("per_token_fp8", "per_column", "the max over the tokens (dim 0) instead of over each token's features",
       ("amax = xf.abs().amax(dim=-1, keepdim=True)", "amax = xf.abs().amax(dim=0, keepdim=True)")),
    _m("per_token_fp8", "int8_range", "int8's 127 for e4m3's 448: the values use a third of the range",
       ("amax / FP8_MAX,", "amax / 127,")),
    _m("per_token_fp8", "zero_row_divides", "a row of zeros gets scale 0 (0 / 0: NaN codes)",
       ("torch.ones_like(amax)", "torch.zeros_like(amax)")),
    _m("per_token_fp8", "multiplies", "multiplies by the scale instead of dividing",
       ("(xf / scale).clamp", "(xf * scale).clamp")),
    _m("unpack_int4", "no_offset", "forgets the + 8 offset: codes 0..15 instead of -8..7",
       ("return (u - 8).to(torch.int8)", "return u.to(torch.int8)")),
    _m("unpack_int4", "high_nibble_first", "reads the highest nibble as the first value",
       ("shifts = torch.arange(0, 32, 4,", "shifts = torch.arange(28, -4, -4,")),
    _m("unpack_int4", "sign_extended", "no mask after the shift: the top nibble keeps the sign bits",
       ("u = (packed[:, :, None] >> shifts) & 0xF", "u = (packed[:, :, None] >> shifts) % 256")),
    # ---------------------------------------------------------------- phase 13
    _m("token_bitmask", "bit_order_reversed", "reads bit 31 - j of a word as token 32 w + j (big-endian bits)",
       ("shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)",
        "shifts = torch.arange(31, -1, -1, device=bitmask.device, dtype=torch.int32)")),
    _m("token_bitmask", "masks_every_row", "applies the first mask row to every row of the batch",
       ('    out = logits.clone()\n    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))',
        '    out = logits.masked_fill(~allowed[:1], float("-inf"))')),
    _m("token_bitmask", "in_place", "writes -inf into the caller's logits",
       ("    out = logits.clone()\n", "    out = logits\n")),
    _m("token_bitmask", "short_mask_allows_the_rest", "a mask shorter than the vocabulary allows the tokens past "
       "its last word", ("value=False)", "value=True)")),
    _m("token_bitmask", "short_mask_unpadded", "a mask shorter than the vocabulary is not padded (a shape error)",
       ("    if allowed.shape[1] < vocab:\n", "    if False:\n")),
    _m("token_bitmask", "last_token_dropped", "keeps V - 1 bits: the last token is never allowed",
       ("[:, :vocab].bool()", "[:, :vocab - 1].bool()")),
    _m("token_bitmask", "word_major_bits", "reads the bits bit-major (token j W + w), not word-major",
       ("bits.view(bitmask.shape[0], -1)", "bits.transpose(1, 2).reshape(bitmask.shape[0], -1)")),
    _m("token_bitmask", "mask_row_is_logits_row", "mask row r applied to logits row r, not to rows[r]",
       ('    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))',
        '    out[:len(rows)] = logits[:len(rows)].masked_fill(~allowed, float("-inf"))')),
    _m("token_bitmask", "finite_min", "the dtype's lowest finite value instead of -inf",
       ('masked_fill(~allowed, float("-inf"))', "masked_fill(~allowed, torch.finfo(logits.dtype).min)")),
    _m("choice_regex", "unescaped", "joins the choices without escaping: 'a.b' also matches 'aXb'",
       ('"|".join(re.escape(c) for c in choices)', '"|".join(choices)')),
    _m("choice_regex", "no_group", "no group around the alternation: the anchors of a longer regex bind to "
       "the first and last choice only", ('return "(" + "|".join(re.escape(c) for c in choices) + ")"',
                                          'return "|".join(re.escape(c) for c in choices)')),
    _m("choice_regex", "empty_allowed", "accepts an empty list (a constraint no output satisfies)",
       ("    if not isinstance(choices, (list, tuple)) or not choices:\n",
        "    if not isinstance(choices, (list, tuple)):\n")),
    _m("choice_regex", "empty_choice_allowed", "accepts an empty string among the choices (the empty output "
       "satisfies the constraint)", ("if not isinstance(c, str) or not c:", "if not isinstance(c, str):")),
    _m("choice_regex", "non_string_choice", "checks only that a choice is non-empty: a number escapes to a "
       "TypeError, not a ValueError", ("if not isinstance(c, str) or not c:", "if not c:")),
    _m("choice_regex", "string_as_list", "a bare string is taken as a list of its characters ('yes' -> y|e|s)",
       ("if not isinstance(choices, (list, tuple)) or not choices:", "if not choices:")),
    _m("choice_regex", "anchored", "anchors the alternation with ^ and $: it no longer composes",
       ('return "(" + "|".join(re.escape(c) for c in choices) + ")"',
        'return "^(" + "|".join(re.escape(c) for c in choices) + ")$"')),
    _m("choice_regex", "each_choice_grouped", "groups each choice, not the alternation",
       ('return "(" + "|".join(re.escape(c) for c in choices) + ")"',
        'return "|".join("(" + re.escape(c) + ")" for c in choices)')),
    # ---------------------------------------------------------------- phase 17: hybrid linear attention
    _m("gated_delta_step", "decay_after_write", "the decay applied after the delta write (and the prediction "
       "read from the undecayed state)",
       ("    state = state * g.float().exp()[..., None, None]\n    predicted", "    predicted"),
       ("    o = (state", "    state = state * g.float().exp()[..., None, None]\n    o = (state")),
    _m("gated_delta_step", "no_delta", "plain linear attention: writes beta * v, not the error the state makes",
       ("u = (v - predicted) * beta.float()[..., None]", "u = v * beta.float()[..., None]")),
    _m("gated_delta_step", "read_before_write", "the output read from the state before this token's write",
       ("    state = state + k[..., :, None] * u[..., None, :]\n    o = (state * q[..., :, None]).sum(-2)\n",
        "    o = (state * q[..., :, None]).sum(-2)\n    state = state + k[..., :, None] * u[..., None, :]\n")),
    _m("conv1d_update", "state_not_shifted", "keeps the oldest inputs: drops the new token from the state",
       ("window[:, :, 1:]", "window[:, :, :-1]")),
    _m("conv1d_update", "new_token_first", "the new token put before the stored ones: the taps meet the "
       "wrong inputs", ("torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=2)",
                        "torch.cat([x[:, :, None], conv_state.to(x.dtype)], dim=2)")),
    _m("conv1d_update", "no_silu", "the convolution without its SiLU", ("F.silu(y).to(x.dtype)", "y.to(x.dtype)")),
    _m("partial_rope", "full_rotation_pairs", "pairs i with i + D / 2, as a full rotation would: the pairs mix "
       "rotated and passed-through dimensions", ("x1, x2 = x[..., :half], x[..., half:2 * half]",
                                                 "x1, x2 = x[..., :half], x[..., x.shape[-1] // 2:x.shape[-1] // 2 + half]")),
    _m("partial_rope", "interleaved_pairs", "GPT-J's interleaved pairs (2i, 2i + 1), not the rotate-half layout",
       ("x1, x2 = x[..., :half], x[..., half:2 * half]", "x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]")),
    _m("partial_rope", "rotated_backwards", "the rotation's sign flipped: the angle taken negative",
       ("(x1 * c - x2 * s, x2 * c + x1 * s,", "(x1 * c + x2 * s, x2 * c - x1 * s,")),
    _m("partial_rope", "rest_zeroed", "the dimensions past rotary_dim dropped to zero instead of passed through",
       ("x[..., 2 * half:]), dim=-1)", "torch.zeros_like(x[..., 2 * half:])), dim=-1)")),
    _m("snapshot_lookup", "first_snapshot", "stops at the first snapshot: reuses less than it could",
       ("for n in range(len(hit), 0, -1):", "for n in range(1, len(hit) + 1):")),
    _m("snapshot_lookup", "whole_hit", "keeps the whole KV hit once a snapshot exists: the state after the "
       "snapshot is stale", ("                return hit[:n]\n", "                return hit\n")),
    _m("snapshot_lookup", "one_block_past", "keeps one block past the snapshot",
       ("                return hit[:n]\n", "                return hit[: n + 1]\n")),
    _m("snapshot_lookup", "no_snapshot_keeps_hit", "with no snapshot, reuses the KV hit from a zero state",
       ("        return []\n", "        return hit\n")),
    # ---------------------------------------------------------------- phase 15: MoE
    _m("moe_topk_routing", "never_renormalized", "norm_topk_prob ignored: the kept weights do not sum to 1",
       ("    if renormalize:\n        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)\n", "")),
    _m("moe_topk_routing", "renormalized_over_all_experts", "divides by the sum over every expert (1), not the kept",
       ("topk_weights / topk_weights.sum(dim=-1, keepdim=True)", "topk_weights / probs.sum(dim=-1, keepdim=True)")),
    _m("moe_topk_routing", "softmax_of_top_k_logits", "Mixtral's order: right only when renormalizing",
       ("    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)\n"
        "    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)\n",
        "    top_logits, topk_ids = torch.topk(router_logits.float(), top_k, dim=-1)\n"
        "    topk_weights = torch.softmax(top_logits, dim=-1)\n")),
    _m("moe_topk_routing", "softmax_in_input_dtype", "the softmax taken in the logits' dtype (bf16), cast to "
       "float32 after", ("torch.softmax(router_logits, dim=-1, dtype=torch.float32)",
                         "torch.softmax(router_logits, dim=-1).float()")),
    _m("moe_topk_routing", "softmax_over_tokens", "the softmax over the tokens (dim 0), not the experts",
       ("torch.softmax(router_logits, dim=-1, dtype=torch.float32)",
        "torch.softmax(router_logits, dim=0, dtype=torch.float32)")),
    _m("moe_topk_routing", "always_renormalized", "renormalizes when not asked",
       ("    if renormalize:\n", "    if True:\n")),
    _m("moe_topk_routing", "unsorted", "top-k without its order: the largest probability need not come first",
       ("torch.topk(probs, top_k, dim=-1)", "torch.topk(probs, top_k, dim=-1, sorted=False)")),
    _m("moe_topk_routing", "sigmoid_scores", "sigmoid scores (DeepSeek-V3's router), not a softmax",
       ("torch.softmax(router_logits, dim=-1, dtype=torch.float32)", "torch.sigmoid(router_logits.float())")),
    _m("moe_align_block_size", "runs_not_padded", "experts' runs not padded to the block: blocks mix experts",
       ("padded = (counts + block_size - 1) // block_size * block_size", "padded = counts.clone()")),
    _m("moe_align_block_size", "rank_from_padded_start", "a pair's rank counted from the padded start",
       ("torch.arange(n, device=device) - start[sorted_key]", "torch.arange(n, device=device) - padded_start[sorted_key]")),
    _m("moe_align_block_size", "block_expert_left_search", "a block starting where an expert's run ends is "
       "labelled with that expert", ("block_start, right=True)", "block_start, right=False)")),
    _m("moe_align_block_size", "unstable_sort", "an unstable sort: within an expert the pairs lose token order",
       ("torch.sort(key, stable=True)", "torch.sort(key)")),
    _m("moe_align_block_size", "inclusive_start", "an inclusive cumulative sum for where each expert's pairs begin",
       ("start = counts.cumsum(0) - counts", "start = counts.cumsum(0)")),
    _m("moe_align_block_size", "exact_multiple_padded", "pads a run that already fills its blocks (and an empty "
       "expert) by one more block", ("padded = (counts + block_size - 1) // block_size * block_size",
                                      "padded = (counts // block_size + 1) * block_size")),
    _m("moe_align_block_size", "dropped_pairs_placed", "the pairs of experts held elsewhere get a slot after the "
       "last run instead of the scratch slot",
       ("torch.where(sorted_key < num_experts, padded_start[sorted_key] + rank, size)",
        "(padded_start[sorted_key] + rank).clamp(max=size)")),
    _m("moe_align_block_size", "block_expert_from_starts", "searches the runs' starts, not their ends: every "
       "block labelled with the next expert",
       ("torch.searchsorted(padded_end[:num_experts], block_start, right=True)",
        "torch.searchsorted(padded_start[:num_experts], block_start, right=True)")),
    # ---------------------------------------------------------------- phase 12
    _m("ngram_lookup", "latest_occurrence", "copies after the latest earlier occurrence, not the earliest (vLLM's)",
       ("start = int(hits[0]) + n", "start = int(hits[-1]) + n")),
    _m("ngram_lookup", "shortest_first", "tries the shortest n-gram first",
       ("for n in range(min(max_n, length - 1), min_n - 1, -1):", "for n in range(min_n, min(max_n, length - 1) + 1):")),
    _m("ngram_lookup", "matches_itself", "lets the suffix match itself (nothing follows it)",
       ("windows = np.lib.stride_tricks.sliding_window_view(t[: length - 1], n)",
        "windows = np.lib.stride_tricks.sliding_window_view(t, n)")),
    _m("greedy_acceptance", "counts_every_agreement", "counts agreements after the first rejection too",
       ("    a = 0\n    while a < len(draft) and sampled[a] == draft[a]:\n        a += 1\n    return a",
        "    return sum(s == d for s, d in zip(sampled, draft))")),
    _m("greedy_acceptance", "never_the_last_draft", "never accepts the last draft",
       ("while a < len(draft) and", "while a < len(draft) - 1 and")),
    _m("draft_backoff", "never_resets", "a round that accepts a draft does not reset the misses",
       ("        seq.spec_misses = 0\n        return", "        return")),
    _m("draft_backoff", "linear_pause", "the pause grows by one step per miss, not twice as long",
       ("2 ** (seq.spec_misses - BACKOFF_AFTER)", "seq.spec_misses - BACKOFF_AFTER + 1")),
    _m("draft_backoff", "no_cap", "the pause is not capped at BACKOFF_MAX_STEPS",
       ("min(2 ** (seq.spec_misses - BACKOFF_AFTER), BACKOFF_MAX_STEPS)", "2 ** (seq.spec_misses - BACKOFF_AFTER)")),
    _m("draft_backoff", "pauses_too_early", "pauses from the second miss in a row on",
       ("if seq.spec_misses >= BACKOFF_AFTER:", "if seq.spec_misses >= BACKOFF_AFTER - 1:")),
    _m("rejection_rule", "ignores_q", "accepts with probability p(x), as if the draft were a point mass",
       ("accept = u * q_x < p_x", "accept = u < p_x")),
    _m("rejection_rule", "residual_is_p", "samples a rejected position from p, not from max(0, p - q)",
       ("residual = torch.clamp(p[:, :k] - q, min=0.0)", "residual = p[:, :k].clone()")),
    _m("rejection_rule", "no_bonus", "after k acceptances samples the last residual again, not p_(k+1)",
       ("residual = torch.cat([residual, p[:, k:]], dim=1)", "residual = torch.cat([residual, residual[:, -1:]], dim=1)")),
    # ---------------------------------------------------------------- phase 14
    _m("row_parallel_linear", "no_all_reduce", "returns this rank's partial sum",
       ("y = self.parallel.all_reduce(F.linear(x, self.weight))", "y = F.linear(x, self.weight)")),
    _m("row_parallel_linear", "bias_in_every_rank", "adds the bias before the all-reduce: it is summed tp times",
       ("y = self.parallel.all_reduce(F.linear(x, self.weight))\n        return y if self.bias is None else y + self.bias",
        "return self.parallel.all_reduce(F.linear(x, self.weight, self.bias))")),
    _m("row_parallel_linear", "bias_assumed", "adds self.bias without checking for None (a layer without bias, "
       "Llama's o_proj and down_proj, fails)",
       ("return y if self.bias is None else y + self.bias", "return y + self.bias")),
    _m("row_parallel_linear", "bias_on_rank_zero", "adds the bias once in the sense of one rank, after the "
       "all-reduce: the other ranks lack it",
       ("return y if self.bias is None else y + self.bias",
        "return y if self.bias is None or self.parallel.rank > 0 else y + self.bias")),
    _m("row_parallel_linear", "averaged", "averages the partial sums (divides by tp)",
       ("y = self.parallel.all_reduce(F.linear(x, self.weight))",
        "y = self.parallel.all_reduce(F.linear(x, self.weight)) / self.parallel.tp_size")),
    _m("row_parallel_linear", "inputs_summed", "all-reduces the input features instead of the products",
       ("y = self.parallel.all_reduce(F.linear(x, self.weight))",
        "y = F.linear(self.parallel.all_reduce(x.clone()), self.weight)")),
    _m("row_parallel_linear", "two_all_reduces", "one collective too many: the sum is summed again",
       ("y = self.parallel.all_reduce(F.linear(x, self.weight))",
        "y = self.parallel.all_reduce(self.parallel.all_reduce(F.linear(x, self.weight)))")),
    _m("all_reduce_choice", "one_shot_exclusive", "a message of exactly one_shot_max_bytes goes two-shot",
       ("nbytes <= one_shot_max_bytes", "nbytes < one_shot_max_bytes")),
    _m("all_reduce_choice", "any_dtype", "float16 goes to symmetric memory, whose kernels have no float16",
       ("dtype not in SYMM_MEM_DTYPES or ", "")),
    _m("all_reduce_choice", "no_buffer_limit", "messages larger than the symmetric buffer go two-shot",
       (" or nbytes > max_bytes", "")),
    _m("vocab_parallel_embedding", "no_mask", "rows of ids held elsewhere are looked up (clamped) and summed too",
       ("return self.parallel.all_reduce(h * mine[:, None].to(h.dtype))", "return self.parallel.all_reduce(h)")),
    _m("vocab_parallel_embedding", "global_ids", "indexes the local table with global ids",
       ("local = ids - self.vocab_start", "local = ids")),
    _m("vocab_parallel_embedding", "inclusive_end", "the first id of the next rank counts as this rank's (<= for <)",
       ("(local < self.num_embeddings)", "(local <= self.num_embeddings)")),
    _m("vocab_parallel_embedding", "no_lower_bound", "only the end of the slice is checked: ids of earlier ranks "
       "count as row 0", ("mine = (local >= 0) & (local < self.num_embeddings)", "mine = local < self.num_embeddings")),
    _m("vocab_parallel_embedding", "strict_start", "the slice's first id is not this rank's (> for >=)",
       ("(local >= 0)", "(local > 0)")),
    _m("vocab_parallel_embedding", "last_row_dropped", "the slice's last row is not this rank's",
       ("(local < self.num_embeddings)", "(local < self.num_embeddings - 1)")),
    _m("vocab_parallel_embedding", "mask_after_all_reduce", "zeros the ids held elsewhere after the all-reduce",
       ("return self.parallel.all_reduce(h * mine[:, None].to(h.dtype))",
        "return self.parallel.all_reduce(h) * mine[:, None].to(h.dtype)")),
    # ---------------------------------------------------------------- phase 15 (expert parallelism)
    _m("moe_dispatch_combine", "unweighted_combine", "sums the experts' outputs without the routing weights",
       ("(y * weights.flatten()[order, None].to(y.dtype))", "y")),
    _m("moe_dispatch_combine", "pair_to_token", "maps a sorted pair to its token with % instead of //",
       ("token = order // k", "token = order % k")),
    _m("moe_dispatch_combine", "owner_round_robin", "sends expert e to rank e % W, but ranks hold blocks of experts",
       ("dest = flat[order] // experts.num_local_experts", "dest = flat[order] % w")),
    _m("moe_dispatch_combine", "owner_by_world_size", "owner = expert // W (the number of ranks), not // E_local",
       ("dest = flat[order] // experts.num_local_experts", "dest = flat[order] // w")),
    _m("moe_dispatch_combine", "every_rank_all_tokens", "no split: every rank routes and computes every token "
       "(the right output, W times the expert work and traffic)",
       ("    per = -(-t // w)\n", "    per = t\n"),
       ("    lo, hi = min(rank * per, t), min((rank + 1) * per, t)\n", "    lo, hi = 0, t\n")),
    _m("moe_dispatch_combine", "floor_chunk", "chunks of T // W tokens: the remainder is never computed",
       ("per = -(-t // w)", "per = max(1, t // w)")),
    _m("moe_dispatch_combine", "splits_not_reversed", "the results go back with the dispatch's splits",
       ("y = _all_to_all(y_recv, len(order), send_splits, recv_splits, ps)",
        "y = _all_to_all(y_recv, len(order), recv_splits, send_splits, ps)")),
    _m("moe_dispatch_combine", "combine_overwrites", "index_copy_ for index_add_: a token keeps one expert's output",
       ("out.index_add_(0, token,", "out.index_copy_(0, token,")),
    # ---------------------------------------------------------------- phase 16
    _m("lora_scaling", "ignores_rslora", "divides by r even with use_rslora",
       ("return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r", "return lora_alpha / r")),
    _m("lora_scaling", "inverted", "r / alpha instead of alpha / r",
       ("else lora_alpha / r", "else r / lora_alpha")),
    _m("lora_scaling", "sqrt_always", "rsLoRA's square root for every adapter",
       ("else lora_alpha / r", "else lora_alpha / math.sqrt(r)")),
    _m("lora_segments", "keeps_no_adapter_rows", "the rows with slot -1 are listed too (first, as slot -1 sorts first)",
       ("    order = order[slots[order] >= 0]  # the rows with an adapter, grouped by slot\n", "")),
    _m("lora_segments", "inclusive_starts", "each slot's start is the end of its own run (cumsum not shifted)",
       ("starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int32)",
        "starts = np.cumsum(counts).astype(np.int32)")),
    _m("lora_segments", "unsorted_rows", "the rows with an adapter in row order, not grouped by slot",
       ("order = np.argsort(slots, kind=\"stable\")", "order = np.arange(len(slots))")),
    _m("lora_segments", "counts_only_seen_slots", "bincount without minlength: the last slots have no count",
       ("np.bincount(slots[slots >= 0], minlength=num_slots)", "np.bincount(slots[slots >= 0])")),
    _m("moe_dispatch_combine", "weights_in_pair_order", "the routing weights in pair order, the outputs in sorted order",
       ("weights.flatten()[order, None]", "weights.flatten()[:, None]")),
]

MUTANTS: dict[str, list[Mutant]] = {}
for _mut in _ALL:
    MUTANTS.setdefault(_mut.exercise, []).append(_mut)
