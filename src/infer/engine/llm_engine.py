"""The engine loop: ``schedule() -> execute() -> process outputs``, one step at a time.

This is nano-vllm's shape (and vLLM v1's ``EngineCore.step``): the scheduler decides what
runs, the model runner runs it, the output processor turns sampled tokens into request
output. :meth:`LLMEngine.step` is synchronous and knows nothing about HTTP or threads; the
offline API (:class:`infer.llm.LLM`) and the server drive it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import random
import time
import weakref

from infer.config import EngineConfig
from infer.detokenizer import IncrementalDetokenizer
from infer.engine.input_processor import InputProcessor, TokensPrompt
from infer.engine.kv_cache_manager import KVCacheManager
from infer.engine.model_runner import ModelRunner
from infer.engine.output_processor import OutputProcessor
from infer.engine.scheduler import ScheduledSeq, Scheduler
from infer.engine.sequence import PLACEHOLDER, Request, SeqStatus, Sequence
from infer.engine.step import StepResult
from infer.engine.step_trace import StepRecorder
from infer.errors import EngineStepError, InvalidRequestError, ModelLoadError, ParallelWorkerError
from infer.loader import LoadedModel, load_model, read_model_config
from infer.lora import LoRAAdapter, LoRARequest
from infer.outputs import RequestOutput
from infer.sampling import RequestOutputKind, SamplingParams

log = logging.getLogger("infer")

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY

_SEED_STRIDE = 0x9E3779B97F4A7C15 & ((1 << 63) - 1)  # decorrelates the n sequences of a request


def _check_parallel_split(config: EngineConfig) -> None:
    """Reject parallel sizes that do not split the checkpoint evenly (:meth:`EngineConfig.validate_model`),
    before any worker starts. Reads ``config.json`` or the GGUF header only; a checkpoint that cannot be
    read is left to the loader, which reports it with the file."""
    try:
        model = read_model_config(config.model)
    except ModelLoadError:
        return
    config.validate_model(model)


class LLMEngine:
    """Holds the model, the KV cache, the scheduler and every request in flight.

    Args:
        config: the :class:`EngineConfig` (validated here).
        loaded: an already loaded model (skips loading ``config.model``).
        progress: show a progress bar while loading.

    Raises:
        ValueError: for an invalid config; :class:`~infer.errors.ModelLoadError` for a model
            that cannot be loaded.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, progress: bool = True) -> None:
        self.config = config.validate()
        self.workers = None  # tensor/expert parallelism (phase 14): the other ranks' processes
        if config.world_size > 1:
            _check_parallel_split(config)
            try:
                self._init_parallel(config, loaded, progress)
            except BaseException:
                self.shutdown()
                raise
            return
        self.loaded = loaded or load_model(
            config.model, config.resolved_device(), config.resolved_dtype(), progress=progress,
            quantization=config.quantization, quantize_lm_head=config.quantize_lm_head,
            gguf_weights=config.gguf_weights,
        )
        self._require_tokenizer()
        config.validate_model(self.loaded.config)  # e.g. flags a hybrid model (phase 17) does not support
        self.runner = ModelRunner.from_config(config, self.loaded)
        self._init_rest(config, progress)

    def _init_parallel(self, config: EngineConfig, loaded: LoadedModel | None, progress: bool) -> None:
        """Start the worker ranks, load rank 0's shard, build a runner that drives every rank."""
        from infer.engine.executor import ParallelModelRunner, Workers, build_runner

        if loaded is not None:
            raise ValueError("tensor/expert parallelism loads each rank's shard from config.model; "
                             "a preloaded model cannot be passed")
        self.workers = Workers(config)
        self.loaded, self.runner = build_runner(config, self.workers.state, ParallelModelRunner, progress,
                                                workers=self.workers)
        self._require_tokenizer()
        self._init_rest(config, progress)

    def _require_tokenizer(self) -> None:
        if self.loaded.tokenizer is None:
            raise ValueError(f"{self.loaded.path}: the model has no tokenizer (tokenizer.json)")

    def _init_rest(self, config: EngineConfig, progress: bool) -> None:
        """Everything after the model runner: warm-up, graph capture, the block manager, the scheduler."""
        self.tokenizer = self.loaded.tokenizer
        mcfg = self.loaded.config
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = list(dict.fromkeys(mcfg.eos_token_ids or self.tokenizer.eos_token_ids))
        self.vocab_size = mcfg.vocab_size
        budget = config.resolved_max_num_batched_tokens(self.max_model_len)
        paged = config.kv_cache == "paged"
        block_size = self.runner.kv_cache.block_size
        backend = config.resolved_attention_backend()
        num_blocks = self.runner.kv_cache.num_blocks
        log.info("KV cache: %s, %d blocks x %d tokens (%.2f GiB, %s), attention=%s, max_num_batched_tokens=%d",
                 config.kv_cache, num_blocks, block_size, self.runner.kv_cache.nbytes / 2**30,
                 str(self.runner.kv_cache.k.dtype).removeprefix("torch."), backend, budget)
        log.info("%s", config.optimization_summary())
        warm_s = self.runner.warm_up()
        if warm_s:
            log.info("warm-up: the attention kernels' variants launched once in %.1f s", warm_s)
        state = self.runner.state_cache
        if state is not None:  # hybrid models (phase 17): how the budget was split
            log.info("hybrid model: %d of %d layers keep K/V (%d bytes per token, %d without linear attention); "
                     "%d linear-attention layers keep a recurrent state: %d slots x %.2f MiB = %.2f GiB",
                     mcfg.num_kv_layers, mcfg.num_layers, mcfg.kv_bytes_per_token(self.runner.dtype),
                     mcfg.kv_bytes_per_token(self.runner.dtype) * mcfg.num_layers // max(1, mcfg.num_kv_layers),
                     mcfg.num_layers - mcfg.num_kv_layers, self.runner.num_state_slots, state.slot_nbytes / 2**20,
                     self.runner.num_state_slots * state.slot_nbytes / 2**30)
        snapshots = self.runner.num_snapshot_slots if state is not None and config.prefix_caching else 0
        self.kv_manager = KVCacheManager(num_blocks, block_size, prefix_caching=config.prefix_caching,
                                         num_state_slots=self.runner.num_state_slots if state is not None else 0,
                                         num_snapshot_slots=snapshots, snapshot_stride=config.state_snapshot_stride)
        if self.kv_manager.snapshots is not None:  # hybrid prefix caching: the third share of the budget
            log.info("hybrid prefix caching: %d state snapshots x %.2f MiB = %.2f GiB, one every %d tokens "
                     "(%d blocks); a prefix hit is cut back to its last snapshot", snapshots,
                     state.slot_nbytes / 2**20, snapshots * state.slot_nbytes / 2**30,
                     self.kv_manager.snapshots.stride, self.kv_manager.snapshots.stride // block_size)
        self.offloader = self._make_offloader() if config.kv_offload != "none" else None
        self.scheduler = Scheduler(
            self.kv_manager,
            policy=config.batching,
            max_num_seqs=config.max_num_seqs if paged else min(config.max_num_seqs, num_blocks),
            max_num_batched_tokens=budget,
            batch_wait_timeout_s=config.batch_wait_timeout_ms / 1000,
            chunked_prefill=config.chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_loras=config.max_loras if config.enable_lora else None,
            # hybrid prefix caching: chunks that resume on a chunk boundary keep the prefills' one pass
            prefill_chunk_alignment=getattr(self.loaded.model, "prefill_chunk_alignment", 1)
            if self.kv_manager.snapshots is not None else 1,
        )
        self.lora_manager = self.runner.lora_manager  # LoRA (phase 16), or None
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                                self.vocab_size)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size)
        self.requests: dict[str, Request] = {}
        self._in_flight: tuple[list[ScheduledSeq], StepResult] | None = None  # async scheduling
        # async scheduling with speculation: a sequence of a step applied while the next ran is ready to propose
        self._ready_to_propose = False
        self._rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        self.index_cache = None  # structured output: compiled constraints (IndexCache), made on first use
        self.proposer = self.spec_stats = None  # speculative decoding (phase 12)
        self.spec_backoff = False  # its backoff (speculative_config "backoff": infer.engine.spec_decode.record_round)
        if config.speculative is not None:
            self._init_speculative(config.speculative)
        # after the proposer: an EAGLE-3 head makes every target forward keep hidden states, graphs included
        self.runner.capture_cuda_graphs(progress)
        self._compiling: dict[str, tuple[Request, concurrent.futures.Future]] = {}
        self.tracer: StepRecorder | None = None
        if config.trace is not None:
            self.tracer = self._make_tracer(budget)

    def _make_tracer(self, budget: int) -> StepRecorder:
        """``EngineConfig.trace``: a :class:`~infer.engine.step_trace.StepRecorder` hooked into the
        scheduler and the model runner; its trace is written at :meth:`shutdown`, when the engine is
        collected, or at interpreter exit, whichever comes first (:meth:`write_trace` writes it now)."""
        c = self.config
        info = {"model": c.model, "device": str(self.runner.device), "flags": c.optimization_summary()}
        tracer = StepRecorder(c.trace, cuda=self.runner.device.type == "cuda", budget=budget, info=info)
        self.set_tracer(tracer)
        self._trace_at_exit = weakref.finalize(self, tracer.write)
        log.info("step trace: recording every step, written to %s at shutdown", c.trace)
        return tracer

    def set_tracer(self, tracer: StepRecorder | None) -> None:
        """Record the next steps into ``tracer`` (a :class:`~infer.engine.step_trace.StepRecorder`), or
        record nothing (None: the engine then pays the four ``is not None`` checks alone).
        ``benchmarks/trace_overhead.py`` alternates the two in one engine; the trace written at
        shutdown stays the one ``EngineConfig.trace`` made."""
        self.tracer = tracer
        self.runner.on_executed = tracer.executed if tracer is not None else None
        self.scheduler.on_preempt = tracer.preempted if tracer is not None else None

    def add_step_listener(self, listener, max_steps: int = 256) -> None:
        """Call ``listener(engine, record)`` on the engine thread after every step that did something,
        with the step's :class:`~infer.engine.step_trace.StepRecord` (the server's live page,
        :mod:`infer.engine.live_view`). It must return quickly and never block: it runs inside the
        step. Without ``EngineConfig.trace`` a recorder keeping the last ``max_steps`` steps (no
        file, no CUDA events) is hooked in first; with it, the trace's recorder feeds the listener."""
        if self.tracer is None:
            self.set_tracer(StepRecorder(None, budget=self.scheduler.max_num_batched_tokens,
                                         max_steps=max_steps, max_seq_entries=max_steps * 256))
        self.tracer.listeners.append(listener)

    def write_trace(self, path: str | None = None) -> str:
        """Write the step trace recorded so far (``EngineConfig.trace``) as Chrome trace JSON, to
        ``path`` (default: ``EngineConfig.trace``); recording goes on. Returns the path written.

        Raises:
            RuntimeError: the engine records no trace (``trace`` unset).
            OSError: the file cannot be written.
        """
        if self.tracer is None or (path is None and self.tracer.path is None):
            raise RuntimeError("this engine records no step trace: start it with trace=PATH (--trace PATH)")
        return self.tracer.write(path)

    def _init_speculative(self, spec) -> None:
        """Phase 12: the proposer and the acceptance counters (:mod:`infer.engine.spec_decode`)."""
        from infer.engine.spec_decode import NgramProposer, SpecDecodingStats

        if spec.method == "ngram":
            self.proposer = NgramProposer(spec, self.max_model_len)
        elif spec.method == "eagle3":
            from infer.engine.eagle3 import Eagle3Proposer

            self.proposer = Eagle3Proposer(spec, self)
        else:
            from infer.engine.draft import DraftProposer

            self.proposer = DraftProposer(spec, self)
        self.spec_stats = self.output_processor.spec_stats = SpecDecodingStats(spec.num_speculative_tokens)
        self.spec_backoff = spec.backoff
        self.scheduler.speculative = True
        log.info("speculative decoding: %s, k=%d%s", spec.method, spec.num_speculative_tokens,
                 ", with backoff" if spec.backoff else "")

    def _make_offloader(self):
        """Phase 10: the tiers below the KV cache, fed by the prefix cache's evictions and
        searched by its lookup (:mod:`infer.engine.kv_offload`)."""
        from infer.engine.kv_offload import KVOffloader

        c = self.config
        off = KVOffloader(self.runner.kv_cache, c.kv_offload, c.kv_offload_bytes, c.kv_offload_dir,
                          c.resolved_kv_offload_disk_bytes() if c.kv_offload == "disk" else None)
        self.kv_manager.pool.on_evict = lambda key, block, _tokens: off.offload([(key, block)])
        self.kv_manager.offloader = off
        log.info("KV offload: %s, host tier %d blocks (%.2f GiB)%s", c.kv_offload, off.host.num_slots,
                 off.host.num_slots * off.block_nbytes / 2**30,
                 f", disk tier {off.disk.num_slots} blocks in {off.disk.path}" if off.disk is not None else "")
        return off

    def _schedule(self) -> list[ScheduledSeq]:
        """The scheduler's next step; with ``kv_offload``, the copies of the blocks it evicted to
        the host tier are issued before that step can overwrite them."""
        scheduled = self.scheduler.schedule()
        if self.offloader is not None:
            self.offloader.flush()
        if self.tracer is not None:
            self.tracer.scheduled(self, scheduled)
        return scheduled

    def shutdown(self) -> None:
        """Release what outlives a step: the KV offload tiers (their copies finish, the disk
        tier's file is deleted) and the worker processes of a parallel engine. Idempotent; the
        engine must not step afterwards. With ``EngineConfig.trace``, the step trace is written.
        """
        if getattr(self, "_trace_at_exit", None) is not None:
            try:
                self._trace_at_exit()  # writes it once (then neither collection nor exit writes it again)
            except OSError:
                log.exception("the step trace could not be written to %s", self.config.trace)
        if getattr(self, "offloader", None) is not None:  # None until _init_rest (a failed start too)
            self.offloader.close()
        if self.workers is not None:
            graphs = getattr(getattr(self, "runner", None), "graphs", None)
            if graphs is not None:
                graphs.release()  # before the communicator goes (PyTorch #115388)
            self.workers.shutdown()

    # ------------------------------------------------------------------ requests

    def tokenize_prompt(self, prompt: str | list[int] | TokensPrompt) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt given as text, token ids or a :class:`TokensPrompt`
        (:class:`~infer.engine.input_processor.InputProcessor`; the server runs it off this thread).

        Raises:
            InvalidRequestError: for an empty prompt (text that encodes to zero tokens included), a text
                longer than the context could hold, ids outside the vocabulary, wrong types.
        """
        p = self.input_processor.process(prompt)
        return p.prompt, p.prompt_token_ids

    def add_request(
        self, prompt: str | list[int] | TokensPrompt, params: SamplingParams | None = None,
        request_id: str | None = None, lora_request: LoRARequest | None = None,
    ) -> Request:
        """Queue a request.

        Args:
            prompt: text, token ids, or a :class:`TokensPrompt` already tokenized (no tokenizing here:
                what the server sends).
            params: sampling parameters (default :class:`SamplingParams()`).
            request_id: unique id; generated when omitted.
            lora_request: the LoRA adapter its tokens run with (phase 16; needs ``enable_lora``), or
                None for the base model.

        Raises:
            InvalidRequestError: for an empty/oversized prompt, ``max_tokens`` past the
                context, ``n`` above ``max_num_seqs``, ``stop_token_ids`` outside the vocabulary
                or a duplicate id; a ``lora_request`` without ``enable_lora`` or whose adapter cannot be
                served (the reason).
        """
        params = params or SamplingParams()
        text, ids = self.tokenize_prompt(prompt)
        bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:  # (>= 0: SamplingParams checked) one would also break min_tokens' ban list
            raise InvalidRequestError(f"stop token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                                      param="stop_token_ids")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this model's context is {limit} tokens "
                f"(prompt + output), so at most {limit - 1} prompt tokens fit",
                param="prompt",
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds the context "
                f"of {limit} tokens; ask for at most {limit - len(ids)}",
                param="max_tokens",
            )
        if params.n > self.scheduler.max_num_seqs:
            raise InvalidRequestError(
                f"n={params.n} exceeds the {self.scheduler.max_num_seqs} sequences this engine can run at once "
                f"(max_num_seqs={self.config.max_num_seqs}, KV-cache blocks={self.kv_manager.num_blocks})", param="n"
            )
        # every sequence at its longest must fit the cache together, or preempting everybody else
        # would still not let this request finish
        longest = min(limit, len(ids) + (params.max_tokens if params.max_tokens is not None else limit))
        need = params.n * self.kv_manager.blocks_for(longest)
        if need > self.kv_manager.num_blocks:
            raise InvalidRequestError(
                f"n={params.n} sequences of up to {longest} tokens need {need} KV-cache blocks; the cache has "
                f"{self.kv_manager.num_blocks} blocks of {self.kv_manager.block_size} tokens; lower n or max_tokens",
                param="n",
            )
        rid = request_id if request_id is not None else f"req-{next(self._req_ids)}"
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        if lora_request is not None:
            self.add_lora(lora_request)  # read (or found) now: a bad adapter fails this call, not a step
        index = self._index_future(params) if params.structured_outputs is not None else None
        req = Request(rid, text, ids, params, lora_request=lora_request)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        for i in range(params.n):
            detok = IncrementalDetokenizer(
                self.tokenizer, ids, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
            )
            req.seqs.append(
                Sequence(
                    seq_id=next(self._seq_ids),
                    request=req,
                    index=i,
                    token_ids=list(ids),
                    seed=(base_seed + i * _SEED_STRIDE) % (1 << 63),
                    detokenizer=detok,
                    num_prompt_tokens=len(ids),
                    logprobs=[] if params.logprobs is not None else None,
                )
            )
        self.requests[rid] = req
        if index is not None:
            self._compiling[rid] = (req, index)  # admitted to the scheduler once compiled
        else:
            self.scheduler.add_request(req)
        return req

    # ------------------------------------------------------------------ structured output (phase 13)

    def _index_future(self, params: SamplingParams):
        """Check the request's constraint and start compiling its index (off this thread).

        Raises:
            InvalidRequestError: an uncompilable regex or an unsupported schema.
        """
        from infer.sampling.structured import IndexCache

        so = params.structured_outputs
        try:
            so.check()
        except ValueError as e:
            raise InvalidRequestError(str(e), param="structured_outputs") from None
        if self.index_cache is None:
            self.index_cache = IndexCache(self.tokenizer, self.eos_token_ids[0])
        return self.index_cache.get(so.to_regex())

    def _admit_compiled(self, wait: bool) -> list[RequestOutput]:
        """Hand the requests whose index is compiled to the scheduler (each sequence gets its own
        guide); a failed compile ends its request with ``finish_reason="error"``. With ``wait`` and
        nothing else to run, wait (briefly) for a compile instead of spinning."""
        if not self._compiling:
            return []
        from outlines_core import Guide

        if wait:
            concurrent.futures.wait([f for _, f in self._compiling.values()], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        outputs = []
        for rid, (req, fut) in list(self._compiling.items()):
            if not fut.done():
                continue
            del self._compiling[rid]
            if fut.exception() is not None:
                log.warning("request %s: its constraint failed to compile: %s", rid, fut.exception())
                for seq in req.seqs:
                    seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
                    seq.stop_reason = f"structured output: {fut.exception()}"
                self.requests.pop(rid, None)
                req.finished_time = time.perf_counter()
                outputs.append(self.output_processor.make_output(req))
                continue
            for seq in req.seqs:
                seq.guide = Guide(fut.result())
            self.scheduler.add_request(req)
        return outputs

    def abort_request(self, request_id: str, finish_reason: str = "abort") -> bool:
        """Stop a request now and free its KV-cache blocks. Returns False if it was unknown.

        Its unfinished sequences end with ``finish_reason`` (``"error"`` after a failed step).
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self._compiling.pop(request_id, None)
        self.scheduler.abort(request_id)
        for seq in req.seqs:
            self.output_processor.detokenize(seq)  # its text so far is complete for whoever reads it
            if not seq.is_finished:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, finish_reason
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._compiling)

    @property
    def num_running(self) -> int:
        return len({s.request.request_id for s in self.scheduler.running})

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> dict[str, float]:
        """The scheduler's totals (:meth:`Scheduler.stats`), the KV cache's size and, with
        ``prefix_caching``, :meth:`prefix_cache_stats`."""
        return {**self.scheduler.stats(), "kv_cache_blocks": self.kv_manager.num_blocks,
                "kv_block_size": self.kv_manager.block_size, "kv_cache_bytes": self.runner.kv_cache.nbytes,
                **(self.prefix_cache_stats() if self.config.prefix_caching else {}),
                **(self.offload_stats() if self.offloader is not None else {}),
                **(self.spec_stats.as_dict() if self.spec_stats is not None else {})}

    def offload_stats(self) -> dict[str, float]:
        """KV offload (phase 10): per-tier hits (blocks) and bytes, occupancy, the prompt tokens
        restored instead of recomputed, and the seconds spent issuing the copies
        (:meth:`~infer.engine.kv_offload.KVOffloader.stats`)."""
        return {**self.offloader.stats(), "kv_offload_hit_tokens": self.kv_manager.offload_hit_tokens}

    def prefix_cache_stats(self) -> dict[str, float]:
        """Prefix caching (phase 7): prompt tokens looked up at admission (``queries``), of those
        found cached (``hits``, their prefill skipped), the hit rate, and cached blocks evicted."""
        kv = self.kv_manager
        q, h = kv.prefix_cache_queries, kv.prefix_cache_hits
        return {"prefix_cache_queries": q, "prefix_cache_hits": h, "prefix_cache_hit_rate": h / q if q else 0.0,
                "prefix_cache_evictions": getattr(kv.pool, "num_evictions", 0),
                **(kv.snapshots.stats() if kv.snapshots is not None else {})}

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (vLLM's ``reset_prefix_cache``; blocks in use keep their
        data but cannot be hit again). Returns the cached free blocks dropped (0 without
        ``prefix_caching``)."""
        return self.kv_manager.reset_prefix_cache()

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far (the KV cache ran out of blocks; see the scheduler)."""
        return self.scheduler.num_preemptions

    # ------------------------------------------------------------------ the loop

    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Run one scheduler step.

        Args:
            stream: return an output for every request that made progress, shaped by its
                ``params.output_kind`` (cumulative with deltas, deltas only, or nothing until it
                finishes: :class:`~infer.sampling.params.RequestOutputKind`); when False, only
                for requests that finished, complete whatever the kind.

        Returns:
            :class:`RequestOutput` s, finished ones included once.

        Raises:
            EngineStepError: the forward or the output processing raised (a bug, a device
                error). Only the requests scheduled in this step are affected: they are aborted
                (``finish_reason="error"``) and their KV-cache blocks freed before this is raised,
                so the engine can step on for the others. Their partial results are dropped.
        """
        tracer = self.tracer
        if tracer is None:
            return self._step(stream)
        tracer.begin(self)  # EngineConfig.trace: this step is recorded (infer.engine.step_trace)
        try:
            outputs = self._step(stream)
        except BaseException:
            tracer.abandon()
            raise
        tracer.end(self)
        return outputs

    def _step(self, stream: bool) -> list[RequestOutput]:
        """:meth:`step`'s work: admit compiled requests, then one synchronous or async step."""
        admitted = self._admit_compiled(wait=not self.scheduler.has_unfinished() and self._in_flight is None)
        if self.config.async_scheduling:
            if self.proposer is not None and self._speculation_due():
                return admitted + self._step_speculating(stream)
            return admitted + self._step_async(stream)
        return admitted + self._step_sync(stream)

    def _step_sync(self, stream: bool) -> list[RequestOutput]:
        """One synchronous step: schedule, run, apply the tokens, then (phase 12) propose the next drafts."""
        scheduled = self._schedule()
        if not scheduled:
            return []
        with self._failing_requests_abort(scheduled):
            self._activate_loras(scheduled)
            result = self.runner.execute(scheduled, self.eos_token_ids)
            finished = self.output_processor.apply(result, scheduled)
        outputs = self._finish(scheduled, finished, stream)
        if self.proposer is not None:
            self._speculate(scheduled, result)
        return outputs

    def _speculation_due(self) -> bool:
        """Async scheduling with speculative decoding: does the next step verify drafts, or must the step in
        flight be waited for so that sequences ready to speculate again can propose? (Proposals need each
        sequence's tokens on the host, which a step in flight has not delivered.)"""
        return self._ready_to_propose or any(s.spec_token_ids for s in self.scheduler.running)

    def _step_speculating(self, stream: bool) -> list[RequestOutput]:
        """A synchronous step inside an async-scheduling engine, for speculative decoding: wait for the step in
        flight and apply its tokens, propose (:meth:`_speculate`), then schedule, run and apply one step
        whose drafts are verified, and propose again. Steps where no sequence speculates (the backoff
        pauses them, or they cannot) run ahead of the host as usual (:meth:`_step_async`): speculation is
        synchronous, the rest overlaps."""
        outputs: list[RequestOutput] = []
        self._ready_to_propose = False
        if self._in_flight is not None:
            scheduled, result = self._in_flight
            outputs += self._process_in_flight(stream, tick=False)
            self._speculate(scheduled, result)
        return outputs + self._step_sync(stream)

    def _speculate(self, scheduled: list[ScheduledSeq], result: StepResult) -> None:
        """Speculative decoding (phase 12), after a step's tokens are applied: give back the blocks a
        verifying sequence took for drafts it rejected, then propose the next drafts of every sequence
        that sampled and still runs (:mod:`infer.engine.spec_decode`), except, with the backoff, those
        pausing after drafts that kept failing (:func:`~infer.engine.spec_decode.record_round`)."""
        from infer.engine.spec_decode import proposing

        for item in scheduled:
            if item.spec_token_ids and item.seq.status is SeqStatus.RUNNING:
                self.kv_manager.truncate(item.seq, len(item.seq.token_ids))
        running = [s for s in dict.fromkeys(result.sampled) if s.status is SeqStatus.RUNNING]
        self.proposer.propose(proposing(running, self.spec_backoff))  # (an EAGLE-3 head also catches up on prompt chunks that sampled nothing)

    @contextlib.contextmanager
    def _failing_requests_abort(self, *steps: list[ScheduledSeq]):
        """An exception in the forward or the output processing aborts the steps' requests
        (``finish_reason="error"``, blocks freed) and becomes an :class:`EngineStepError` carrying
        their final outputs."""
        try:
            yield
        except Exception as e:
            if self._in_flight is not None:
                steps = (*steps, self._in_flight[0])
                self._in_flight = None
            failed = list(dict.fromkeys(item.seq.request.request_id for sched in steps for item in sched))
            outputs, now = [], time.perf_counter()
            for rid in failed:
                req = self.requests.get(rid)
                if self.abort_request(rid, finish_reason="error"):
                    req.finished_time = now
                    outputs.append(self.output_processor.make_output(req, final_only=True))
            if isinstance(e, ParallelWorkerError):
                raise  # a rank is gone: the engine cannot step again (the server stops and says 503)
            raise EngineStepError(failed, e, outputs) from e

    def _finish(self, scheduled: list[ScheduledSeq], finished: list[Sequence], stream: bool) -> list[RequestOutput]:
        """Free what finished and build the step's outputs (one per request that took part)."""
        now = time.perf_counter()
        for seq in finished:
            seq.status = SeqStatus.FINISHED
            self.scheduler.free(seq)
        if self.tracer is not None:
            self.tracer.finished(finished)
        outputs = []
        for req in dict.fromkeys(item.seq.request for item in scheduled):
            if req.request_id not in self.requests:
                continue  # aborted while its step ran (async scheduling): its final output went out then
            if req.is_finished:
                req.finished_time = now
                self.requests.pop(req.request_id, None)
                self.scheduler.abort(req.request_id)  # async: it may have been preempted meanwhile
            elif not stream or req.params.output_kind is _FINAL_ONLY:
                continue  # (make_output would say None)
            out = self.output_processor.make_output(req, final_only=not stream)
            if out is not None:
                outputs.append(out)
        return outputs

    def _step_async(self, stream: bool) -> list[RequestOutput]:
        """One step with async scheduling (``EngineConfig.async_scheduling``; vLLM's name, the
        overlap loop of mini-sglang and SGLang's "zero-overhead" scheduler).

        The device runs step N while the host processes step N - 1's tokens (stop checks,
        detokenization, streaming) and schedules step N + 1::

            schedule N -> launch N -> [wait for N-1's tokens] process N-1 -> mark N's placeholders
                          (device: ......... step N runs .........)

        The scheduler decides step N before step N - 1's tokens reach the host, so each sequence
        that sampled in step N - 1 holds a *placeholder* token (:data:`PLACEHOLDER`) that counts as
        one uncomputed token; the model runner replaces it on the device with the sampled token
        (a gather from step N - 1's output). A sequence that turns out to have finished in step
        N - 1 ran one step too many: its step-N token is dropped. Freeing its blocks at once is safe
        although step N still writes them: every step runs on one stream, so the next owner's
        writes come later. Outputs are the same as without the flag, one call of ``step`` later.
        A request with penalties needs its previous token on the host to build the next step's
        sampling tensors (the penalty counts), and so does one with structured output (its
        automaton must advance over the token before the next step's bitmask is written). For
        those the host applies step N - 1's tokens *inside* step N, after N's forward is launched
        and before N's sampling tensors are built (``StepResult.before_next_sampling``)::

            schedule N -> launch N's forward -> [wait for N-1's tokens] process N-1 -> N's sampling
                          (device: ... N's forward runs ...)            tensors, bitmask -> sample N

        so the automaton's work overlaps the forward instead of stalling the device (the same
        results as without the flag: the bitmask and the counts see exactly the tokens they would).
        """
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and self._needs_host_tokens(self._in_flight[1]):
            self._in_flight[1].before_next_sampling = lambda: outputs.extend(self._process_in_flight(stream))
        scheduled = self._schedule()
        if not scheduled:
            return outputs + self._process_in_flight(stream)
        # >>> EXERCISE overlap_loop
        prev = self._in_flight[1] if self._in_flight is not None else None
        with self._failing_requests_abort(scheduled):
            self._activate_loras(scheduled)
            result = self.runner.execute(scheduled, self.eos_token_ids, prev)
            self.output_processor.advance(scheduled)
            outputs += self._process_in_flight(stream)
        for seq in result.sampled:  # their tokens are on the device: the next step reads them there
            if not seq.is_finished:
                seq.token_ids.append(PLACEHOLDER)
        self._in_flight = (scheduled, result)
        # <<< EXERCISE overlap_loop
        return outputs

    def _activate_loras(self, scheduled: list[ScheduledSeq]) -> None:
        """LoRA (phase 16): make the step's adapters resident in device slots, never reusing the slot of
        an adapter a running request uses (the scheduler keeps their number <= ``max_loras``). On a GPU the
        copies are ordered after the step in flight on the same stream (async scheduling)."""
        if self.lora_manager is None:
            return
        loras = [item.seq.request.lora_request for item in scheduled if item.seq.request.lora_request is not None]
        if loras:
            self.runner.activate_loras(loras, self.scheduler.running_loras())

    # ------------------------------------------------------------------ LoRA adapters (phase 16)

    def add_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read an adapter into the host cache now (vLLM's ``add_lora``), so that a bad one is rejected
        before any request uses it.

        Raises:
            InvalidRequestError: without ``enable_lora``, or an adapter the engine cannot serve (the reason).
        """
        if self.lora_manager is None:
            raise InvalidRequestError("LoRA adapters need an engine started with enable_lora=True",
                                      param="lora_request")
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                                      param="lora_request")
        try:
            return self.lora_manager.get_adapter(lora_request)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="lora_request") from None

    def lora_in_use(self, lora_int_id: int) -> bool:
        """Does a request not yet finished (waiting or running) use adapter ``lora_int_id``?"""
        return any(r.lora_int_id == lora_int_id for r in self.requests.values())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its host copy and device slot; vLLM's ``remove_lora``). Returns False if
        it was not loaded.

        Raises:
            InvalidRequestError: a request in flight still uses it (unload it once they finish).
        """
        if self.lora_manager is None:
            return False
        if self.lora_in_use(lora_int_id):
            raise InvalidRequestError(f"LoRA adapter {lora_int_id} is used by requests in flight; unload it "
                                      "after they finish", param="lora_name")
        return self.runner.remove_lora(lora_int_id)

    def _process_in_flight(self, stream: bool, tick: bool = True) -> list[RequestOutput]:
        """Wait for the step in flight's tokens and apply them (async scheduling). With speculative decoding
        (``tick``), the step counts off the backoff's pauses of its sequences, and one that may propose
        again makes the next step wait for the one then in flight (:meth:`_step_speculating`)."""
        if self._in_flight is None:
            return []
        scheduled, result = self._in_flight
        self._in_flight = None
        with self._failing_requests_abort(scheduled):
            finished = self.output_processor.apply(result, scheduled, advanced=True)
        outputs = self._finish(scheduled, finished, stream)
        if self.proposer is not None and tick:
            from infer.engine.spec_decode import can_speculate, proposing

            running = [s for s in dict.fromkeys(result.sampled) if s.status is SeqStatus.RUNNING]
            if any(map(can_speculate, proposing(running, self.spec_backoff))):
                self._ready_to_propose = True
        return outputs

    @staticmethod
    def _needs_host_tokens(result) -> bool:
        """Does a sequence of this step need its new token on the host before the next step's
        sampling tensors are built? (The penalties count the generated tokens; a guide writes the
        bitmask from its automaton's state.)"""
        return any(s.has_penalties or s.guide is not None for s in result.sampled)
