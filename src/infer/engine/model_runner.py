"""The model runner decides *how* a scheduled step runs: tensors, KV cache, forward, sampling.

Input: the scheduler's ``[(sequence, num_new_tokens), ...]``. :meth:`ModelRunner.execute` makes one
decision, graph or eager (:mod:`infer.engine.cuda_graphs` runs the step if a captured graph fits
it), and otherwise flattens every sequence's new tokens into ``input_ids[T]`` / ``positions[T]``
(:mod:`infer.engine.step`), builds the attention metadata (where each sequence starts, its context
length, the KV slots its new tokens go to), runs one forward, computes logits only where a token
will be sampled (the last new token of each sequence whose tokens are all in the cache after this
step), and samples all of them in one batched call.

With chunked prefill (phase 6) a scheduled sequence may run only a *chunk* of its prompt:
tokens ``first .. first + n - 1`` with ``first = num_computed_tokens``. Nothing else changes
here: the chunk's keys are the cached prefix plus the chunk (:func:`~infer.engine.step.chunk_extent`),
the attention backends already read a cached prefix through the block table, and a sequence
samples only after its last chunk.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from collections.abc import Callable

import numpy as np
import torch

from infer.attention import AttentionMetadata, KVCache, TorchAttentionBackend, make_attention_backend
from infer.config import EngineConfig
from infer.engine.memory import cache_sizes, kv_heads_per_rank
from infer.engine.scheduler import ScheduledSeq
from infer.engine.sequence import Sequence
from infer.engine.state_snapshots import snapshot_stride
from infer.engine.step import ForwardOutput, StepInputs, StepResult, block_table_array, patch_input_ids
from infer.kernels import fused_ops, linear_attention_ops, moe_ops, pdl
from infer.loader import LoadedModel
from infer.sampling import SamplingTensors, sample

log = logging.getLogger("infer")

_PARAMS = operator.attrgetter("params")
_SEED = operator.attrgetter("seed")
_NUM_OUTPUT_TOKENS = operator.attrgetter("num_output_tokens")


def _with_pdl(method):
    """Run a :class:`ModelRunner` method with its kernels launched with programmatic dependent launch
    when the runner's ``pdl`` is set (:func:`infer.kernels.pdl.scope`; graphs captured inside keep it)."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if not self.pdl:
            return method(self, *args, **kwargs)
        with pdl.scope():
            return method(self, *args, **kwargs)

    return wrapped


class ModelRunner:
    """Owns the model on its device, the KV cache and the attention backend.

    Args:
        loaded: the model from :func:`infer.loader.load_model`.
        num_blocks, block_size: the KV cache's blocks (see :func:`~infer.engine.memory.num_kv_blocks`).
        contiguous: one block per sequence (``block_size = max_model_len``): the contiguous cache.
        attention_backend: ``"torch"`` or ``"triton"``.
        max_model_len: the longest sequence (tokens): sizes the block-table buffers of the CUDA
            graphs. (Which forward the model runs, fused or not, the engine chooses before it
            profiles memory: :meth:`CausalLM.set_fused_ops`.)
        cuda_graphs: capture decode steps of up to ``cuda_graph_max_batch_size`` rows as CUDA graphs
            (phase 9; :class:`~infer.engine.cuda_graphs.CUDAGraphRunner`; speculative decoding's verify
            steps replay them too, every token a decode row); call :meth:`capture_cuda_graphs` once the
            runner exists (the engine does, after its proposer is built).
        cuda_graph_prefill_max_tokens: with ``cuda_graphs``, also capture steps that prefill one
            sequence of up to this many tokens (0: none).
        cuda_graph_mixed_max_tokens: with ``cuda_graphs``, also capture mixed steps of up to this many
            tokens, whole (decodes and one prompt chunk) and in pieces (any other; 0: none).
        block_major: the block-major KV cache (phase 10, KV offload: one block of every layer is one
            contiguous copy; :class:`~infer.attention.KVCache`).
        pdl: launch the Triton kernels of every step, warm-up and capture with programmatic dependent
            launch (:mod:`infer.kernels.pdl`; ``EngineConfig.pdl``).
        num_state_slots: hybrid models (phase 17): sequence slots of the recurrent-state cache
            (:class:`~infer.attention.state_cache.RecurrentStateCache`; default ``max(1, ...)`` rows of
            the KV cache when 0). The KV cache then holds the full-attention layers only. With
            ``cuda_graphs`` the state cache has one more slot, the decode graphs' padding slot.
        num_snapshot_slots: hybrid models with prefix caching: slots after those of the state cache that
            hold state snapshots (:mod:`infer.engine.state_snapshots`).
        kv_cache_dtype: the KV cache's storage dtype (None: the model's; ``torch.float8_e4m3fn``: an FP8
            cache, phase 11, ``EngineConfig.kv_cache_dtype``); calculate_kv_scales: calibrate its scales
            from the first forward that writes it (:meth:`~infer.attention.KVCache.calibrate`).

    Attributes:
        lora_manager: LoRA (phase 16): the model's adapter slots
            (:class:`~infer.lora.manager.LoRAModelManager`), or None; each step gives it the slot of
            every row (:meth:`_set_lora_mapping`).
    """

    lora_manager = None
    #: EAGLE-3 (phase 12): the steps the head has not caught up on, oldest first, each ``(flat layout, kept
    #: hidden states [T, n * H])``, whichever route ran it (:class:`~infer.engine.eagle3.Eagle3Proposer` takes
    #: them); the newest is a view of the model's buffer, older ones copies (:meth:`_keep_aux_steps`)
    aux_steps: list
    #: how many such steps are kept at most (async scheduling runs a step before the last one is applied);
    #: older ones are dropped, and the head skips their positions (only its acceptance can suffer)
    MAX_AUX_STEPS = 2

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, contiguous: bool = False,
                 attention_backend: str = "torch", max_model_len: int = 0,
                 cuda_graphs: bool = False, cuda_graph_max_batch_size: int = 256, block_major: bool = False,
                 cuda_graph_prefill_max_tokens: int = 0, cuda_graph_mixed_max_tokens: int = 0,
                 pdl: bool = False, num_state_slots: int = 0, num_snapshot_slots: int = 0,
                 kv_cache_dtype: torch.dtype | None = None, calculate_kv_scales: bool = False,
                 ssm_state_dtype: torch.dtype = torch.float32) -> None:
        self.model = loaded.model
        self.pdl = pdl
        cfg = loaded.config
        self.config = cfg
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kv_cache = KVCache(cfg.num_kv_layers, num_blocks, block_size, kv_heads_per_rank(self.model),
                                cfg.head_dim, self.dtype, self.device, contiguous=contiguous, block_major=block_major,
                                cache_dtype=kv_cache_dtype, calibrate=calculate_kv_scales)
        self.state_cache = None
        if cfg.is_hybrid:
            from infer.attention.state_cache import RecurrentStateCache

            self.num_state_slots = num_state_slots or num_blocks
            self.num_snapshot_slots = num_snapshot_slots  # prefix caching: state snapshots after the running slots
            # with CUDA graphs, one more slot that no sequence owns (after the snapshots): the decode buckets'
            # padding rows write it
            self.state_cache = RecurrentStateCache.for_model(cfg, self.num_state_slots + num_snapshot_slots,
                                                             self.dtype, self.device, pad_slot=cuda_graphs,
                                                             ssm_dtype=ssm_state_dtype)
        self.attention_backend = make_attention_backend(attention_backend, self.device)
        self.model.set_attention_backend(self.attention_backend)
        if hasattr(self.model, "keep_aux_hidden_states"):  # an EAGLE-3 proposer of this engine asks again
            self.model.keep_aux_hidden_states(())
        self.aux_steps = []
        max_model_len = max_model_len or cfg.max_position_embeddings
        self.max_model_len = max_model_len
        self.vocab_size = cfg.vocab_size
        self.graphs = None
        self._bitmask_bufs: list[torch.Tensor] | None = None  # structured output's host staging pair
        self._bitmask_turn = 0
        # the last step's sampling tensors, reused while the same sequences sample (_sampling_tensors)
        self._last_sampling: tuple[list[Sequence], SamplingTensors] | None = None
        # the last verify step's rows, their offsets and tensors (speculative decoding: _verify_sampling_tensors)
        self._last_verify: tuple[list[Sequence], list[int], SamplingTensors] | None = None
        #: step traces (:mod:`infer.engine.step_trace`): called with the step's ForwardOutput once all of
        #: the step's work is launched (on a CPU: done); None, the default, costs one check per step
        self.on_executed: Callable[[ForwardOutput], None] | None = None
        if cuda_graphs:
            from infer.engine.cuda_graphs import CUDAGraphRunner

            self.graphs = CUDAGraphRunner(self.model, self.kv_cache, cuda_graph_max_batch_size,
                                          -(-max_model_len // block_size), max_model_len,
                                          prefill_max_tokens=cuda_graph_prefill_max_tokens,
                                          mixed_max_tokens=cuda_graph_mixed_max_tokens,
                                          attention_backend=self.attention_backend, state_cache=self.state_cache)

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: LoadedModel,
                    agree_num_blocks: Callable[[int], int] | None = None, **kwargs) -> ModelRunner:
        """The runner an engine with ``config`` uses for ``loaded``: the model's forward (fused ops,
        MoE backend) chosen first, since the memory profile measures it; then the KV pool sized by
        :func:`~infer.engine.memory.num_kv_blocks`, its blocks, the attention backend and the graphs.

        Args:
            agree_num_blocks: tensor parallelism: maps this rank's block count to the count every rank
                uses (the smallest; rank 0's scheduler hands out block ids that must exist everywhere).
            kwargs: passed to the constructor (a subclass's own arguments).
        """
        mcfg = loaded.config
        max_model_len = config.default_max_model_len(mcfg.max_position_embeddings)
        budget = config.resolved_max_num_batched_tokens(max_model_len)
        paged = config.kv_cache == "paged"
        block_size = config.block_size if paged else max_model_len  # contiguous: one block per sequence
        backend = config.resolved_attention_backend()
        loaded.model.set_fused_ops(fused_ops(backend) if config.fused_kernels else None, max_model_len)
        if hasattr(loaded.model, "set_moe_impl"):  # an MoE model (phase 15): how its experts run
            loaded.model.set_moe_impl(moe_ops(config.resolved_moe_backend()))
        if hasattr(loaded.model, "set_prefill_rule"):  # a hybrid model (phase 17): its linear layers' prefills
            loaded.model.set_prefill_rule(linear_attention_ops(config.resolved_linear_attention_backend()))
        # decode buckets up to max_num_seqs rows; with speculative decoding (phase 12) up to max_num_seqs x (1 + k):
        # its verify steps replay them with every token a decode row (CUDAGraphRunner._run_verify; vLLM's capture
        # sizes grow the same way)
        spec = getattr(config, "speculative", None)
        rows_per_seq = 1 + spec.num_speculative_tokens if spec is not None else 1
        graph_bs = min(config.cuda_graph_max_batch_size, config.max_num_seqs * rows_per_seq) if config.cuda_graphs else 0
        # no step prefills more than the budget or the context
        graph_prefill = min(config.cuda_graph_prefill_max_tokens, budget, max_model_len) if graph_bs else 0
        graph_mixed = min(config.cuda_graph_mixed_max_tokens, budget) if graph_bs else 0
        lora = None
        if config.enable_lora:  # the slot buffers exist before the memory profile, which counts them
            from infer.kernels import lora_ops
            from infer.lora import LoRAModelManager

            lora = LoRAModelManager(loaded.model, mcfg, config.max_loras, config.max_lora_rank,
                                    config.resolved_max_cpu_loras(), lora_ops(backend))
        stride = snapshot_stride(config.state_snapshot_stride, block_size) if config.prefix_caching else 0
        num_blocks, num_slots, num_snapshots = cache_sizes(
            loaded, block_size, max_model_len, config.max_num_seqs, budget, config.kv_cache_memory_bytes,
            config.gpu_memory_utilization, graph_bs, graph_prefill, graph_mixed,
            mcfg.state_bytes_per_seq(next(loaded.model.parameters()).dtype, config.resolved_ssm_state_dtype()),
            cuda_graph_variants=2 if lora is not None else 1, state_pad_slots=int(config.cuda_graphs),
            snapshot_stride=stride, kv_cache_dtype=config.resolved_kv_cache_dtype())
        if agree_num_blocks is not None:
            num_blocks = agree_num_blocks(num_blocks)
        runner = cls(loaded, num_blocks, block_size, contiguous=not paged, attention_backend=backend,
                     max_model_len=max_model_len, cuda_graphs=config.cuda_graphs,
                     cuda_graph_max_batch_size=graph_bs or 1,
                     block_major=config.kv_offload != "none" and backend == "triton",
                     cuda_graph_prefill_max_tokens=graph_prefill, cuda_graph_mixed_max_tokens=graph_mixed,
                     pdl=config.pdl, num_state_slots=num_slots, num_snapshot_slots=num_snapshots,
                     kv_cache_dtype=config.resolved_kv_cache_dtype(), calculate_kv_scales=config.calculate_kv_scales,
                     ssm_state_dtype=config.resolved_ssm_state_dtype(), **kwargs)
        runner.lora_manager = lora
        if lora is not None and runner.graphs is not None:  # the graphs' LoRA variants (before capture)
            runner.graphs.enable_lora(lora.mapping)
        return runner

    @torch.inference_mode()
    @_with_pdl
    def warm_up(self) -> float:
        """CUDA with the Triton backend: launch every attention-kernel variant a step can need once,
        before any request does; returns the seconds it took (0 elsewhere: PyTorch ops and the
        Triton interpreter compile nothing).

        Triton compiles a kernel variant (its ``tl.constexpr`` values) the first time it is
        launched: ~1 s each, or a few hundred ms from the on-disk cache. The first request's
        prefill meets most of them and CUDA-graph capture the decode ones, but an extend that
        splits its keys (``SPLIT=True`` and the merge kernel: a prompt chunk, or a prefix hit's
        suffix, over a long cached prefix) first appears mid-serving, and compiling it there stalled
        every stream for 2.2 s (H200, Qwen3-4B shapes, chunked prefill with a 512-token budget).
        Like vLLM's warm-up runs (``compile_or_warm_up_model``), two dummy steps run through the
        model: a prefill, then a decode next to a 16-token extend over a long context. Their slots
        are -1 (padding: no K/V written) and their block tables point at block 0 (read, and the
        result dropped), so the cache is untouched.
        """
        if self.device.type != "cuda" or isinstance(self.attention_backend, TorchAttentionBackend):
            return 0.0  # (the PyTorch backend's cache write, an index_copy_, has no padding slot)
        start = time.perf_counter()
        bs = self.kv_cache.block_size
        long = min(self.max_model_len, 2048)  # a context split-KV kernels split (>= 1,024 keys)

        def dummy_step(rows: list[tuple[int, int]]) -> None:  # rows: (new tokens, context length)
            starts, positions = [0], []
            for n, ctx in rows:
                starts.append(starts[-1] + n)
                positions.extend(range(ctx - n, ctx))
            t = starts[-1]
            meta = self._metadata(starts, [ctx for _, ctx in rows], self._to_device([-1] * t, torch.int64),
                                  [[0] * -(-ctx // bs) for _, ctx in rows], sum(n == 1 for n, _ in rows))
            hidden = self._forward(self._to_device([0] * t, torch.int64), self._to_device(positions, torch.int64), meta)
            self._logits(hidden, [t - 1])

        n = min(16, long)
        with self.kv_cache.calibration_paused():  # calculate_kv_scales: the dummy K/V set no scale
            dummy_step([(n, n)])  # a prefill: one program per query tile, no split
            if long > n:
                dummy_step([(1, long), (n, long)])  # decodes first (AttentionMetadata), then a split extend
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    @_with_pdl
    def capture_cuda_graphs(self, progress: bool = True) -> float:
        """Capture the decode graphs (``cuda_graphs``); returns the seconds it took (0 without)."""
        return self.graphs.capture(progress) if self.graphs is not None else 0.0

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A host list of ints as a tensor on the device: one copy through pinned memory on CUDA
        (no pageable staging, and the host does not wait for it)."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    @_with_pdl
    def execute(self, scheduled: list[ScheduledSeq], eos_ids: list[int], prev: StepResult | None = None) -> StepResult:
        """Run one step over ``scheduled`` and sample the sequences that are ready to.

        The one decision is graph or eager: the CUDA-graph runner (phase 9) runs the step if one of
        its captured graphs fits it, else the model runs eagerly (nano-vllm's ``run_model``,
        mini-sglang's ``GraphRunner``). Either way the rest is the same: forks get their copy of the
        prompt's last block, then logits, prompt logprobs and sampling.

        Args:
            prev: async scheduling: the previous step, whose sampled tokens (still on the device) replace
                the placeholders in this step's input ids, on the device. Its ``before_next_sampling``,
                if set, is called after this step's forward is launched and before its sampling tensors
                are built.

        Returns:
            The :class:`StepResult`, its tokens still on the device (:meth:`StepResult.host_outputs`
            reads them; their copy to the host is already started).
        """
        step = StepInputs(scheduled, prev, self)
        if self.lora_manager is not None:
            self._set_lora_mapping(step)
        # a step that verifies drafts (phase 12) samples k + 1 rows per sequence: a decode graph over its tokens
        # as decode rows serves it, or the mixed step's pieces, which return every token's hidden state
        # hybrid prefix caching (phase 17): a step that restores a state snapshot (a prefix hit) runs eagerly, the
        # graphs' static metadata carries no snapshot copies; a decode-only step whose rows end a snapshot stride
        # replays its graph, and those rows' slots are copied after it (:meth:`_copy_decode_snapshots`)
        hybrid = self.state_cache is not None
        snapshots = hybrid and any(i.state_snapshots for i in scheduled)
        eager = hybrid and (any(i.state_restore >= 0 for i in scheduled) or snapshots and not step.is_decode_only)
        if self.model.aux_hidden_state_layers:
            self._keep_aux_steps()
        out = self.graphs.run(step, verify=step.has_spec) if self.graphs is not None and not eager else None
        if out is None:
            out = self._run_eager(step)
        elif snapshots:
            self._copy_decode_snapshots(scheduled)
        if self.model.aux_hidden_state_layers:  # EAGLE-3 (phase 12): a step its head catches up on
            self.aux_steps.append((step.flat, self.model.aux_hidden_states[: len(step.flat.ids)]))
        if step.has_forks:
            self._copy_fork_blocks(scheduled)
        logits, prompt_lp = out.logits, {}
        if out.hidden is not None:  # the LM head on the rows that sample, and the prompt logprobs
            prompt_lp = self._prompt_logprobs(step.flat.scheduled, step.flat.starts, out.hidden)
            if out.sampled:
                logits = self._logits(out.hidden, step.flat.sample_at)
        if out.sampled:
            self._before_sampling(prev)
            if step.has_spec:
                tensors = self._verify_sampling_tensors(out.sampled, eos_ids)
            else:
                tensors = self._sampling_tensors(out.sampled, eos_ids)
            result = self._result(out.sampled, sample(logits, tensors), prompt_lp)
        else:
            result = StepResult([], None, prompt_lp)
        if self.on_executed is not None:
            self.on_executed(out)
        return result

    def _keep_aux_steps(self) -> None:
        """EAGLE-3, before a forward overwrites the kept hidden states: the last step's, if the head has not
        read them yet (async scheduling: the next step runs before the last one's tokens are applied), become
        a copy, enqueued before the forward; at most :attr:`MAX_AUX_STEPS` steps stay (the oldest dropped)."""
        steps = self.aux_steps = self.aux_steps[-(self.MAX_AUX_STEPS - 1):]
        if steps and steps[-1][1].data_ptr() == self.model.aux_hidden_states.data_ptr():
            steps[-1] = (steps[-1][0], steps[-1][1].clone())

    def activate_loras(self, loras: list, in_use: set[int]) -> None:
        """LoRA (phase 16): make ``loras`` (:class:`~infer.lora.LoRARequest` s) resident in device slots,
        never reusing the slot of an adapter in ``in_use`` (:meth:`LoRAModelManager.activate`)."""
        self.lora_manager.activate(loras, in_use)

    def remove_lora(self, lora_int_id: int) -> bool:
        """LoRA: forget an adapter's host copy and device slot (:meth:`LoRAModelManager.remove`)."""
        return self.lora_manager.remove(lora_int_id)

    def _set_lora_mapping(self, step: StepInputs) -> None:
        """LoRA (phase 16): each flat row's adapter slot (-1: the base model), for every LoRA layer. The
        engine made the step's adapters resident before (:meth:`LoRAModelManager.activate`). A decode-only
        step's rows are its sequences as scheduled (the flat order is the same, and a decode graph never
        builds it)."""
        manager, slots = self.lora_manager, []
        for item in step.scheduled if step.is_decode_only else step.flat.scheduled:
            lora = item.seq.request.lora_request
            slots += [manager.slot_of(lora.lora_int_id) if lora is not None else -1] * item.num_tokens
        manager.set_mapping(slots)

    def _verify_sampling_tensors(self, seqs: list[Sequence], eos_ids: list[int]) -> SamplingTensors:
        """Speculative decoding (phase 12): the sampling tensors of a step where a sequence that verifies
        ``k`` drafts has ``k + 1`` consecutive rows in ``seqs``. Row ``i`` of such a sequence samples its
        ``(num_output_tokens + i)``-th token, so it takes that place in the sequence's random stream
        (``steps``): with the drafts before it accepted, it draws exactly what decoding would have.
        (Verifying sequences carry no per-token sampling state: :func:`~infer.engine.spec_decode.can_speculate`.)

        As for decode steps (:meth:`_sampling_tensors`), the last verify step's tensors are reused when the
        same stateless rows verify again (the same sequences, as many drafts each): only the stream positions
        change, by however many tokens each sequence gained, so they are copied anew (not at all when every
        row is greedy). Building them cost ~0.8 ms of host time per step on the development CPU."""
        offsets = [0] * len(seqs)
        for i in range(1, len(seqs)):
            if seqs[i] is seqs[i - 1]:
                offsets[i] = offsets[i - 1] + 1
        self._last_sampling = None  # the rows differ from any decode step's
        last = self._last_verify
        if last is not None and last[1] == offsets and len(last[0]) == len(seqs) and all(map(operator.is_, last[0], seqs)):
            tensors = last[2]
            if not tensors.all_greedy:
                steps = [s.num_output_tokens + o for s, o in zip(seqs, offsets)]
                tensors.steps.copy_(self._to_device(steps, tensors.steps.dtype))
            return tensors
        stateless = all(s.guide is None and not s.has_penalties and s.num_output_tokens >= s.params.min_tokens
                        for s in seqs)
        tensors = self._build_sampling_tensors(seqs, eos_ids, stateless, offsets)
        self._last_verify = (list(seqs), offsets, tensors) if stateless else None
        return tensors

    def _copy_decode_snapshots(self, scheduled: list[ScheduledSeq]) -> None:
        """After a decode graph's replay: copy the state slot of each row that ends a snapshot stride into its
        snapshot slot, every linear layer at once (:meth:`RecurrentStateCache.copy_slot`). A row runs one token,
        so its snapshot is the state after the step, what the eager forward copies layer by layer
        (:meth:`~infer.models.qwen3_5.GatedDeltaNet.forward`). Before this, every such step ran eagerly: with
        128 sequences decoding at a 256-token stride, ~40% of the steps (on an H200, Qwen3.5-4B shapes, the
        offline workload's TPOT p50 went from 14.0 to 8.2 ms)."""
        pairs = [(item.seq.state_slot, snap) for item in scheduled for _, snap in item.state_snapshots if snap >= 0]
        if pairs:
            src, dst = self._to_device(list(zip(*pairs)), torch.int64)  # [2, N]: one copy to the device
            self.state_cache.copy_slot(src, dst)

    def _run_eager(self, step: StepInputs) -> ForwardOutput:
        """The step's forward, launched kernel by kernel: the hidden states of every token."""
        f = step.flat
        input_ids = self._to_device(f.ids, torch.int64)
        if step.flat_patch is not None:
            patch_input_ids(input_ids, step.flat_patch)
        hidden = self._forward(input_ids, self._to_device(f.positions, torch.int64), step.metadata)
        return ForwardOutput(f.sampled, hidden=hidden)

    def _copy_fork_blocks(self, scheduled: list[ScheduledSeq]) -> None:
        """``n > 1``: after the prompt's forward, each fork gets its copy of the prompt's last,
        partly filled block (the full ones are shared)."""
        bs = self.kv_cache.block_size
        for item in scheduled:
            if not item.forks:
                continue
            n = item.seq.num_computed_tokens + item.num_tokens
            for fork in item.forks:
                if self.state_cache is not None:  # hybrid (phase 17): the state the shared prompt left
                    self.state_cache.copy_slot(item.seq.state_slot, fork.state_slot)
                src, dst = item.seq.block_table[-1], fork.block_table[-1]
                if src != dst:
                    self._copy_block_prefix(src, dst, n - (len(item.seq.block_table) - 1) * bs)

    @staticmethod
    def _before_sampling(prev: StepResult | None) -> None:
        """Run ``prev.before_next_sampling`` once (see :class:`StepResult`)."""
        if prev is not None and prev.before_next_sampling is not None:
            hook, prev.before_next_sampling = prev.before_next_sampling, None
            hook()

    # The three places a step touches the model or the cache. Tensor parallelism (phase 14,
    # infer.engine.executor) overrides them to run the same call on every rank.

    def runs_metadata(self, tables: list[list[int]], firsts: list[int], lengths: list[int],
                      kv_cache: KVCache | None = None) -> AttentionMetadata:
        """:class:`AttentionMetadata` of sequences that each run ``lengths[i]`` tokens from position
        ``firsts[i]``, back to back (a draft model's or an EAGLE-3 head's forward, phase 12), their K/V
        written to and read from ``kv_cache`` (default: this runner's). All of them one token: decodes."""
        kv = kv_cache if kv_cache is not None else self.kv_cache
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        seq_lens = [f + n for f, n in zip(firsts, lengths)]
        slots = self._to_device(kv.slot_mapping(tables, firsts, lengths), torch.int64)
        meta = self._metadata(starts, seq_lens, slots, tables, len(lengths) if all(n == 1 for n in lengths) else 0)
        if kv_cache is not None:
            meta.kv_cache = kv_cache
        return meta

    def _metadata(self, starts: list[int], seq_lens: list[int], slot_mapping: torch.Tensor,
                  tables: list[list[int]], num_decodes: int) -> AttentionMetadata:
        """The step's :class:`AttentionMetadata` over this runner's KV cache."""
        return AttentionMetadata(
            query_start_loc=self._to_device(starts, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            kv_cache=self.kv_cache,
            slot_mapping=slot_mapping,
            block_tables=self._block_table_tensor(tables),
            block_tables_cpu=tables,
            num_decodes=num_decodes,
        )

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward: ``[T]`` ids and positions -> ``[T, hidden]``."""
        return self.model(input_ids, positions, meta)

    def _logits(self, hidden: torch.Tensor, rows: list[int] | slice) -> torch.Tensor:
        """Logits ``[N, vocab]`` of ``hidden``'s ``rows`` (flat token indices, or a slice of them)."""
        return self.model.compute_logits(hidden[rows if isinstance(rows, slice) else self._to_device(rows, torch.int64)])

    def _copy_block_prefix(self, src: int, dst: int, length: int) -> None:
        self.kv_cache.copy_block_prefix(src, dst, length)

    @staticmethod
    def _result(sampled, sampler_output, prompt_lp) -> StepResult:
        result = StepResult(sampled, sampler_output, prompt_lp)
        result.start_copy_to_host()
        return result

    def _block_table_tensor(self, tables: list[list[int]]) -> torch.Tensor:
        """int32 ``[B, W]`` on the device: the block tables, padded with 0 to the widest."""
        width = max(len(t) for t in tables)
        if width == 1:
            return self._to_device([t[0] for t in tables], torch.int32).view(-1, 1)
        rows = block_table_array(tables, width)
        t = torch.from_numpy(rows)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _sampling_tensors(self, seqs: list[Sequence], eos_ids: list[int]) -> SamplingTensors:
        """The step's :class:`SamplingTensors` for ``seqs`` (the sampler's rows, in order).

        Building them costs ~0.1-0.2 ms of host time per step, as much as the rest of a batch-1
        decode step's preparation. So when the same sequences sample again, in the same order,
        and no row carries state that changes per step (penalty histories, a ``min_tokens`` ban,
        a structured-output bitmask), the last step's tensors are reused. Only the stream
        positions change (``steps``, each row's output length, which keys its random draws), and
        by exactly one: every row sampled one token in the last sampling step and none since (a
        sequence gains tokens only by sampling), so they are advanced on the device, with no host
        list and no copy (and not at all when every row is greedy). vLLM's persistent batch keeps
        its sampling metadata the same way.
        """
        last = self._last_sampling  # set only when its rows were stateless; none of them can
        # have become stateful since: a guide and penalties are fixed per sequence, and a
        # min_tokens ban, once lifted, stays lifted (the output only grows)
        if last is not None and len(last[0]) == len(seqs) and all(map(operator.is_, last[0], seqs)):
            tensors = last[1]
            if not tensors.all_greedy:
                tensors.steps.add_(1)
            return tensors
        stateless = all(s.guide is None and not s.has_penalties and s.num_output_tokens >= s.params.min_tokens
                        for s in seqs)
        tensors = self._build_sampling_tensors(seqs, eos_ids, stateless)
        self._last_sampling = (list(seqs), tensors) if stateless else None
        return tensors

    def _build_sampling_tensors(self, seqs: list[Sequence], eos_ids: list[int], stateless: bool = False,
                                offsets: list[int] | None = None) -> SamplingTensors:
        """``stateless``: no row has a penalty, a ``min_tokens`` ban or a guide, so no row needs a token
        history, a suppressed id or a bitmask (nothing per row to gather: 181 against 273 us at 256 rows on
        the development CPU, 753 against 1,060 us on an H100 machine's host). ``offsets``: added to each
        row's place in its random stream (a verifying sequence's later rows; phase 12)."""
        steps = list(map(_NUM_OUTPUT_TOKENS, seqs))
        if offsets is not None:
            steps = [s + o for s, o in zip(steps, offsets)]
        if stateless:
            return SamplingTensors.from_params(list(map(_PARAMS, seqs)), seeds=list(map(_SEED, seqs)),
                                               steps=steps, prompt_ids_list=None,
                                               output_ids_list=None, suppress_list=None,
                                               vocab_size=self.vocab_size, device=self.device)
        suppress = []
        for seq in seqs:
            p = seq.params
            ban: list[int] = []
            if seq.num_output_tokens < p.min_tokens:
                ban = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(eos_ids))
            suppress.append(ban)
        # token histories only for rows with a penalty (building them is O(context) per row)
        rep = [s.params.repetition_penalty != 1.0 for s in seqs]
        pen = [s.has_penalties for s in seqs]
        tensors = SamplingTensors.from_params(
            [s.params for s in seqs],
            seeds=[s.seed for s in seqs],
            steps=steps,
            prompt_ids_list=[s.token_ids[: s.num_prompt_tokens] if r else [] for s, r in zip(seqs, rep)],
            output_ids_list=[s.output_token_ids if p else [] for s, p in zip(seqs, pen)],
            suppress_list=suppress,
            vocab_size=self.vocab_size,
            device=self.device,
        )
        if any(s.guide is not None for s in seqs):
            tensors.token_bitmask, tensors.token_bitmask_rows = self._token_bitmask(seqs, eos_ids)
        return tensors

    def _token_bitmask(self, seqs: list[Sequence], eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Structured output (phase 13): ``([R, ceil(V / 32)] int32 allowed-token bitmask, [R] int64
        rows)`` of the sequences with a guide, written by outlines-core straight into a host buffer
        (one bit per token), then copied to the device in one transfer.

        A row whose constraint allows no token at all (a dead end: the vocabulary cannot continue
        the automaton) would leave only ``-inf`` logits; it gets EOS instead, and the output
        processor ends it with ``finish_reason="error"``.
        """
        from infer.sampling.structured import guide_masks

        rows = [i for i, s in enumerate(seqs) if s.guide is not None]
        words = -(-self.vocab_size // 32)
        buf = self._bitmask_staging(len(rows), words)
        host = buf.numpy().view(np.uint32)
        for r, i in enumerate(rows):
            mask = guide_masks(seqs[i], eos_ids, self.vocab_size).mask(seqs[i].guide)  # kept per state
            host[r] = mask
            if not mask.any():  # a dead end: only EOS, which ends the sequence with an error
                eos = eos_ids[0]
                host[r, eos // 32] = 1 << (eos % 32)
                seqs[i].guide_dead_end = True
        if self.device.type == "cuda":
            buf = buf.to(self.device, non_blocking=True)
        else:
            buf = buf.clone()  # the staging buffer is reused next step
        return buf, self._to_device(rows, torch.int64)

    def _bitmask_staging(self, num_rows: int, words: int) -> torch.Tensor:
        """int32 ``[num_rows, words]`` host buffer for a step's bitmask (pinned on CUDA): two kept and
        used in turn, so the host never writes one whose copy to the device may still be pending
        (the copy of two steps back is done: the host waited for the previous step's tokens)."""
        staging = self._bitmask_bufs
        if staging is None or staging[0].shape[0] < num_rows:
            cap = max(num_rows, 2 * staging[0].shape[0] if staging is not None else 8)
            pin = self.device.type == "cuda"
            staging = self._bitmask_bufs = [torch.zeros(cap, words, dtype=torch.int32, pin_memory=pin)
                                            for _ in range(2)]
            self._bitmask_turn = 0
        self._bitmask_turn ^= 1
        return staging[self._bitmask_turn][:num_rows]

    def _prompt_logprobs(self, scheduled, starts, hidden):
        """Prompt logprobs of sequences that asked for them (only sequence index 0 of a request)."""
        out = {}
        for i, item in enumerate(scheduled):
            seq = item.seq
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                continue  # a decode (checked first: the common case)
            k = seq.params.prompt_logprobs
            if k is None or seq.index != 0:
                continue
            done = seq.request.prompt_logprobs
            if done is not None and len(done) >= seq.num_prompt_tokens:
                continue  # recomputed after a preemption: already reported
            # after a preemption mid-prefill (chunked), positions before len(done) - 1 were reported
            first = max(seq.num_computed_tokens, len(done) - 1 if done else 0)
            s = starts[i] + first - seq.num_computed_tokens
            end = min(seq.num_computed_tokens + item.num_tokens, seq.num_prompt_tokens)
            # position p predicts token p + 1; the last prompt position predicts the first output
            n_pred = end - first - (1 if end == seq.num_prompt_tokens else 0)
            if n_pred <= 0:
                continue
            lp = torch.log_softmax(self._logits(hidden, slice(s, s + n_pred)).float(), dim=-1)
            targets = torch.tensor(seq.token_ids[first + 1 : first + 1 + n_pred], device=lp.device)
            chosen = lp.gather(1, targets[:, None])[:, 0]
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
            ranks = (lp > chosen[:, None]).sum(-1) + 1
            out[id(seq)] = (chosen.cpu(), ranks.cpu(), top_i.cpu(), top_v.cpu())
        return out
