"""Classroom exercises: stub out real engine code, then grade it with the project's own tests.

An exercise is a region of the engine's real code, between two comment markers::

    # >>> EXERCISE rms_norm
    ...the reference solution, exactly as the engine runs it...
    # <<< EXERCISE rms_norm

There is no second copy of the solution to keep in sync: :func:`prepare` copies the
repository and replaces each chosen region with ``raise NotImplementedError(hint)``;
:func:`grade` runs the tests listed for each exercise (the same tests CI runs) and prints a
pass/fail table and a score.

    python -m infer.exercises list
    python -m infer.exercises prepare --phase 0 --out ~/infer-phase0     # a student workspace
    python -m infer.exercises grade --phase 0 --root ~/infer-phase0      # grade it
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARK = re.compile(r"^(?P<indent>[ \t]*)# (?P<kind>>>>|<<<) EXERCISE (?P<name>\w+)\s*$")


@dataclass(frozen=True)
class Exercise:
    """One exercise: where it is, what grades it, and what the student is told."""

    name: str
    phase: int
    file: str  # relative to the repository root
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root
    hint: str
    minutes: int


EXERCISES: dict[str, Exercise] = {
    e.name: e
    for e in [
        Exercise(
            "rms_norm", 0, "src/infer/models/layers.py",
            ("tests/test_layers.py::test_rms_norm_matches_definition",
             "tests/test_layers.py::test_rms_norm_rounds_like_hf"),
            "x / sqrt(mean(x^2) + eps) in float32, then times w (Llama: cast to x.dtype first) or (1 + w) "
            "(Gemma: in float32, cast last). Return x.dtype.",
            15,
        ),
        Exercise(
            "apply_rope", 0, "src/infer/models/layers.py",
            ("tests/test_layers.py::test_apply_rope_is_a_rotation",
             "tests/test_layers.py::test_rope_relative_position_property"),
            "x is [T, heads, head_dim], cos/sin are [T, head_dim]. Pair dim i with i + head_dim/2: "
            "x * cos + rotate_half(x) * sin, rotate_half([a, b]) = [-b, a].",
            20,
        ),
        Exercise(
            "top_p", 1, "src/infer/sampling/sampler.py",
            ("tests/test_sampler.py::test_top_p_keeps_exact_sets", "tests/test_sampler.py::test_top_p_edges",
             "tests/test_sampler.py::test_truncated_frequencies_match_distribution"),
            "Per row: sort probabilities descending, keep the smallest prefix whose sum reaches top_p "
            "(always the top token), write -inf into the logits of the rest. No Python loop over rows.",
            30,
        ),
        Exercise(
            "stop_check", 1, "src/infer/engine/output_processor.py",
            ("tests/test_generation.py::test_stop_conditions",),
            "Return (finish_reason, stop_reason) or None: EOS (unless ignore_eos) and stop_token_ids give "
            "'stop', a matched stop string too (the detokenizer found it); max_tokens and the context "
            "limit give 'length'.",
            15,
        ),
        Exercise(
            "sampling_or_reject", 2, "src/infer/server/app.py",
            ("tests/test_server.py::test_bad_request[temperature-negative]",
             "tests/test_server.py::test_bad_request[stop-empty-string]",
             "tests/test_server.py::test_bad_request[n-1000]",
             "tests/test_server.py::test_bad_request[n-1000-chat]",
             "tests/test_server.py::test_bad_request[suffix]",
             "tests/test_server.py::test_bad_request[tools]",
             "tests/test_server.py::test_bad_request[top_logprobs-without-logprobs]",
             "tests/test_server.py::test_openai_client_raises_on_bad_request",
             "tests/test_server.py::test_same_answer_after_bad_requests"),
            "Return req.sampling_params(), unless it raises: an UnsupportedField (e.param names the field) or "
            "any other ValueError (_param_of(e) finds the field in SamplingParams' message) becomes raise "
            "_Reject(error_response(400, str(e), param)) from None. More than MAX_N sequences (params.n) is a "
            "400 naming 'n'.",
            10,
        ),
        Exercise(
            "chat_sse", 2, "src/infer/server/app.py",
            ("tests/test_server.py::test_chat_stream_equals_non_stream",
             "tests/test_server.py::test_stream_include_usage",
             "tests/test_server.py::test_chat_stream_n_logprobs_usage_and_done"),
            "async for out in outputs; for each c in out.outputs (one per sequence, finished ones included): "
            "skip an index that already ended; yield chunk([{'index': c.index, 'delta': {'content': "
            "c.delta_text} (or {} on a final chunk without text), 'logprobs': chat_lp_block(c.delta_logprobs "
            "or []) if req.logprobs else None, 'finish_reason': c.finish_reason}]). Then, if include_usage, "
            "chunk([], usage=usage([last output])); last 'data: [DONE]\\n\\n'.",
            25,
        ),
        Exercise(
            "abort_request", 2, "src/infer/server/async_engine.py",
            ("tests/test_server.py::test_stream_disconnect_aborts_request",
             "tests/test_server.py::test_queued_client_disconnect_frees_its_place",
             "tests/test_server.py::test_graceful_shutdown_on_sigterm"),
            "Engine thread. req = self.engine.requests.get(rid) before self.engine.abort_request(rid) (True if "
            "it was running or waiting; frees it); nothing to do if unknown and rid has no stream. Build the "
            "final RequestOutput(rid, prompt, prompt_token_ids, [CompletionOutput(index, text so far "
            "(s.detokenizer.output_text), token ids, finish_reason=s.finish_reason or 'abort') per seq], "
            "finished=True); if known, metrics 'arrival' (+ 'first_token') and self._record_finished(final); "
            "then self._deliver(rid, final) and drop rid from self._streams.",
            30,
        ),
        Exercise(
            "batch_ready", 3, "src/infer/engine/scheduler.py",
            ("tests/test_batching.py::test_static_batch_waits_for_timeout_or_a_full_batch",
             "tests/test_batching.py::test_continuous_admits_at_every_step_and_static_waits_for_the_batch"),
            "Return True when nothing is running and the waiting requests' sequences fill max_num_seqs, or "
            "the oldest waiting request (self.waiting[0].arrival_time, perf_counter seconds) has waited "
            "batch_wait_timeout_s.",
            10,
        ),
        Exercise(
            "flatten_batch", 3, "src/infer/engine/model_runner.py",
            ("tests/test_batching.py::test_abort_mid_batch_frees_its_row_and_disturbs_nobody[continuous]",
             "tests/test_batching.py::test_n_sequences_share_one_prefill"),
            "For each ScheduledSeq, first, kv_len, samples = chunk_extent(seq, n); append its n new tokens "
            "(token_ids[first:first + n]) and their positions; query_start_loc is the running sum (starts at "
            "0); seq_lens gets kv_len; when samples, the last new token is sampled, once for the sequence and "
            "once for each fork.",
            25,
        ),
        Exercise(
            "admission", 4, "src/infer/engine/scheduler.py",
            ("tests/test_batching.py::test_continuous_admits_at_every_step_and_static_waits_for_the_batch",
             "tests/test_batching.py::test_token_budget_is_respected",
             "tests/test_batching.py::test_abort_mid_batch_frees_its_row_and_disturbs_nobody"),
            "FIFO over self.waiting while _has_room(request): stop at the first that does not fit the token "
            "budget (static admits it anyway, it prefills later); _admit it, append ScheduledSeq(seq 0, "
            "prompt_len, forks=the other seqs), subtract from the budget. 'none' admits one request into "
            "an empty engine, 'static' only when _batch_ready().",
            30,
        ),
        Exercise(
            "decode_attention", 4, "src/infer/attention/torch_backend.py",
            ("tests/test_batching.py::test_decode_attention_matches_per_sequence_reference",),
            "Gather each sequence's cache row (or attend over every row in place), mask keys at positions >= "
            "seq_len (and, with a window, <= seq_len - 1 - window), view q as [B, kv_heads, heads/kv_heads, "
            "head_dim] for GQA, one F.scaled_dot_product_attention call, back to [B, heads, head_dim].",
            40,
        ),
        Exercise(
            "top_k", 4, "src/infer/sampling/sampler.py",
            ("tests/test_sampler.py::test_top_k_keeps_exact_sets", "tests/test_sampler.py::test_top_k_ties_and_infs"),
            "Per row b keep the top_k[b] largest logits (clamp k to [1, V]; ties with the k-th stay) and "
            "write -inf elsewhere. Sort descending, gather the k-th value per row, compare. No loop over rows.",
            20,
        ),
        Exercise(
            "slot_mapping", 5, "src/infer/attention/kv_cache.py",
            ("tests/test_paged.py::test_slot_mapping_walks_the_block_table",
             "tests/test_paged.py::test_paged_engine_matches_contiguous_with_forks_and_aborts"),
            "For each sequence, positions start .. start + n - 1: position p lives in block "
            "table[p // block_size] at offset p % block_size, so its slot is block * block_size + offset. "
            "Return the slots of all sequences, in order, as one list of ints.",
            10,
        ),
        Exercise(
            "block_free", 5, "src/infer/engine/kv_cache_manager.py",
            ("tests/test_paged.py::test_block_pool_hands_out_lowest_first_and_counts_holders",
             "tests/test_paged.py::test_block_pool_rejects_misuse",
             "tests/test_paged.py::test_block_pool_random_walk_keeps_its_invariants",
             "tests/test_paged.py::test_forks_share_full_blocks_and_own_a_copy_of_the_last"),
            "Each block has a reference count (self.ref_counts[b], the number of sequences holding it). Drop "
            "one holder per block; a block whose count reaches 0 goes back on the free list (a min-heap: "
            "heapq.heappush(self.free_blocks, b)). Freeing a block whose count is already 0 raises "
            "RuntimeError('... double free').",
            15,
        ),
        Exercise(
            "preemption", 5, "src/infer/engine/scheduler.py",
            ("tests/test_paged.py::test_preemption_frees_blocks_requeues_at_the_front_and_resumes",
             "tests/test_paged.py::test_prompt_logprobs_are_not_repeated_after_a_preemption"),
            "Loop while self.kv.allocate_slots(seq, n) fails: take the request of the last running sequence "
            "(self.running[-1].request, the most recently admitted), self.preempt() it, drop its sequences "
            "from `scheduled` (in place), and return False if it was seq's own request. Return True once "
            "the blocks are allocated.",
            25,
        ),
        Exercise(
            "paged_decode_inner_loop", 5, "src/infer/attention/triton_ops.py",
            ("tests/test_kernels.py::test_decode_matches_reference",
             "tests/test_kernels.py::test_decode_splits_agree_with_each_other"),
            "One key tile of the Triton paged decode kernel (runs under TRITON_INTERPRET=1 on a CPU): "
            "tok = start_n + offs_n; load each key's physical block from the block table (bt_row + tok // "
            "BLOCK_SIZE, masked where tok >= end), its row offset page * stride_cb + (tok % BLOCK_SIZE) * "
            "stride_ct; load the K tile [BLOCK_N, D_PAD]; s = tl.dot(q, tl.trans(k)) * qk_scale (log2 "
            "units), -inf where masked; online softmax: m_new = max(m_i, rowmax(s)), alpha = exp2(m_i - "
            "m_new), p = exp2(s - m_new), l_i = l_i * alpha + rowsum(p); load the V tile; acc = acc * alpha "
            "+ tl.dot(p, v); m_i = m_new. Remember the UPCAST (bf16 under the interpreter) casts.",
            60,
        ),
        Exercise(
            "chunk_schedule", 6, "src/infer/engine/scheduler.py",
            ("tests/test_chunked_prefill.py::test_chunked_matches_unchunked[llama-paged-7]",
             "tests/test_chunked_prefill.py::test_chunked_matches_unchunked[gemma3-contiguous-32]",
             "tests/test_chunked_prefill.py::test_decodes_go_first_and_prefill_chunks_fill_the_rest",
             "tests/test_chunked_prefill.py::test_decodes_go_first_even_behind_an_older_prefill",
             "tests/test_chunked_prefill.py::test_forks_share_one_chunked_prefill",
             "tests/test_chunked_prefill.py::test_long_prefill_token_threshold_shares_the_budget",
             "tests/test_chunked_prefill.py::test_preempted_half_prefilled_and_recomputed_sequences"),
            "The running sequences' part of a step. With self.chunked_prefill, visit decodes (1 uncomputed "
            "token) before prefills (a stable sort of self.running). Skip sequences no longer RUNNING and "
            "forks waiting for a shared prefill. n = self._chunk(num_uncomputed_tokens, budget); 0 means stop "
            "(the budget is spent) or, without chunking, skip a prefill that does not fit. Reserve blocks with "
            "self._reserve_blocks (if it returns False, seq was preempted: recompute budget from what is still "
            "scheduled and go on). Attach the waiting forks (seq.index == 0) only to the chunk that completes "
            "the prompt. Append ScheduledSeq(seq, n, forks) and spend n.",
            30,
        ),
        Exercise(
            "chunk_key_length", 6, "src/infer/engine/model_runner.py",
            ("tests/test_chunked_prefill.py::test_chunk_extent_by_hand",),
            "Return (first, kv_len, samples): first = the tokens already cached; kv_len = the keys the chunk "
            "attends over (cached prefix + the chunk, not the whole prompt); samples only when every token of "
            "the sequence (prompt and, after a preemption, generated tokens) is computed after this step.",
            10,
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


def stub(text: str, name: str, hint: str) -> str:
    """``text`` with exercise ``name``'s region replaced by a ``NotImplementedError``."""
    start, end, indent = find_regions(text)[name]
    lines = text.splitlines(keepends=True)
    msg = f"Exercise {name}: {hint}".replace("\\", "\\\\").replace('"', '\\"')
    return "".join(lines[:start] + [f'{indent}raise NotImplementedError("{msg}")\n'] + lines[end:])


def selected(phase: int | None, names: list[str] | None) -> list[Exercise]:
    chosen = [e for e in EXERCISES.values() if (phase is None or e.phase == phase)]
    if names:
        unknown = sorted(set(names) - set(EXERCISES))
        if unknown:
            raise SystemExit(f"unknown exercise(s): {', '.join(unknown)}; see `python -m infer.exercises list`")
        chosen = [e for e in chosen if e.name in names]
    return chosen


def prepare(out: Path, exercises: list[Exercise], root: Path = REPO) -> None:
    """Copy the repository (without .git, .venv, caches) to ``out`` and stub the exercises."""
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", "site",
                                    ".ruff_cache", ".whl")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty")
    shutil.copytree(root, out, ignore=ignore, dirs_exist_ok=True)
    for e in exercises:
        path = out / e.file
        path.write_text(stub(path.read_text(), e.name, e.hint))
    print(f"prepared {out} with {len(exercises)} exercise(s): {', '.join(e.name for e in exercises)}")


def grade(root: Path, exercises: list[Exercise], quiet: bool = False) -> dict[str, bool]:
    """Run each exercise's tests against the code under ``root``; print a table and the score."""
    env = dict(os.environ, PYTHONPATH=f"{root / 'src'}{os.pathsep}{root}")
    results: dict[str, bool] = {}
    for e in exercises:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *e.tests],
            cwd=root, env=env, capture_output=True, text=True,
        )
        results[e.name] = proc.returncode == 0
        if not quiet and proc.returncode != 0:
            print(f"--- {e.name}: failing output (last lines) ---")
            print("\n".join(proc.stdout.splitlines()[-15:]))
    width = max(len(n) for n in results) if results else 8
    print(f"{'exercise'.ljust(width)}  phase  result")
    for e in exercises:
        print(f"{e.name.ljust(width)}  {e.phase:>5}  {'PASS' if results[e.name] else 'FAIL'}")
    print(f"score: {sum(results.values())}/{len(results)}")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infer.exercises", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("list", "prepare", "grade"):
        p = sub.add_parser(cmd)
        p.add_argument("--phase", type=int, default=None, help="only this phase's exercises")
        p.add_argument("--exercise", action="append", default=None, help="only this exercise (repeatable)")
        if cmd == "prepare":
            p.add_argument("--out", type=Path, required=True, help="new workspace directory")
        if cmd == "grade":
            p.add_argument("--root", type=Path, default=REPO, help="workspace to grade (default: this repo)")
    args = ap.parse_args(argv)
    chosen = selected(args.phase, args.exercise)
    if args.cmd == "list":
        for e in chosen:
            print(f"phase {e.phase}  {e.name:<12} ~{e.minutes} min  {e.file}\n    {e.hint}")
        return 0
    if args.cmd == "prepare":
        prepare(args.out.expanduser(), chosen)
        return 0
    results = grade(args.root.expanduser().resolve(), chosen)
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
