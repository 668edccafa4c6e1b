"""The exercise catalogue: which regions of the engine's real code are exercises, and the markers.

An exercise is a region of the engine's real code, between two comment markers::

    # >>> EXERCISE rms_norm
    ...the reference solution, exactly as the engine runs it...
    # <<< EXERCISE rms_norm

There is no second copy of the solution to keep in sync: :func:`classroom.grading.prepare`
copies the repository, replaces each chosen region with ``raise NotImplementedError(hint)`` and
records the chosen exercises in the workspace (``.infer-exercises.json``);
:func:`classroom.grading.grade` runs the tests registered for each exercise (the same tests CI
runs, taken from the instructor's copy of the repository, never from the workspace a student can
edit) against the workspace's code. :mod:`classroom.mutants` keeps plausible wrong solutions of
every exercise, which the grader must FAIL.

This package lives beside ``src/``, not inside the ``infer`` package: ``import infer`` loads none
of it, and it finds the repository from its own location (``classroom/`` is at the repository's
root), wherever ``infer`` itself is installed. Run it from the repository root::

    python -m classroom list
    python -m classroom prepare --phase 0 --out ~/infer-phase0     # a student workspace
    python -m classroom grade --root ~/infer-phase0                # grade what was prepared
    python -m classroom mutants --exercise top_p                   # the wrong solutions FAIL
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # classroom/ sits at the repository root
TESTS = REPO / "tests"  # the instructor's tests: grading always runs these
MANIFEST = ".infer-exercises.json"  # written by prepare: which exercises a workspace holds
MARK = re.compile(r"^(?P<indent>[ \t]*)# (?P<kind>>>>|<<<) EXERCISE (?P<name>\w+)\s*$")

# The engine's main path: every test that runs the engine (a prompt in, tokens out) executes
# all of these regions, so an exercise graded by such tests can pass only once these pass.
ENGINE_PATH = ("rms_norm", "apply_rope", "decode_attention", "block_free", "slot_mapping", "admission",
               "flatten_batch", "stop_check")


@dataclass(frozen=True)
class Exercise:
    """One exercise: where it is, what grades it, and what the student is told.

    ``needs``: other exercises whose regions its grading tests also run; with those stubbed
    too, it cannot pass until they do (``list`` orders them first, ``grade`` says so).
    """

    name: str
    phase: int
    file: str  # relative to the repository root
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root; the quickest first
    hint: str
    minutes: int
    needs: tuple[str, ...] = ()


def _engine(name: str, *extra: str) -> tuple[str, ...]:
    return tuple(n for n in (*ENGINE_PATH, *extra) if n != name)


EXERCISES: dict[str, Exercise] = {
    e.name: e
    for e in [
        Exercise(
            "rms_norm", 0, "src/infer/models/layers.py",
            ("tests/test_layers.py::test_rms_norm_matches_definition",
             "tests/test_layers.py::test_rms_norm_rounds_like_hf"),
            "Divide x by the root of the mean of its squares over the last dimension (eps inside the "
            "root), in float32. Llama and Gemma then scale by the weight differently, and in bfloat16 "
            "where you cast back to x.dtype changes the result: read the docstring and the HF classes it "
            "names. Return x.dtype.",
            15,
        ),
        Exercise(
            "apply_rope", 0, "src/infer/models/layers.py",
            ("tests/test_layers.py::test_apply_rope_is_a_rotation",
             "tests/test_layers.py::test_rope_relative_position_property"),
            "x is [T, heads, head_dim], cos/sin are [T, head_dim] (broadcast them over heads). RoPE rotates "
            "pairs of dimensions by a position-dependent angle; in the 'rotate half' layout the pairs are "
            "(i, i + head_dim/2). Write the 2-D rotation of such a pair and vectorize it.",
            20,
        ),
        Exercise(
            "top_p", 1, "src/infer/sampling/logits_processors.py",
            ("tests/test_sampler.py::test_top_p_keeps_exact_sets", "tests/test_sampler.py::test_top_p_edges",
             "tests/test_sampler.py::test_top_p_stops_where_the_mass_reaches_top_p_exactly",
             "tests/test_sampler.py::test_truncated_frequencies_match_distribution"),
            "Nucleus sampling keeps the most likely tokens until their probability mass reaches top_p, and "
            "always at least the top token. Think about which tokens count as 'before' a token in the "
            "sorted order, about ties with the last kept token, and about top_p = 1. Write -inf into the "
            "removed logits; no Python loop over rows.",
            30,
        ),
        Exercise(
            "stop_check", 1, "src/infer/engine/output_processor.py",
            ("tests/test_generation.py::test_stop_conditions",),
            "Decide after each new token whether the sequence is done, and why: the OpenAI API's "
            "finish_reason is 'stop' (an end-of-sequence token unless the request ignores it, a stop token "
            "id, a stop string the detokenizer found) or 'length' (max_tokens reached, or the context is "
            "full); stop_reason says which stop matched. Read SamplingParams for the fields.",
            15, _engine("stop_check"),
        ),
        Exercise(
            "sampling_or_reject", 2, "src/infer/server/serving.py",
            ("tests/test_server.py::test_bad_request[min_tokens-over-max_tokens]",
             "tests/test_server.py::test_bad_request[temperature-negative]",
             "tests/test_server.py::test_bad_request[stop-empty-string]",
             "tests/test_server.py::test_bad_request[n-1000]",
             "tests/test_server.py::test_bad_request[n-1000-chat]",
             "tests/test_server.py::test_bad_request[suffix]",
             "tests/test_server.py::test_bad_request[tools-no-name]",
             "tests/test_server.py::test_bad_request[top_logprobs-without-logprobs]",
             "tests/test_server.py::test_openai_client_raises_on_bad_request",
             "tests/test_server.py::test_same_answer_after_bad_requests"),
            "A bad request must become an HTTP 400 whose OpenAI-shaped error body names the offending "
            "field (param), never a 500. Building the SamplingParams validates the request: find out what "
            "it raises (this module has helpers for both kinds of error and for the body), and enforce "
            "the server's own limit on the number of sequences.",
            10, _engine("sampling_or_reject"),
        ),
        Exercise(
            "chat_sse", 2, "src/infer/server/routes/chat.py",
            ("tests/test_server.py::test_chat_stream_n_logprobs_usage_and_done",
             "tests/test_server.py::test_stream_include_usage",
             "tests/test_server.py::test_chat_stream_equals_non_stream"),
            "Turn the engine's stream of RequestOutputs into OpenAI chat.completion.chunk events (the "
            "non-streamed answer, chat_response above, builds the same fields). Each output carries, per sequence, only "
            "what is new; each choice index must end exactly once; the stream ends with the usage chunk "
            "(when asked for) and the SSE terminator of the OpenAI API.",
            25, _engine("chat_sse", "sampling_or_reject"),
        ),
        Exercise(
            "abort_request", 2, "src/infer/server/async_engine.py",
            ("tests/test_server.py::test_stream_disconnect_aborts_request",
             "tests/test_server.py::test_queued_client_disconnect_frees_its_place",
             "tests/test_server.py::test_graceful_shutdown_on_sigterm"),
            "Runs on the engine thread when a client goes away or the server shuts down. The request must "
            "leave the engine (its KV blocks freed), be counted as finished with finish_reason 'abort' "
            "(look at how _deliver_step records finished requests), and whoever waits on its stream must get a "
            "final output, shaped as the request's output kind asks (the engine builds every output the "
            "same way). A request that already finished, or that nobody knows, needs nothing.",
            30, _engine("abort_request", "sampling_or_reject"),
        ),
        Exercise(
            "batch_ready", 3, "src/infer/engine/batching.py",
            ("tests/test_batching.py::test_static_batch_waits_for_timeout_or_a_full_batch",
             "tests/test_batching.py::test_static_batch_counts_sequences_not_requests",
             "tests/test_batching.py::test_continuous_admits_at_every_step_and_static_waits_for_the_batch"),
            "Static batching starts a batch only when none is running, and then when waiting work fills a "
            "batch (count sequences, not requests: a request may ask for n) or the oldest request has "
            "waited long enough (arrival times are time.perf_counter() seconds).",
            10, _engine("batch_ready"),
        ),
        Exercise(
            "flatten_batch", 3, "src/infer/engine/step.py",
            ("tests/test_batching.py::test_batched_greedy_tokens_are_the_argmax_of_a_cache_free_forward",
             "tests/test_batching.py::test_abort_mid_batch_frees_its_row_and_disturbs_nobody[continuous]",
             "tests/test_batching.py::test_n_sequences_share_one_prefill"),
            "One forward runs all scheduled sequences as one flat list of new tokens (see "
            "AttentionMetadata): concatenate each sequence's new tokens and positions, and record where "
            "each sequence starts and how long its context is once this step's tokens are in "
            "(chunk_extent tells where a sequence's new tokens sit and whether it samples). A sequence "
            "samples at its last new token; forks share that token's logits.",
            25, _engine("flatten_batch"),
        ),
        Exercise(
            "admission", 4, "src/infer/engine/scheduler.py",
            ("tests/test_batching.py::test_none_admits_one_request_and_static_a_whole_batch_past_the_budget",
             "tests/test_batching.py::test_continuous_admits_at_every_step_and_static_waits_for_the_batch",
             "tests/test_batching.py::test_token_budget_is_respected",
             "tests/test_batching.py::test_abort_mid_batch_frees_its_row_and_disturbs_nobody",
             "tests/test_paged.py::test_preemption_frees_blocks_requeues_at_the_front_and_resumes",
             "tests/test_paged.py::test_preemption_of_a_forked_request_after_its_first_sequence_was_scheduled"),
            "Admit waiting requests first come, first served, while they fit (sequence slots, KV blocks, "
            "this step's token budget); the first that does not fit stops admission. What must fit the "
            "budget is the request's first prefill, which after a preemption is longer than its prompt "
            "(there is a helper). _admit does the bookkeeping and returns the budget left. Read the "
            "docstring for what 'none' and 'static' change.",
            30, _engine("admission", "preemption"),
        ),
        Exercise(
            "decode_attention", 4, "src/infer/attention/torch_backend.py",
            ("tests/test_batching.py::test_decode_attention_matches_per_sequence_reference",),
            "Each sequence has one new query and attends to the first seq_len keys of its own cache row "
            "(a sliding window keeps only the most recent ones). Batch all sequences into one "
            "scaled-dot-product attention call with a mask; for grouped-query attention, let the query "
            "heads that share a KV head attend to it together instead of copying K/V.",
            40,
        ),
        Exercise(
            "top_k", 4, "src/infer/sampling/logits_processors.py",
            ("tests/test_sampler.py::test_top_k_keeps_exact_sets", "tests/test_sampler.py::test_top_k_ties_and_infs",
             "tests/test_sampler.py::test_top_k_clamps_k_to_one"),
            "Per row keep the k largest logits (k differs per row and may be out of range) and write -inf "
            "elsewhere; tokens tied with the k-th largest stay. Find each row's threshold without a loop "
            "over rows.",
            20,
        ),
        Exercise(
            "block_free", 5, "src/infer/engine/block_pool.py",
            ("tests/test_paged.py::test_block_pool_hands_out_lowest_first_and_counts_holders",
             "tests/test_paged.py::test_block_pool_rejects_misuse",
             "tests/test_paged.py::test_block_pool_random_walk_keeps_its_invariants",
             "tests/test_paged.py::test_forks_share_full_blocks_and_own_a_copy_of_the_last"),
            "Blocks are reference-counted: forks share blocks, so freeing drops one holder, and only a "
            "block nobody holds is free again. Keep the free list as allocate expects it (it hands out "
            "the lowest id first), and refuse a double free loudly.",
            15,
        ),
        Exercise(
            "slot_mapping", 5, "src/infer/attention/kv_cache.py",
            ("tests/test_paged.py::test_slot_mapping_walks_the_block_table",
             "tests/test_paged.py::test_paged_engine_matches_contiguous_with_forks_and_aborts"),
            "The cache is one array of num_blocks * block_size token slots. A sequence's block table lists "
            "its blocks in order: token position p lives in the table's (p // block_size)-th block. Map "
            "each new token (positions start .. start + n - 1 of each sequence) to its flat slot.",
            10, _engine("slot_mapping"),
        ),
        Exercise(
            "preemption", 5, "src/infer/engine/scheduler.py",
            ("tests/test_paged.py::test_preemption_of_a_forked_request_after_its_first_sequence_was_scheduled",
             "tests/test_paged.py::test_preemption_frees_blocks_requeues_at_the_front_and_resumes",
             "tests/test_paged.py::test_prompt_logprobs_are_not_repeated_after_a_preemption"),
            "Preemption by recompute (vLLM's policy): while the pool cannot give seq its new slots, evict "
            "the most recently admitted request (preempt() frees and requeues it). The caller's list of "
            "this step's scheduled work may already hold the victim's sequences: they must leave that very "
            "list. If the victim was seq's own request, seq cannot run this step: report it.",
            25, _engine("preemption"),
        ),
        Exercise(
            "paged_decode_inner_loop", 5, "src/infer/kernels/decode_attention.py",
            ("tests/test_kernels.py::test_decode_matches_reference",
             "tests/test_kernels.py::test_decode_splits_agree_with_each_other"),
            "One key tile of the Triton paged decode kernel (runs under TRITON_INTERPRET=1 on a CPU). Find "
            "each key's physical block through the block table and its row inside the block; load the K "
            "tile, score it against the query heads of this group (qk_scale is in log2 units) and mask "
            "keys past the end; update the online softmax state the loop set up (FlashAttention-2: a "
            "running max, a running sum, an accumulator rescaled when the max grows); accumulate P.V. "
            "Loaded tiles need the UPCAST cast (and, from an FP8 cache, phase 11, the FP8 one).",
            60,
        ),
        Exercise(
            "decode_split_plan", 5, "src/infer/kernels/decode_attention.py",
            ("tests/test_kernels.py::test_decode_split_plan",),
            "How many key slices the decode kernel's grid has per sequence, and how short a slice may be. "
            "A batch too narrow to fill the GPU splits every sequence the way decode_num_splits says, with "
            "no minimum slice; a batch that fills it must still split a context longer than LONG_SPLIT_KEYS "
            "into slices of that many keys (up to max_context's, at most 64), or that one sequence becomes "
            "the step's critical path. Return (num_splits, min_split_keys).",
            10,
        ),
        Exercise(
            "chunk_schedule", 6, "src/infer/engine/scheduler.py",
            ("tests/test_chunked_prefill.py::test_decodes_go_first_and_prefill_chunks_fill_the_rest",
             "tests/test_chunked_prefill.py::test_decodes_go_first_even_behind_an_older_prefill",
             "tests/test_chunked_prefill.py::test_forks_share_one_chunked_prefill",
             "tests/test_chunked_prefill.py::test_long_prefill_token_threshold_shares_the_budget",
             "tests/test_chunked_prefill.py::test_prefill_chunks_share_the_budget_in_admission_order",
             "tests/test_chunked_prefill.py::test_a_preemption_gives_its_tokens_back_to_the_budget",
             "tests/test_chunked_prefill.py::test_without_chunking_a_prompt_that_does_not_fit_waits_whole",
             "tests/test_chunked_prefill.py::test_chunked_matches_unchunked[llama-paged-7]",
             "tests/test_chunked_prefill.py::test_chunked_matches_unchunked[gemma3-contiguous-32]",
             "tests/test_chunked_prefill.py::test_preempted_half_prefilled_and_recomputed_sequences"),
            "The running sequences' share of a step's token budget. With chunked prefill, decodes go "
            "before prefill chunks (decode-maximal batching), the prompts keep their admission order, and a "
            "prompt gets only what the budget (and the per-request threshold) leaves; without it, a prompt "
            "runs whole or waits, and smaller work behind it still runs. A sequence that cannot get a block "
            "may be preempted, which changes what is left: the sequences a preemption takes out of the batch "
            "no longer spend the budget. A request's forks share its prefill: they may only join the chunk "
            "that completes the prompt.",
            30, _engine("chunk_schedule"),
        ),
        Exercise(
            "chunk_key_length", 6, "src/infer/engine/step.py",
            ("tests/test_chunked_prefill.py::test_chunk_extent_by_hand",),
            "Where does a chunk's first token sit, how many keys do its queries see (what is in the cache "
            "once this step writes its own K/V: not the whole prompt), and when does a sequence sample "
            "(only once nothing of it is left uncomputed, also after a preemption's recompute)?",
            10,
        ),
        Exercise(
            "fused_add_rms_norm_kernel", 8, "src/infer/kernels/fused_triton.py",
            ("tests/test_fused_kernels.py::test_fused_add_rms_norm_matches_reference",
             "tests/test_fused_kernels.py::test_fused_add_rms_norm_normalizes_the_rounded_sum"),
            "One program per row, in place: the sum of the row and its residual, rounded to the dtype, is "
            "the new residual (store it); the RMSNorm of that rounded sum, not of the float32 one, replaces "
            "the row. Each tensor's rows have their own stride, and a row has N elements in a BLOCK-wide "
            "program. Load both rows before storing either, compute in float32, and use the row helper "
            "_rms_norm_row for the norm (it keeps Llama's and Gemma's rounding orders; the norm weight w is "
            "loaded for you before the PDL wait). Runs under TRITON_INTERPRET=1 on a CPU.",
            30,
        ),
        Exercise(
            "graph_buckets", 9, "src/infer/engine/cuda_graphs.py",
            ("tests/test_fused_engine.py::test_graph_batch_sizes",),
            "The batch sizes captured as CUDA graphs, ascending: a few small powers of two, then every "
            "multiple of 8, and always the largest size itself, each once, none above it.",
            10,
        ),
        Exercise(
            "bucket_for", 9, "src/infer/engine/cuda_graphs.py",
            ("tests/test_fused_engine.py::test_bucket_for_picks_the_smallest_bucket_that_holds_the_batch",),
            "A step of B sequences replays the graph of the smallest captured size that holds all of them "
            "(the rest are padding rows); a step wider than every graph runs eagerly. sizes is any ascending "
            "list (decode batch sizes, prefill token counts), possibly empty: search it, assume no pattern.",
            5,
        ),
        Exercise(
            "prefill_buckets", 9, "src/infer/engine/cuda_graphs.py",
            ("tests/test_fused_engine.py::test_prefill_graph_sizes_are_powers_of_two_up_to_the_maximum",),
            "The token counts captured as one-sequence prefill graphs, ascending: 16, 32, 64, ... (powers of "
            "2) below the maximum, then the maximum itself, each once; none at all when the maximum is under "
            "2 (a one-token step is a decode).",
            5,
        ),
        Exercise(
            "pdl_wait", 9, "src/infer/kernels/pdl.py",
            ("tests/test_fused_kernels.py::test_wait_for_previous_waits_then_lets_the_next_kernel_launch",),
            "The first thing every decode-path kernel does when launched with programmatic dependent launch: "
            "wait until the kernel before it on the stream has completed (its writes visible), then allow "
            "the kernel after it to start launching; without PDL, nothing (the same kernel must also compile "
            "for GPUs that have no such instructions). tl.extra.cuda has the two instructions. Graded by "
            "compiling a kernel for an H100 (sm_90) on the CPU and reading its PTX.",
            10,
        ),
        Exercise(
            "overlap_loop", 9, "src/infer/engine/llm_engine.py",
            ("tests/test_async_scheduling.py::test_a_sequence_holds_one_placeholder_while_its_step_runs",
             "tests/test_async_scheduling.py::test_placeholders_go_to_the_sampled_sequences_and_their_tokens_count_as_computed",
             "tests/test_async_scheduling.py::test_async_scheduling_gives_the_synchronous_outputs[paged]"),
            "One async step: launch the scheduled step (its input reads the previous step's tokens on the "
            "device) and count its tokens as computed at once (the next step is scheduled before its outputs "
            "are processed), then let the host catch up with the previous step's outputs while the device "
            "works, then mark which sequences now wait for a token still on the device. Think about the "
            "order: what must the previous step's tokens replace, and which sequences sample this step (a "
            "fork of a shared prefill does; a prompt's middle chunk does not)?",
            30, _engine("overlap_loop"),
        ),
        # ---------------------------------------------------------------- phase 7
        Exercise(
            "block_hash_chain", 7, "src/infer/engine/prefix_cache.py",
            ("tests/test_prefix_caching.py::test_block_keys_are_chained_sha256_of_full_blocks",),
            "The keys of a token stream's full blocks: block i's key is hash_block_tokens of block i - 1's "
            "key (NONE_HASH for the first), block i's tokens and the extra keys, so a key names the whole "
            "prefix up to its block's end. A partly filled last block has no key; a full last block has one. "
            "Keys already known for a prefix of the stream are kept as given (not hashed again: a sequence "
            "extends its keys at every step), and the chain continues from the last of them.",
            10,
        ),
        Exercise(
            "prefix_lookup", 7, "src/infer/engine/kv_cache_manager.py",
            ("tests/test_prefix_caching.py::test_lookup_walks_to_the_first_miss_and_keeps_the_last_token",
             "tests/test_prefix_caching.py::test_lookup_stops_at_a_miss_even_when_later_blocks_are_cached",
             "tests/test_prefix_caching.py::test_lookup_compares_each_blocks_tokens_not_only_its_key",
             "tests/test_prefix_caching.py::test_lookup_covers_the_generated_tokens_too",
             "tests/test_prefix_caching.py::test_outputs_identical_with_the_cache[plain]"),
            "The longest cached prefix of a sequence, as block ids: walk its block keys from the first, "
            "asking the pool for each (a key alone is not proof: the block's tokens must match too), and "
            "stop at the first miss. All of the sequence's tokens count (after a preemption they include "
            "its generated ones), but never take its last token from the cache: its forward gives the "
            "logits the next token is sampled from. Only look: the caller takes the blocks.",
            15, _engine("prefix_lookup", "block_hash_chain"),
        ),
        Exercise(
            "lru_eviction", 7, "src/infer/engine/prefix_cache.py",
            ("tests/test_prefix_caching.py::test_eviction_is_lru_tail_first_and_reports_intact_blocks",
             "tests/test_prefix_caching.py::test_a_kept_lookup_is_redone_after_an_eviction_or_a_new_key",
             "tests/test_prefix_caching.py::test_a_miss_after_eviction"),
            "Take a cached free block for new data: the least recently freed one. Tell on_evict (only when "
            "one is set) about it while its key and tokens are still in the pool, then make sure nobody can "
            "find it by its old key again: not the key map, not the block's own key and tokens, not a lookup "
            "the manager kept (the pool's generation tells it when those are stale; a pool method does all "
            "three). Count it in num_evictions (a metric the tests read).",
            10, _engine("lru_eviction", "block_hash_chain", "prefix_lookup"),
        ),
        # ---------------------------------------------------------------- phase 10
        Exercise(
            "tiered_lookup", 10, "src/infer/engine/kv_offload.py",
            ("tests/test_kv_offload.py::test_tiered_lookup",),
            "Walk a prompt's block hashes in order and say where each block's KV is: the device if the "
            "prefix cache holds it, else the fastest lower tier that does. A block no tier holds ends the "
            "usable prefix.",
            10,
        ),
        Exercise(
            "break_even", 10, "src/infer/engine/kv_offload.py",
            ("tests/test_kv_offload.py::test_break_even_tokens",),
            "Restoring n tokens costs a fixed latency plus n times the bytes per token over the bandwidth; "
            "recomputing them costs n over the prefill rate. Return the smallest n for which the restore is "
            "strictly faster, or None if it never is. Compute exactly, with fractions.Fraction: the arguments "
            "may be plain ints or floats, and in floating point a tie can round to a win.",
            10,
        ),
        # ---------------------------------------------------------------- phase 11
        Exercise(
            "symmetric_quantize", 11, "src/infer/kernels/quant_reference.py",
            ("tests/test_quantization.py::test_round_trip_error_is_within_the_formats_step",),
            "One scale per block: the block's largest |w| over the format's largest code (127, 448 or 7), "
            "so the largest weight gets the largest code; a block of zeros gets scale 1. Divide by the "
            "scale, round to the nearest code (fp8: PyTorch's cast rounds), keep it in range, store it in "
            "the format's dtype (int4: packed with pack_int4).",
            20,
        ),
        Exercise(
            "unpack_int4", 11, "src/infer/kernels/quant_reference.py",
            ("tests/test_quantization.py::test_int4_packing_against_a_hand_computed_word",),
            "Each int32 word holds eight 4-bit values, value i of the word in bits 4i..4i+3 (the lowest "
            "first), each stored as q + 8. Shift, keep 4 bits (>> on int32 copies the sign bit), subtract "
            "the offset, return int8 [N, 8 * words].",
            15,
        ),
        Exercise(
            "per_token_fp8", 11, "src/infer/kernels/quant_reference.py",
            ("tests/test_quantization.py::test_per_token_fp8_quantization_by_hand",),
            "W8A8's activations: one scale per row (token), its largest |x| over e4m3's largest value 448, so "
            "nothing overflows (e4m3fn has no infinity: a value past 448 becomes NaN); a row of zeros gets scale "
            "1. Divide, clamp to +-448, cast to torch.float8_e4m3fn (the cast rounds to nearest). Return the codes "
            "and the float32 [M, 1] scales.",
            10,
        ),
        # ---------------------------------------------------------------- phase 12
        Exercise(
            "ngram_lookup", 12, "src/infer/engine/spec_decode.py",
            ("tests/test_speculative.py::test_ngram_lookup_by_hand_and_against_its_definition",),
            "Prompt lookup: for n from max_n down to min_n, look for an earlier occurrence of the sequence's "
            "last n tokens (one that a token follows: not the suffix itself); at the first n that has one, "
            "return up to k tokens that follow its earliest occurrence (they may run into the suffix). No "
            "match at any n: [].",
            15,
        ),
        Exercise(
            "greedy_acceptance", 12, "src/infer/engine/spec_decode.py",
            ("tests/test_speculative.py::test_num_accepted_is_the_longest_agreeing_prefix",),
            "sampled[i] is what the model sampled at the position of draft[i], after draft[:i]: count the drafts "
            "accepted, the longest run from the first on where the two agree (an agreement after a rejection "
            "does not count: it followed a token that was not emitted).",
            5,
        ),
        Exercise(
            "draft_backoff", 12, "src/infer/engine/spec_decode.py",
            ("tests/test_speculative.py::test_backoff_pauses_double_after_three_missed_rounds_and_a_hit_resets",
             "tests/test_speculative.py::test_acceptance_counters_match_a_simulation_over_the_reference_output"),
            "After a verify round of seq that accepted `accepted` drafts: a round that accepted any resets "
            "seq.spec_misses to 0; one that accepted none counts a miss, and from BACKOFF_AFTER misses in a row on "
            "sets seq.spec_pause (steps without speculating) to 1, 2, 4, ... doubling with each further miss, "
            "at most BACKOFF_MAX_STEPS.",
            10,
        ),
        Exercise(
            "rejection_rule", 12, "src/infer/sampling/rejection.py",
            ("tests/test_speculative.py::test_rejection_sampling_emits_the_target_distribution",
             "tests/test_speculative.py::test_rejection_sampling_with_the_target_as_draft_accepts_everything"),
            "Set accept ([B, k] bool: u < p(x)/q(x), without dividing by q), num_accepted ([B]: the leading run "
            "of acceptances) and last ([B, V]: the distribution the token after the run is drawn from: at a "
            "rejected position i, max(0, p_i - q_i) normalized; after k acceptances, the bonus p_(k+1)).",
            25,
        ),
        # ---------------------------------------------------------------- phase 13
        Exercise(
            "token_bitmask", 13, "src/infer/sampling/structured.py",
            ("tests/test_structured.py::test_token_bitmask_matches_the_per_token_reference_and_leaves_other_rows_alone",
             "tests/test_structured.py::test_sampler_masks_only_constrained_rows_and_logprobs_are_of_the_masked_distribution"),
            "Unpack each int32 word of the [R, W] bitmask into its 32 bits (bit j of word w is token 32 w + j), "
            "keep the first V (a mask of fewer than ceil(V / 32) words disallows the tokens past its bits), and "
            "set the disallowed logits of the listed rows to -inf. Return a new tensor: the input must not "
            "change, and the rows not listed must be bit-for-bit the input's.",
            20,
        ),
        Exercise(
            "choice_regex", 13, "src/infer/sampling/structured.py",
            ("tests/test_structured.py::test_choice_regex_matches_exactly_the_choices",
             "tests/test_structured.py::test_bad_constraints_raise_value_error"),
            "A choice constraint by hand: the regular expression whose language is exactly the given strings "
            "(a choice may hold regex metacharacters), which stays one unit when a longer pattern is built "
            "around it. Raise ValueError for anything but a non-empty list of non-empty strings (an empty "
            "list, an empty or non-string choice, a bare string).",
            10,
        ),
        # ---------------------------------------------------------------- phase 15: MoE
        Exercise(
            "moe_topk_routing", 15, "src/infer/kernels/moe_reference.py",
            ("tests/test_moe.py::test_select_experts_matches_hand_computation",
             "tests/test_moe.py::test_select_experts_takes_the_softmax_in_float32",
             "tests/test_moe.py::test_renormalized_top_k_is_softmax_of_top_k_logits"),
            "Route each token: the softmax of its router logits over the experts (in float32), the top_k "
            "largest probabilities and their experts, largest first; with renormalize (Hugging Face's "
            "norm_topk_prob) the kept probabilities are divided by their own sum. Which order of "
            "softmax and top-k gives the same weights only when renormalizing?",
            15,
        ),
        Exercise(
            "moe_align_block_size", 15, "src/infer/kernels/moe_reference.py",
            ("tests/test_moe.py::test_moe_align_block_size_groups_pairs_by_expert",
             "tests/test_moe.py::test_triton_moe_align_block_size_equals_reference"),
            "Sort the (token, expert) pairs by expert for the grouped GEMM: pad each expert's count up to a "
            "multiple of block_size, find where each expert's run starts in the padded buffer, give every "
            "pair its slot (its expert's start plus its rank among that expert's pairs, which keep their order; "
            "the dropped key num_experts goes to the scratch slot `size`), and the expert of each block. Device "
            "tensor ops only: no .item(), no Python loop over pairs (a CUDA graph captures this).",
            30,
        ),
        # ---------------------------------------------------------------- phase 17: hybrid linear attention
        Exercise(
            "gated_delta_step", 17, "src/infer/kernels/gated_delta_reference.py",
            ("tests/test_hybrid.py::test_recurrent_and_chunked_forms_agree",),
            "One token of the gated delta rule, for every row at once: decay the state S [..., Dk, Dv] by "
            "exp(g); compute what it predicts for the key (S^T k); write beta times the error (v minus that "
            "prediction) along k (an outer product); read the new state with q. Which order of decay, write "
            "and read does the chunked form (the test's reference) assume?",
            15,
        ),
        Exercise(
            "conv1d_update", 17, "src/infer/kernels/gated_delta_reference.py",
            ("tests/test_hybrid.py::test_conv1d_update_steps_equal_the_prefill_convolution",),
            "One new token per row through the short causal convolution: the window is the K - 1 stored "
            "inputs (oldest first) followed by x; the output is SiLU of the window times the weights, summed "
            "over the K taps (in float32, cast back); the new state is the window without its oldest input.",
            10,
        ),
        Exercise(
            "partial_rope", 17, "src/infer/kernels/fused_reference.py",
            ("tests/test_hybrid.py::test_gated_qk_norm_rope_and_output_gate",),
            "Qwen3.5's gated attention rotates only the first rotary_dim = 2 * half dimensions of each "
            "normalized q / k head x [T, H, D] (float32): in the rotate-half layout, dimension i < half pairs "
            "with i + half, each pair turned by its angle (c, s: [T, 1, half]); the dimensions from rotary_dim "
            "on pass through unchanged. Return the [T, H, D] result. Which dimension does i pair with when "
            "rotary_dim < D, and why not i + D / 2?",
            10,
        ),
        Exercise(
            "snapshot_lookup", 17, "src/infer/engine/state_snapshots.py",
            ("tests/test_hybrid.py::test_snapshot_lookup_cuts_a_hit_back_to_its_last_snapshot",
             "tests/test_hybrid.py::test_prefix_hits_restore_snapshots_and_equal_a_cold_run"),
            "Cut a prefix hit (block ids, in order) back to what a hybrid model can reuse: up to and including "
            "its last block that ends on a multiple of the stride and owns a state snapshot (self.of_block); [] "
            "when none does. Why the last such block and not the first, and why can the blocks after it not be "
            "reused even though their K/V are cached?",
            15,
        ),
        # ---------------------------------------------------------------- phase 14
        Exercise(
            "row_parallel_linear", 14, "src/infer/models/layers.py",
            ("tests/test_parallel.py::test_column_row_parallel_pair_equals_one_linear",),
            "The second layer of a column/row-parallel pair: this rank holds a slice of the weight's input "
            "columns and receives exactly those features. What does its product miss, how many collectives "
            "complete it, and when may the bias be added (a layer may have none: Llama's o_proj)?", 10,
        ),
        Exercise(
            "vocab_parallel_embedding", 14, "src/infer/models/layers.py",
            ("tests/test_parallel.py::test_vocab_parallel_embedding_equals_one_table",),
            "This rank holds the embedding rows of ids [vocab_start, vocab_start + num_embeddings). Look up the "
            "ids it holds, contribute nothing for the others, and combine the ranks' results with one "
            "collective (self.parallel.all_reduce).", 15,
        ),
        Exercise(
            "all_reduce_choice", 14, "src/infer/parallel/allreduce.py",
            ("tests/test_allreduce.py::test_choose_algorithm_by_size_and_dtype",),
            "Which all-reduce a message takes: one-shot up to one_shot_max_bytes (inclusive), two-shot up to "
            "the symmetric buffer's max_bytes, NCCL above it, and NCCL for what the symmetric-memory kernels "
            "cannot do: a dtype outside SYMM_MEM_DTYPES, an empty message or a size that is not a multiple "
            "of ALIGN bytes.", 10,
        ),
        # ---------------------------------------------------------------- phase 15 (expert parallelism)
        Exercise(
            "moe_dispatch_combine", 15, "src/infer/parallel/moe.py",
            ("tests/test_parallel.py::test_expert_parallel_moe_equals_all_experts_on_one_rank",),
            "Take this rank's chunk of the tokens (each pair is computed once, on one rank), route them, send "
            "each (token, expert) pair's row to the rank holding the expert (contiguous blocks of E / W experts "
            "per rank) with dist.all_to_all_single (count first: the split sizes), run the local "
            "experts with weight 1, send the results back, weight and sum them per token, then all-gather "
            "the chunks so every rank has the whole output.", 40,
        ),
        # ---------------------------------------------------------------- phase 16
        Exercise(
            "lora_scaling", 16, "src/infer/lora/adapter.py",
            ("tests/test_lora.py::test_lora_scaling",
             "tests/test_lora.py::test_one_batch_mixing_base_and_three_adapters_matches_peft_merged"),
            "The factor of an adapter's delta s * B A x, from its adapter_config.json: LoRA divides lora_alpha "
            "by the rank; rank-stabilized LoRA (use_rslora) by its square root.", 5,
        ),
        Exercise(
            "lora_segments", 16, "src/infer/kernels/lora_reference.py",
            ("tests/test_lora.py::test_rows_are_grouped_by_slot",
             "tests/test_lora.py::test_shrink_expand_match_per_row_reference"),
            "Group a step's rows by adapter slot (the segments of Punica's SGMV): the rows that have an "
            "adapter, slot 0's first, ascending within a slot; how many rows each slot has, where its run "
            "starts. Rows with slot -1 belong to no segment; a slot without rows still has a start. numpy "
            "only (argsort, bincount, cumsum): no Python loop over rows.", 20,
        ),
    ]
}


def find_regions(text: str) -> dict[str, tuple[int, int, str]]:
    """``name -> (first line inside, end-marker line, indent)`` of every exercise in ``text``.

    Raises:
        ValueError: for an unmatched or nested marker.
    """
    regions: dict[str, tuple[int, int, str]] = {}
    open_name, start, indent = None, 0, ""
    for i, line in enumerate(text.splitlines()):
        m = MARK.match(line)
        if not m:
            continue
        if m["kind"] == ">>>":
            if open_name is not None:
                raise ValueError(f"exercise {m['name']} starts inside {open_name}")
            open_name, start, indent = m["name"], i + 1, m["indent"]
        else:
            if m["name"] != open_name:
                raise ValueError(f"end marker of {m['name']} does not close {open_name}")
            regions[open_name] = (start, i, indent)
            open_name = None
    if open_name is not None:
        raise ValueError(f"exercise {open_name} is never closed")
    return regions


def region_text(text: str, name: str) -> str:
    """The code inside exercise ``name``'s markers (the reference solution)."""
    start, end, _ = find_regions(text)[name]
    return "".join(text.splitlines(keepends=True)[start:end])


def replace_region(text: str, name: str, body: str) -> str:
    """``text`` with the code inside exercise ``name``'s markers replaced by ``body``."""
    start, end, _ = find_regions(text)[name]
    lines = text.splitlines(keepends=True)
    return "".join(lines[:start] + [body] + lines[end:])


def stub(text: str, name: str, hint: str) -> str:
    """``text`` with exercise ``name``'s region replaced by a ``NotImplementedError``."""
    indent = find_regions(text)[name][2]
    msg = f"Exercise {name}: {hint}".replace("\\", "\\\\").replace('"', '\\"')
    return replace_region(text, name, f'{indent}raise NotImplementedError("{msg}")\n')


def ordered(exercises: list[Exercise]) -> list[Exercise]:
    """By phase; within a phase, those that need none of the others first (they can pass alone)."""
    names = {e.name for e in exercises}
    index = {n: i for i, n in enumerate(EXERCISES)}
    return sorted(exercises, key=lambda e: (e.phase, len(names & set(e.needs)), index[e.name]))


def selected(phase: int | None, names: list[str] | None) -> list[Exercise]:
    """The registered exercises of ``phase`` (all if None) named in ``names`` (all if None), ordered.

    Raises:
        SystemExit: an unknown name, or nothing matches.
    """
    chosen = [e for e in EXERCISES.values() if (phase is None or e.phase == phase)]
    if names:
        unknown = sorted(set(names) - set(EXERCISES))
        if unknown:
            raise SystemExit(f"unknown exercise(s): {', '.join(unknown)}; see `python -m classroom list`")
        chosen = [e for e in chosen if e.name in names]
    if not chosen:
        wanted = " ".join([f"--phase {phase}"] * (phase is not None) + [f"--exercise {n}" for n in names or []])
        raise SystemExit(f"no exercise matches {wanted}; see `python -m classroom list`")
    return ordered(chosen)


