"""LoRA under CUDA graphs (phases 9 and 16): the step's adapter groups as a graph *input*.

A CUDA graph replays the kernels it captured with the arguments they had: the same grid, the same
pointers, the same scalars. Two things of a LoRA step change from step to step, and both must reach
the replayed kernels through memory the graph reads, never through its launch arguments:

* **which row uses which adapter.** The shrink / expand kernels (:mod:`infer.kernels.lora_triton`)
  read the step's rows grouped by slot from five int32 device tensors (``sorted_rows``,
  ``slot_starts``, ``slot_counts``, ``active_slots`` and their ``active_ranks``:
  :func:`~infer.kernels.lora_reference.make_lora_meta`), and their grid depends only on the number of rows
  and ``max_loras``. Here the five are views of **one fixed device buffer**, ``[slot_starts (L) |
  slot_counts (L) | active_slots (A) | active_ranks (A) | sorted_rows (rows)]`` (``A = min(L, rows)``), which
  :meth:`LoRAGraphInputs.stage` refills before every replay (one copy from pinned host memory): the
  per-row slot index, grouped on the host as :func:`~infer.kernels.lora_reference.group_rows_by_slot`
  groups it. A graph's padding rows have no adapter, so they are in no group.
* **the adapters' weights.** They sit in the slot buffers of every
  :class:`~infer.lora.layers.LoRALinear` (``lora_a [L, R, in]``, ``lora_b [L, out, R]``), allocated
  once at start-up; loading an adapter *copies* into its slot (:meth:`~infer.lora.layers.LoRALinear.set_slot`),
  never reallocates, so a graph captured before the adapter existed reads it at the next replay.

A graph captured with this static meta has no host branch left on the adapters of the step: every
layer launches its shrink and expand, whose programs past the step's adapters (``active_slots``
entries of -1) return at once. A step where no
row has an adapter replays the *base* variant instead, captured with no LoRA at all (the fused
steps kept whole), so base rows cost nothing extra (vLLM's ``cudagraph_specialize_lora``).
"""

from __future__ import annotations

import numpy as np
import torch

from infer.kernels.lora_reference import LoRAKernelMeta
from infer.lora.layers import LoRAMapping


class LoRAGraphInputs:
    """The fixed device buffer the LoRA variants of the CUDA graphs read their row groups from.

    Args:
        mapping: the model's :class:`~infer.lora.layers.LoRAMapping` (its ``token_slots``: the step's
            slot of each row, in the order of the graph's rows; ``num_slots``: ``L = max_loras``).
        max_rows: the most rows a graph has (its largest bucket).
        device: the model's device.

    Attributes:
        buffer: int32 ``[2 L + 2 A + max_rows]`` on the device: ``[slot_starts | slot_counts | active_slots |
            active_ranks | sorted_rows]`` (``A = min(L, max_rows)``: a step uses at most that many adapters).
    """

    def __init__(self, mapping: LoRAMapping, max_rows: int, device: torch.device) -> None:
        self.mapping = mapping
        self.num_slots = mapping.num_slots
        self.max_rows = max_rows
        self.num_active = min(self.num_slots, max_rows)
        self.buffer = torch.zeros(2 * self.num_slots + 2 * self.num_active + max_rows, dtype=torch.int32,
                                  device=device)
        # two pinned host buffers used in turn (see CUDAGraphRunner's staging): the host fills one while the
        # copy from the other, of the step before, may still be pending
        pin = torch.device(device).type == "cuda"
        self._staging = [torch.zeros(self.buffer.numel(), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn = 0

    def size(self, rows: int) -> int:
        """Entries of :attr:`buffer` a step of ``rows`` rows uses (the groups of its rows and the slots)."""
        return 2 * self.num_slots + 2 * self.num_active + rows

    def meta(self, rows: int) -> LoRAKernelMeta:
        """The static meta of a graph of ``rows`` rows: views of :attr:`buffer` (its addresses are what the
        graph captures), ``static`` set (:class:`~infer.kernels.lora_reference.LoRAKernelMeta`); its
        ``active_slots`` (and ``active_ranks``) has ``min(L, rows)`` entries, the most adapters ``rows`` rows
        can use."""
        n, a, used = self.num_slots, self.num_active, min(self.num_slots, rows)
        return LoRAKernelMeta(rows, self.buffer[2 * n + 2 * a: 2 * n + 2 * a + rows], self.buffer[:n],
                              self.buffer[n: 2 * n], self.buffer[2 * n: 2 * n + used], segments=[],
                              num_lora_rows=rows, first_rows=[], static=True,
                              active_ranks=self.buffer[2 * n + a: 2 * n + a + used],
                              split_counters=self.mapping.split_counters)

    def stage(self, token_slots: list[int] | None = None) -> int:
        """Write a step's groups into :attr:`buffer` (the copy is queued on the current stream, before the
        replay that reads it).

        Args:
            token_slots: ``[T]`` each row's slot (-1: no adapter), the graph's first ``T`` rows; default:
                the mapping's (the step's, as the model runner set them).

        Returns:
            The entries written (:meth:`size` of ``T``), or 0 when no row has an adapter (nothing
            staged: the base variant replays).

        Raises:
            ValueError: more rows than :attr:`max_rows`, or a slot outside ``[-1, L)``.
        """
        if token_slots is None:
            if not self.mapping.has_lora:
                return 0
            token_slots = self.mapping.token_slots
        slots = np.asarray(token_slots, dtype=np.int64)
        t, n = len(slots), self.num_slots
        if t > self.max_rows:
            raise ValueError(f"a step of {t} rows does not fit the graphs' {self.max_rows} LoRA rows")
        # group_rows_by_slot's groups in fewer NumPy calls (this runs before every LoRA replay): a stable
        # sort puts the rows without adapter (-1) first, then each slot's rows in row order
        try:
            counts = np.bincount(slots + 1, minlength=n + 1)  # [no adapter, slot 0, ..., slot L - 1]
        except ValueError:  # a slot below -1
            counts = None
        if counts is None or len(counts) > n + 1:
            raise ValueError(f"token slots must be in [-1, {n}), got {slots.min()}..{slots.max()}")
        if counts[0] == t:
            return 0
        size = self.size(t)
        host = self._staging[self._turn]
        self._turn ^= 1
        h = host.numpy()
        h[n: 2 * n] = counts[1:]
        h[:n] = np.cumsum(counts[:-1]) - counts[0]  # slot l's rows start after slots 0 .. l - 1's
        a = self.num_active
        active = np.flatnonzero(counts[1:])
        h[2 * n: 2 * n + a] = -1
        h[2 * n + a: 2 * n + 2 * a] = 0
        h[2 * n: 2 * n + len(active)] = active
        h[2 * n + a: 2 * n + a + len(active)] = self.mapping.slot_ranks[active]
        h[2 * n + 2 * a: 2 * n + 2 * a + t - counts[0]] = np.argsort(slots, kind="stable")[counts[0]:]
        self.buffer[:size].copy_(host[:size], non_blocking=True)
        return size
