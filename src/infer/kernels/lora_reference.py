"""Batched multi-adapter LoRA (phase 16) in plain PyTorch: the reference of :mod:`.lora_triton`.

A LoRA adapter (Hu et al., arXiv:2106.09685) changes a projection ``y = x W^T`` into
``y = x W^T + s (x A^T) B^T`` with ``A [r, in]``, ``B [out, r]`` and a scale ``s``. Serving many
adapters at once (Punica, Chen et al., arXiv:2310.18547; S-LoRA, Sheng et al., arXiv:2311.03285)
keeps the base product shared and adds each row's *own* adapter's delta::

    y[t] += (x[t] @ A[slot[t]]^T) @ B[slot[t]]^T        for every row t with slot[t] >= 0

in two steps, the names Punica and vLLM use: **shrink** (``x @ A^T``, ``in -> r`` features) and
**expand** (``@ B^T``, ``r -> out``, added into ``y``). The adapters sit stacked in fixed device
*slots* (``A [L, R, in]``, ``B [L, out, R]``: ``L = max_loras``, ``R = max_lora_rank``, smaller ranks
padded with zeros, the scale already folded into ``B``).

The step's rows are grouped by slot once per step (:func:`make_lora_meta`, the segments of Punica's
SGMV): ``sorted_rows`` lists the rows of slot 0, then slot 1, ...; rows without an adapter
(``slot = -1``) are in no segment and cost nothing. Here each segment is one pair of dense matmuls
(what runs on the CPU); :mod:`.lora_triton` runs every segment of every slot in one launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["LoRAKernelMeta", "make_lora_meta", "lora_shrink", "lora_expand", "add_lora", "add_lora_stacked", "lora_expand_stacked"]


@dataclass
class LoRAKernelMeta:
    """Which rows of a step use which slot, grouped by slot (built once per step, read by every layer).

    Attributes:
        num_tokens: ``T``, the step's rows.
        sorted_rows: int32 ``[T]`` on the device: the rows with an adapter, slot 0's first, then slot
            1's, ... (ascending within a slot); the entries past ``num_lora_rows`` are 0 (unused).
        slot_starts, slot_counts: int32 ``[L]`` on the device: slot ``l``'s rows are
            ``sorted_rows[slot_starts[l] : slot_starts[l] + slot_counts[l]]``.
        active_slots: int32 ``[A]`` on the device: the slots that have rows, ascending, then -1s. The
            Triton kernels' grid has one column of programs per entry, not per slot: a step of ``T`` rows
            uses at most ``min(L, T)`` adapters, and a decode step of one row one, however many slots
            ``max_loras`` keeps (with 32 slots, one program column instead of 32, all but one of which
            would only have found their slot empty and returned).
        segments: the same on the host: ``[(slot, start, count), ...]`` of the slots with rows.
        num_lora_rows: rows with an adapter (0: every LoRA op returns at once).
        first_rows: per segment, its first row when its rows are consecutive (``first .. first + count -
            1``: a batch of one adapter, a prompt), else -1; the plain-PyTorch path then takes slices
            instead of gathering rows.
        static: a CUDA graph's meta (:class:`~infer.lora.graphs.LoRAGraphInputs`): the five tensors are
            fixed buffers refilled before each replay, so the host knows neither ``segments`` (empty) nor
            ``num_lora_rows`` (set to ``num_tokens``, so no op returns early); only the Triton kernels,
            which read the groups on the device, take it.
        active_ranks: int32 ``[A]`` on the device, the adapter rank of each ``active_slots`` entry (0 for the
            -1s; its rows and columns past the rank are the zero padding up to ``R``), or None (every slot
            read to ``R``). The Triton kernels read only a slot's own rank (S-LoRA serves adapters of many
            ranks the same way), loading it beside the slot (a rank looked up by slot would be one more
            memory latency before a kernel's first tile); the plain-PyTorch ops multiply the zeros.
        split_counters: int32 zeros on the device, the arrival counters of the Triton shrink's split-K
            (:func:`~.lora_triton.split_counters`), or None (a launch that splits zeroes a buffer of its
            own first). The plain-PyTorch ops do not read them.
    """

    num_tokens: int
    sorted_rows: torch.Tensor
    slot_starts: torch.Tensor
    slot_counts: torch.Tensor
    active_slots: torch.Tensor
    segments: list[tuple[int, int, int]]
    num_lora_rows: int
    first_rows: list[int]
    static: bool = False
    active_ranks: torch.Tensor | None = None
    split_counters: torch.Tensor | None = None


def make_lora_meta(token_slots: list[int] | np.ndarray, num_slots: int, device: torch.device | str,
                   slot_ranks: list[int] | np.ndarray | None = None) -> LoRAKernelMeta:
    """Group a step's rows by adapter slot.

    Args:
        token_slots: ``[T]`` each row's slot in ``[0, num_slots)``, or -1 for no adapter.
        num_slots: ``L``, the slots (``max_loras``).
        device: where the kernels run.
        slot_ranks: ``[L]`` each slot's adapter rank (sets ``active_ranks``), or None.

    Raises:
        ValueError: a slot outside ``[-1, num_slots)``.
    """
    slots = np.asarray(token_slots, dtype=np.int64)
    if slots.size and (slots.min() < -1 or slots.max() >= num_slots):
        raise ValueError(f"token slots must be in [-1, {num_slots}), got {slots.min()}..{slots.max()}")
    rows, starts, counts = group_rows_by_slot(slots, num_slots)
    segments = [(s, int(starts[s]), int(counts[s])) for s in range(num_slots) if counts[s]]
    first_rows = [int(rows[start]) if rows[start + count - 1] - rows[start] + 1 == count else -1
                  for _, start, count in segments]

    def dev(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t

    active = np.array([slot for slot, _, _ in segments], dtype=np.int32)
    ranks = None if slot_ranks is None else dev(np.array([slot_ranks[s] for s in active], dtype=np.int32))
    return LoRAKernelMeta(len(slots), dev(rows), dev(starts), dev(counts), dev(active), segments, int(counts.sum()),
                          first_rows, active_ranks=ranks)


def group_rows_by_slot(slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The segments of Punica's SGMV: a step's rows grouped by adapter slot.

    Args:
        slots: int64 ``[T]``, each row's slot in ``[0, num_slots)`` or -1 (no adapter).

    Returns:
        ``(rows, starts, counts)``, int32: ``rows [T]`` lists the rows with an adapter, slot 0's first,
        then slot 1's, ..., ascending within a slot, then zeros; slot ``l``'s rows are
        ``rows[starts[l] : starts[l] + counts[l]]`` (``starts``, ``counts``: ``[num_slots]``; a slot
        without rows has count 0).
    """
    # >>> EXERCISE lora_segments
    order = np.argsort(slots, kind="stable")
    order = order[slots[order] >= 0]  # the rows with an adapter, grouped by slot
    counts = np.bincount(slots[slots >= 0], minlength=num_slots).astype(np.int32)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int32)
    rows = np.zeros(len(slots), dtype=np.int32)
    rows[: len(order)] = order
    return rows, starts, counts
    # <<< EXERCISE lora_segments


def _rows(meta: LoRAKernelMeta, start: int, count: int) -> torch.Tensor:
    return meta.sorted_rows[start:start + count].long()


def _host_groups(meta: LoRAKernelMeta) -> None:
    if meta.static:
        raise ValueError("a CUDA graph's LoRA meta keeps its row groups on the device only: the plain-PyTorch "
                         "ops need them on the host (use infer.kernels.lora_triton)")


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta, out: torch.Tensor,
                part_rank: int | None = None) -> torch.Tensor:
    """``out[t] = x[t] @ lora_a[slot[t]]^T`` for every row with an adapter (other rows untouched here; the
    Triton kernel's split-K may overwrite them, and no caller reads them).

    Args:
        x: ``[T, in]``, the projection's input.
        lora_a: ``[L, R, in]``, the slots' A matrices.
        out: float32 ``[T, R]``.
        part_rank: the rank of each part when ``lora_a`` stacks a merged projection's parts (the Triton
            kernel's rank masks need it); unused here (the padding is zeros).

    Returns:
        ``out``.
    """
    _host_groups(meta)
    for slot, start, count in meta.segments:
        rows = _rows(meta, start, count)
        out[rows] = x[rows].float() @ lora_a[slot].float().t()
    return out


def lora_expand(t: torch.Tensor, lora_b: torch.Tensor, meta: LoRAKernelMeta, y: torch.Tensor,
                y_offset: int = 0) -> torch.Tensor:
    """``y[t, y_offset : y_offset + out] += t[t] @ lora_b[slot[t]]^T`` for every row with an adapter.

    The shrink output is rounded to ``lora_b``'s dtype first (the Triton kernel feeds its matrix units in
    that dtype), the product accumulates in float32 and is added to ``y`` with one rounding.

    Args:
        t: float32 ``[T, R]``, :func:`lora_shrink`'s output.
        lora_b: ``[L, out, R]``, the slots' B matrices (scale folded in).
        y: ``[T, N]`` with ``N >= y_offset + out``, updated in place (a merged projection's output: the
            delta goes to its slice of the columns).

    Returns:
        ``y``.
    """
    _host_groups(meta)
    n = lora_b.shape[1]
    for slot, start, count in meta.segments:
        rows = _rows(meta, start, count)
        d = t[rows].to(lora_b.dtype).float() @ lora_b[slot].float().t()
        y[rows, y_offset:y_offset + n] = (y[rows, y_offset:y_offset + n].float() + d).to(y.dtype)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoRAKernelMeta, y_offset: int = 0, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """Shrink then expand: ``y[t, off:off + out] += (x[t] @ A[slot[t]]^T) @ B[slot[t]]^T`` in place.

    Args:
        y: ``[T, N]``; x: ``[T, in]``; lora_a: ``[L, R, in]``; lora_b: ``[L, out, R]``.
        buffer: optional float32 ``[T, R]`` scratch for the shrink output.
    """
    if meta.num_lora_rows == 0:
        return y
    _host_groups(meta)
    if x.dtype == lora_a.dtype == lora_b.dtype == y.dtype == torch.float32:
        # float32 (the CPU): the roundings of the general path are no-ops, so fewer, larger operations give
        # the same values. Every segment's rows consecutive: slices, two matmuls per segment; otherwise one
        # gather of the rows in slot order, two matmuls per segment, one scatter-add
        n = lora_b.shape[1]
        if min(meta.first_rows) >= 0:
            for (slot, _, count), first in zip(meta.segments, meta.first_rows):
                rows = slice(first, first + count)
                y[rows, y_offset:y_offset + n].addmm_(x[rows] @ lora_a[slot].t(), lora_b[slot].t())
            return y
        rows = meta.sorted_rows[: meta.num_lora_rows].long()
        xs = x.index_select(0, rows)
        d = torch.empty(len(xs), n, dtype=y.dtype, device=y.device)
        for slot, start, count in meta.segments:
            torch.mm(xs[start:start + count] @ lora_a[slot].t(), lora_b[slot].t(), out=d[start:start + count])
        y[:, y_offset:y_offset + n].index_add_(0, rows, d)
        return y
    t = buffer if buffer is not None else torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32,
                                                      device=x.device)
    return lora_expand(lora_shrink(x, lora_a, meta, t), lora_b, meta, y, y_offset)


def add_lora_stacked(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     part_starts: tuple[int, ...], meta: LoRAKernelMeta) -> torch.Tensor:
    """A merged projection's deltas (q/k/v, gate/up: parts that read the same input) from stacked buffers:
    part ``i``'s A is rows ``i R .. (i + 1) R - 1`` of ``lora_a [L, P R, in]``, its B rows
    ``part_starts[i] ..`` (to the next part's start) of ``lora_b [L, N, R]``, and its delta goes to the
    same columns of ``y [T, N]``: ``y[t, part_i] += (x[t] A_i^T) B_i^T``, in place.

    Here one shrink and an expand per part; the Triton version does one launch of each.
    """
    if meta.num_lora_rows == 0:
        return y
    t = lora_shrink(x, lora_a, meta, torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device))
    return lora_expand_stacked(t, lora_b, part_starts, meta, y)


def lora_expand_stacked(t: torch.Tensor, lora_b: torch.Tensor, part_starts: tuple[int, ...], meta: LoRAKernelMeta,
                        y: torch.Tensor) -> torch.Tensor:
    """The expand half of :func:`add_lora_stacked`: float32 ``t [T, P R]`` (the shrink by the stacked A),
    part ``i``'s B rows ``part_starts[i] ..`` of ``lora_b [L, N, R]``, ``y [T, N]`` updated in place."""
    rank = lora_b.shape[2]
    ends = [*part_starts[1:], lora_b.shape[1]]
    for i, (start, end) in enumerate(zip(part_starts, ends)):
        lora_expand(t[:, i * rank:(i + 1) * rank], lora_b[:, start:end], meta, y, start)
    return y
