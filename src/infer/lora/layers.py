"""LoRA-wrapped projections: the base ``nn.Linear`` plus a stack of adapter slots.

Every adaptable projection of the model (q/k/v/o, gate/up/down) is replaced, once at start-up, by a
:class:`LoRALinear` holding the base layer (its weights untouched: nothing is merged) and two
zero-initialized buffers, ``lora_a [L, R, in]`` and ``lora_b [L, out, R]`` (``L = max_loras`` slots,
``R = max_lora_rank``). Loading an adapter into slot ``l`` copies its A and (scaled) B into row ``l`` of
every projection it changes and zeros the others. The forward is the base product, then the LoRA
delta of each row's slot, added in place::

    y = x W^T (+ b)                    every row, one GEMM, as without LoRA
    y[t] += (x[t] A_l^T) B_l^T         rows t of slot l, grouped by slot (infer.kernels.lora_*)

Which row uses which slot is one :class:`LoRAMapping` shared by every layer, set once per step by the
model runner (vLLM's ``PunicaWrapper``, its "LoRA mapping").
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from infer.kernels.lora_reference import LoRAKernelMeta, make_lora_meta
from infer.lora.adapter import ATTENTION_PROJS, MLP_PROJS
from infer.models.layers import GatedMLP
from infer.parallel.state import shard


class LoRAMapping:
    """The step's rows grouped by adapter slot, read by every :class:`LoRALinear` of the model.

    Args:
        ops: the module whose ``add_lora`` runs (:func:`infer.kernels.lora_ops`).
        num_slots: ``max_loras``.
        device: the model's (of :attr:`split_counters`).
        max_rank: ``max_lora_rank`` (sizes :attr:`split_counters`).

    Attributes:
        token_slots: the step's slot of each row as set (tensor parallelism sends them; the CUDA graphs
            stage them, :class:`~infer.lora.graphs.LoRAGraphInputs`).
        has_lora: some row of the step has an adapter.
    """

    def __init__(self, ops, num_slots: int, device: torch.device | str = "cpu", max_rank: int = 64) -> None:
        self.ops = ops
        self.num_slots = num_slots
        self.device = torch.device(device)
        # each slot's adapter rank (on the host; a step's meta carries its adapters' as active_ranks), written
        # when an adapter is loaded into it; until then "all of R" (a rank past R reads to R)
        self.slot_ranks = np.full(num_slots, 1 << 30, dtype=np.int32)
        # the split-K shrink's arrival counters (LoRAKernelMeta.split_counters): one per output tile of a
        # launch of up to 4,096 rows (64 row blocks; a merged projection's 3 R columns in blocks of >= 16)
        self.split_counters = torch.zeros(64 * -(-3 * max_rank // 16) * num_slots, dtype=torch.int32,
                                          device=device)
        self.token_slots: list[int] | None = None
        self.has_lora = False
        self._device: torch.device | str = "cpu"
        self._meta: LoRAKernelMeta | None = None
        self._capture: tuple[LoRAKernelMeta | None] | None = None  # while a CUDA graph is captured

    @property
    def meta(self) -> LoRAKernelMeta | None:
        """The groups the layers read; None: no row has an adapter (the layers add nothing). Built on first
        use (a step that replays a CUDA graph never builds it); while a graph is captured, the graph's
        static meta (:meth:`capturing`)."""
        if self._capture is not None:
            return self._capture[0]
        if self._meta is None and self.has_lora:
            self._meta = make_lora_meta(self.token_slots, self.num_slots, self._device, self.slot_ranks)
            self._meta.split_counters = self.split_counters
        return self._meta

    def set(self, token_slots: list[int], device: torch.device) -> None:
        """Set the step's per-row slots (``[T]``, -1 for a row without adapter)."""
        self.token_slots, self._device, self._meta = token_slots, device, None
        self.has_lora = any(s >= 0 for s in token_slots)

    def clear(self) -> None:
        self._meta = self.token_slots = None
        self.has_lora = False

    @contextlib.contextmanager
    def capturing(self, meta: LoRAKernelMeta | None):
        """While a CUDA graph is captured the layers read ``meta``: a static one (the graph's LoRA
        variant, every layer's delta launched over groups read on the device) or None (the base
        variant: the base model's forward, exactly)."""
        self._capture = (meta,)
        try:
            yield
        finally:
            self._capture = None

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              y_offset: int = 0, reduce=None) -> torch.Tensor:
        """``y`` plus each row's adapter delta (in place, at columns ``y_offset`` on: a merged projection's
        slice); ``y`` unchanged without any. ``reduce``: a row-parallel layer's all-reduce, which completes
        the shrink's partial sums (each rank holds a slice of A's columns) before the expand."""
        meta = self.meta
        if meta is None:
            return y
        if meta.num_tokens != x.shape[0]:
            raise RuntimeError(f"the LoRA mapping is for {meta.num_tokens} rows, the forward has {x.shape[0]}")
        if reduce is None:
            return self.ops.add_lora(y, x, lora_a, lora_b, meta, y_offset)
        t = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
        reduce(self.ops.lora_shrink(x, lora_a, meta, t))
        return self.ops.lora_expand(t, lora_b, meta, y, y_offset)

    def apply_parts(self, y: torch.Tensor, x: torch.Tensor, stacked_a: torch.Tensor, parts,
                    stacked_b: torch.Tensor | None = None, part_starts: tuple[int, ...] | None = None
                    ) -> torch.Tensor:
        """A merged projection's deltas: one shrink by the parts' stacked A (``[L, parts * R, in]``), then
        each part's expand from its ``R`` columns of the shrink output into its slice of ``y``
        (``parts``: ``[(LoRALinear, first output column), ...]``, in the stacking order); with the parts'
        stacked B (``[L, out, R]``, part ``i``'s rows from ``part_starts[i]``), one expand for all."""
        meta = self.meta
        if meta is None:
            return y
        if meta.num_tokens != x.shape[0]:
            raise RuntimeError(f"the LoRA mapping is for {meta.num_tokens} rows, the forward has {x.shape[0]}")
        if meta.num_lora_rows == 0:
            return y
        if stacked_b is not None:
            return self.ops.add_lora_stacked(y, x, stacked_a, stacked_b, part_starts, meta)
        rank = stacked_a.shape[1] // len(parts)
        t = self.ops.lora_shrink(x, stacked_a, meta, torch.empty(x.shape[0], stacked_a.shape[1], dtype=torch.float32,
                                                                 device=x.device), part_rank=rank)
        for i, (lora, offset) in enumerate(parts):
            self.ops.lora_expand(t[:, i * rank:(i + 1) * rank], lora.lora_b, meta, y, offset)
        return y


class LoRALinear(nn.Module):
    """A projection with ``max_loras`` adapter slots (see the module docstring).

    Args:
        base: the model's ``nn.Linear`` (kept as ``base_layer``, unchanged).
        max_loras, max_lora_rank: the slots and their width.
        mapping: the model's shared :class:`LoRAMapping`.
        shard: tensor parallelism (phase 14): ``(dim, index, parts)`` of the base weight on this rank, as
            :func:`~infer.parallel.state.shard` takes it, or None. A column-parallel projection (``dim``
            0: its output rows) keeps the same rows of B and all of A; a row-parallel one (``dim`` 1: its
            input columns) the same columns of A and all of B, and its shrink's partial sums are
            all-reduced (``reduce``) before the expand (vLLM's ``RowParallelLinearWithLoRA``).
        reduce: the all-reduce of a row-parallel projection, or None.
        dtype, device: of the slot buffers (the model's compute dtype); default: the base weight's.

    Shapes: ``x [T, in]`` -> ``[T, out]`` (this rank's ``in`` and ``out``).
    """

    def __init__(self, base: nn.Linear, max_loras: int, max_lora_rank: int, mapping: LoRAMapping,
                 shard: tuple[int, int, int] | None = None, reduce=None, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.base_layer = base
        self.shard, self.reduce = shard, reduce
        self.in_features, self.out_features = base.in_features, base.out_features
        kw = dict(dtype=dtype or base.weight.dtype, device=device or base.weight.device)
        self.register_buffer("lora_a", torch.zeros(max_loras, max_lora_rank, self.in_features, **kw),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_lora_rank, **kw),
                             persistent=False)
        self.mapping = mapping

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:  # the fused forward's merge re-points the parts' weights
        self.base_layer.weight = value

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @bias.setter
    def bias(self, value: torch.Tensor | None) -> None:
        self.base_layer.bias = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_delta(self.base_layer(x), x)

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, y_offset: int = 0) -> torch.Tensor:
        """``y`` (the base product, or a merged one at columns ``y_offset``) plus each row's delta."""
        return self.mapping.apply(y, x, self.lora_a, self.lora_b, y_offset, self.reduce)

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's whole ``(A [r, in], B [out, r])`` in ``slot`` (this rank's piece of it, the rank
        padded with zeros), or zeros (``None``: the adapter leaves this projection alone)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if weights is not None:
            a, b = weights
            if self.shard is not None:
                dim, index, parts = self.shard
                a, b = (a, shard(b, (0, index, parts))) if dim == 0 else (shard(a, (1, index, parts)), b)
            r = a.shape[0]
            self.lora_a[slot, :r].copy_(a)
            self.lora_b[slot, :, :r].copy_(b)


class LoRAOps:
    """The fused ops of phase 8 (:mod:`infer.kernels.fused_triton` or :mod:`~infer.kernels.fused_reference`)
    with each projection's LoRA delta added: the model's fused forward runs unchanged with this object as
    its ``ops`` (:meth:`~infer.models.layers.CausalLM.set_fused_ops`).

    A merged projection (``qkv_proj``, ``gate_up_proj``) carries ``lora_parts``, its parts'
    :class:`LoRALinear` and where each part's rows start in its output: each part's delta goes to its own
    slice of the columns (q's adapter never touches k's columns). The fused steps that hide a projection's
    input or output (the norm and the projection in one call, the residual add in the projection's
    epilogue, the activation in it) run as their separate steps when a row of the step has an adapter, so
    the delta is added before the activation and after the norm; steps without adapters keep the fused
    path.

    A one-row step with the Triton kernels (batch-1 decode, :meth:`_row_lora`) keeps the fused steps and
    needs one LoRA kernel per projection, not two: the shrink (:func:`~infer.kernels.lora_triton.lora_shrink_row`,
    which also does the norm before QKV and gate/up, so that no norm kernel runs) and the skinny GEMM
    with the expand in its epilogue (:class:`~infer.kernels.skinny_gemm.LoRAEpilogue`), before its
    activation or residual add. A decoder layer then launches 2 kernels more than the base model's
    instead of 9 (8 LoRA kernels and the activation).
    """

    def __init__(self, ops, mapping: LoRAMapping) -> None:
        self.base_ops = ops
        self.mapping = mapping
        device = mapping.device
        # the multi-row shrinks' stream (_shrink_beside): beside the base GEMM, which reads the same input
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __getattr__(self, name: str):
        return getattr(self.base_ops, name)

    @staticmethod
    def _parts(layer: nn.Module) -> tuple[nn.Module, list[tuple[LoRALinear, int]]]:
        """``(the layer to multiply by, [(LoRALinear, first output column), ...])``."""
        if isinstance(layer, LoRALinear):
            return layer.base_layer, [(layer, 0)]
        return layer, getattr(layer, "lora_parts", [])

    def _active(self, layer: nn.Module) -> bool:
        return self.mapping.meta is not None and bool(self._parts(layer)[1])

    def _row_lora(self, x: torch.Tensor, layer: nn.Module):
        """``(base nn.Linear, A [L, P R, in], B [L, out, R], part starts)`` when this product takes the one-row
        path (one row with an adapter mapping, the Triton LoRA kernels, a one-process ``nn.Linear`` the
        skinny GEMM takes, its parts' A and B stacked or a single part), else None."""
        meta = self.mapping.meta
        if (meta is None or meta.num_tokens != 1 or x.dim() != 2 or x.shape[0] != 1
                or not hasattr(self.mapping.ops, "lora_shrink_row")):
            return None
        from infer.kernels import skinny_gemm

        stacked = self._stacked(layer)
        if stacked is None or not skinny_gemm.fits(x, stacked[0].weight):
            return None
        return stacked

    def _stacked(self, layer: nn.Module):
        """``(base nn.Linear, A [L, P R, in], B [L, out, R], part starts)`` of a one-process ``nn.Linear`` whose
        parts' A and B are stacked (or a single part), else None."""
        base, parts = self._parts(layer)
        parallel = getattr(base, "parallel", None)
        if (not parts or not isinstance(base, nn.Linear) or (parallel is not None and parallel.tp_size > 1)
                or any(lora.reduce is not None for lora, _ in parts)):
            return None
        if isinstance(layer, LoRALinear):
            a, b, starts = layer.lora_a, layer.lora_b, (0,)
        else:
            a, b = getattr(layer, "lora_a_stacked", None), getattr(layer, "lora_b_stacked", None)
            starts = getattr(layer, "lora_part_starts", None)
        if a is None or b is None or b.shape[1] != base.weight.shape[0] or a.shape[1] != len(starts) * b.shape[2]:
            return None
        return base, a, b, starts

    def _beside(self, x: torch.Tensor, work) -> None:
        """Run ``work()`` (LoRA kernels that read ``x``) on the side stream of a GPU, so that it runs while the
        caller's base GEMM (which reads the same ``x``) runs on the current stream; :meth:`_join` before what
        reads its results. On the CPU it runs here and now. A CUDA graph captures the fork and the join like
        any two streams' work."""
        if not self._forks(x):
            work()
            return
        self._side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self._side):
            work()

    def _forks(self, x: torch.Tensor) -> bool:
        return self._side is not None and x.is_cuda

    def _join(self, y: torch.Tensor) -> None:
        if self._forks(y):
            torch.cuda.current_stream(y.device).wait_stream(self._side)

    def _shrink_beside(self, x: torch.Tensor, layer: nn.Module):
        """A multi-row step on the GPU: the shrink of ``x`` beside the base GEMM (:meth:`_beside`), so only the
        expand follows the GEMM. Returns ``(t, B, part starts)`` for :meth:`_expand_after`, or None (this layer
        takes the path on one stream)."""
        meta = self.mapping.meta
        if not self._forks(x) or meta is None or meta.num_lora_rows == 0:
            return None
        stacked = self._stacked(layer)
        if stacked is None:
            return None
        _, a, b, starts = stacked
        t = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)  # (main's: freed after the join)
        self._beside(x, lambda: self.mapping.ops.lora_shrink(x, a, meta, t, part_rank=b.shape[2]))
        return t, b, starts

    def _expand_after(self, y: torch.Tensor, shrunk) -> torch.Tensor:
        """Join the side stream (:meth:`_shrink_beside`), then the expand adds the delta to the base product ``y``."""
        t, b, starts = shrunk
        self._join(y)
        return self.mapping.ops.lora_expand_stacked(t, b, starts, self.mapping.meta, y)

    def _delta_into_residual(self, x: torch.Tensor, layer: nn.Module, residual: torch.Tensor | None):
        """A block's last projection (o, down) of a multi-row step, whose sum with the residual stream is the
        block's output: its LoRA delta, shrink and expand, goes into ``residual`` in place (``y + (residual +
        delta)`` is ``(y + delta) + residual`` within a rounding), on the side stream beside the base GEMM
        (:meth:`_beside`). After the join nothing of LoRA is left on the stream: the next norm adds the
        residual, as without adapters. Returns ``(y, residual)``, or None (this layer adds its delta to ``y``)."""
        meta = self.mapping.meta
        stacked = self._stacked(layer)
        if (meta is None or stacked is None or residual is None or residual.dim() != 2 or residual.stride(-1) != 1
                or residual.shape != (x.shape[0], stacked[0].weight.shape[0])):
            return None
        base, a, b, starts = stacked
        self._beside(x, lambda: self.mapping.ops.add_lora_stacked(residual, x, a, b, starts, meta))
        y = self.base_ops.linear(x, base)
        self._join(y)
        return y, residual

    def _row_shrink(self, x: torch.Tensor, row, residual: torch.Tensor | None = None,
                    norm_weight: torch.Tensor | None = None, eps: float = 0.0, unit_offset: bool = False):
        """``lora_shrink_row`` of ``x`` for :meth:`_row_lora`'s ``row`` (optionally after the norm): ``(t, h, s)``."""
        return self.mapping.ops.lora_shrink_row(x, row[1], self.mapping.meta.active_slots, residual, norm_weight, eps,
                                                unit_offset, rank=self.mapping.meta.active_ranks,
                                                part_rank=row[2].shape[2])

    def _row_product(self, x: torch.Tensor, row, residual: torch.Tensor | None = None,
                     activation: str | None = None, config=None, t: torch.Tensor | None = None) -> torch.Tensor:
        """The one-row product of :meth:`_row_lora`'s ``row``: the shrink of ``x`` (unless given, ``t``),
        then the skinny GEMM adding the delta in its epilogue (then the activation or the residual add)."""
        from infer.kernels import skinny_gemm

        base, _, b, starts = row
        if t is None:
            t = self._row_shrink(x, row)[0]
        meta = self.mapping.meta  # one row: its slot and its rank, first (a CUDA graph's inputs)
        return skinny_gemm.skinny_linear(x, base.weight, base.bias, config, residual=residual, activation=activation,
                                         lora=skinny_gemm.LoRAEpilogue(t, b, meta.active_slots, starts, meta.active_ranks))

    def linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        row = self._row_lora(x, layer)
        if row is not None:
            return self._row_product(x, row)
        base, parts = self._parts(layer)
        shrunk = self._shrink_beside(x, layer)
        y = self.base_ops.linear(x, base)
        if shrunk is not None:
            return self._expand_after(y, shrunk)
        if self.mapping.meta is not None:
            stacked = getattr(layer, "lora_a_stacked", None)
            if stacked is not None:  # one shrink for every part, and one expand if B is stacked (_stack_parts)
                return self.mapping.apply_parts(y, x, stacked, parts, getattr(layer, "lora_b_stacked", None),
                                                getattr(layer, "lora_part_starts", None))
            for lora, offset in parts:
                lora.add_delta(y, x, offset)
        return y

    def linear_residual(self, x: torch.Tensor, layer: nn.Module, residual: torch.Tensor | None):
        row = self._row_lora(x, layer)
        if row is not None:  # the residual add in the epilogue, after the delta
            if residual is not None and residual.stride(-1) == 1 and residual.shape == (1, row[0].weight.shape[0]):
                return self._row_product(x, row, residual=residual), None
            return self._row_product(x, row), residual
        if not self._active(layer):
            return self.base_ops.linear_residual(x, self._parts(layer)[0], residual)
        added = self._delta_into_residual(x, layer, residual)
        if added is not None:
            return added
        return self.linear(x, layer), residual  # the add rides with the next norm, as the reference's

    def add_rms_norm_linear(self, x, residual, weight, eps, unit_offset, layer, activation=None):
        row = self._row_lora(x, layer)
        if row is not None and (residual is None or residual.stride(-1) == 1):
            from infer.kernels import skinny_gemm

            # the norm in the shrink's kernel (which stores the normalized row), the delta in the GEMM's epilogue
            t, normed, residual = self._row_shrink(x, row, residual, weight, eps, unit_offset)
            config = skinny_gemm.after_norm_config(row[0].weight, activation)
            return self._row_product(normed, row, activation=activation, config=config, t=t), residual
        if not self._active(layer):
            return self.base_ops.add_rms_norm_linear(x, residual, weight, eps, unit_offset, self._parts(layer)[0],
                                                     activation)
        x, residual = self.base_ops.add_rms_norm(x, residual, weight, eps, unit_offset)
        y = self.linear(x, layer)
        return (self.base_ops.act_and_mul(y, activation) if activation is not None else y), residual


def _shard_specs(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Tensor parallelism (phase 14): each projection's split on this rank, as the layers make it
    (:class:`~infer.models.layers.Attention`, :class:`~infer.models.layers.GatedMLP`); empty on one rank."""
    ps = model.parallel
    tp, r = ps.tp_size, ps.tp_rank
    if tp == 1:
        return {}
    kv_parts = min(tp, model.config.num_kv_heads)  # fewer KV heads than ranks: each copied to several
    kv = (0, r * kv_parts // tp, kv_parts)
    return {"q_proj": (0, r, tp), "k_proj": kv, "v_proj": kv, "o_proj": (1, r, tp),
            "gate_proj": (0, r, tp), "up_proj": (0, r, tp), "down_proj": (1, r, tp)}


def _attach_merged_parts(model: nn.Module, layers: dict[tuple[int, str], LoRALinear]) -> None:
    """Give every merged projection (fused kernels, phase 8) its parts' :class:`LoRALinear` and offsets."""
    for i, layer in enumerate(model.model.layers):
        for module, merged in ((layer.self_attn, "qkv_proj"), (layer.mlp, "gate_up_proj")):
            proj = getattr(module, merged, None)
            if proj is None:
                continue
            wrapper = {id(m.base_layer): m for (j, _), m in layers.items() if j == i}
            proj.lora_parts = [(part if isinstance(part, LoRALinear) else wrapper[id(part)], start)
                               for part, start, _ in proj.part_rows]
            _stack_parts(proj)


def _stack_parts(proj: nn.Module) -> None:
    """The parts of a merged projection read the same input, so their A matrices become views of one
    buffer ``lora_a_stacked [L, parts * R, in]`` (part ``i``'s rows ``i R .. (i + 1) R - 1``): one shrink
    launch gives every part's ``x A^T`` (:meth:`LoRAMapping.apply_parts`). When the parts fill the
    output's columns in order (q, k, v; gate, up), their B matrices likewise become views of
    ``lora_b_stacked [L, out, R]`` and one expand launch adds every part's delta (a decode step's
    LoRA kernels per layer: 4 shrinks and 4 expands instead of 4 and 7). Done once at start-up, before
    any CUDA graph reads the buffers; loading an adapter writes through the views."""
    parts = [lora for lora, _ in proj.lora_parts]
    if getattr(proj, "lora_a_stacked", None) is not None or len(parts) < 2 or any(p.reduce is not None for p in parts):
        return
    num_slots, rank, k = parts[0].lora_a.shape
    stacked = parts[0].lora_a.new_zeros(num_slots, len(parts) * rank, k)
    for i, part in enumerate(parts):
        view = stacked[:, i * rank:(i + 1) * rank]
        view.copy_(part.lora_a)
        part.lora_a = view
    proj.lora_a_stacked = stacked
    starts = [start for _, start in proj.lora_parts]
    ends = [*starts[1:], sum(p.lora_b.shape[1] for p in parts)]
    if (len(parts) > 3 or starts[0] != 0 or any(s % 16 for s in starts)
            or any(end - start != p.lora_b.shape[1] for p, start, end in zip(parts, starts, ends))):
        return  # (every merged projection of the supported models qualifies)
    stacked_b = parts[0].lora_b.new_zeros(num_slots, ends[-1], rank)
    for part, start, end in zip(parts, starts, ends):
        view = stacked_b[:, start:end]
        view.copy_(part.lora_b)
        part.lora_b = view
    proj.lora_b_stacked, proj.lora_part_starts = stacked_b, tuple(starts)


def add_lora_layers(model: nn.Module, max_loras: int, max_lora_rank: int, mapping: LoRAMapping
                    ) -> dict[tuple[int, str], LoRALinear]:
    """Replace every adaptable projection of ``model`` (a :class:`~infer.models.layers.CausalLM`) by a
    :class:`LoRALinear`; an MoE block's experts are left alone. A model with the fused forward (its ``ops``
    set) gets :class:`LoRAOps` around them, and its merged projections their parts (call this after
    ``set_fused_ops``).

    Returns:
        ``{(layer index, projection name): the LoRALinear}``. Idempotent.
    """
    layers: dict[tuple[int, str], LoRALinear] = {}
    shards = _shard_specs(model)
    emb = model.model.embed_tokens.weight  # the compute dtype and device (a projection may be quantized)
    for i, layer in enumerate(model.model.layers):
        modules = [(layer.self_attn, ATTENTION_PROJS)]
        if isinstance(layer.mlp, GatedMLP):
            modules.append((layer.mlp, MLP_PROJS))
        for module, names in modules:
            for name in names:
                proj = getattr(module, name)
                if not isinstance(proj, LoRALinear):
                    spec = shards.get(name)
                    reduce = model.parallel.all_reduce if spec is not None and spec[0] == 1 else None
                    proj = LoRALinear(proj, max_loras, max_lora_rank, mapping, spec, reduce, emb.dtype, emb.device)
                    setattr(module, name, proj)
                layers[(i, name)] = proj
    _attach_merged_parts(model, layers)
    if getattr(model, "ops", None) is not None and not isinstance(model.ops, LoRAOps):
        model.ops = LoRAOps(model.ops, mapping)  # the fused forward (phase 8)
    return layers
