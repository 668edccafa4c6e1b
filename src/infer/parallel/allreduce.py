"""A small-message all-reduce over PyTorch symmetric memory, for tensor-parallel decode (issue 55).

A batch-1 decode step of a tensor-parallel model ends each attention and each MLP with an
all-reduce of one ``[1, H]`` row: 8 KB in bf16 for ``H = 4096``. At that size NCCL's ring is bound by
latency, not bandwidth (about 20-60 us on two H100s or H200s, whatever the size below a few MB:
the phase 14 page's table). *Symmetric memory* removes most of it: every rank allocates a buffer
of the same size, and ``rendezvous`` maps each peer's buffer into every rank's address space
(CUDA IPC over NVLink), so one kernel can read the peers' data with plain loads::

    one-shot  (small messages)            two-shot  (medium messages: each rank moves 2/W of it)
    copy x into my buffer                 copy x into my buffer
    barrier (signal pads)                 barrier
    out = sum of every rank's buffer      reduce my 1/W slice from every buffer (reduce-scatter)
    barrier                               write it to every rank's out  (all-gather), barrier

One-shot reads ``W`` whole messages per rank but needs one barrier round: best for the smallest
messages. Two-shot reads and writes ``2 (W - 1) / W`` of the message per rank, like a ring, in two
hops instead of ``2 (W - 1)``. Above some megabytes NCCL's pipelined ring uses NVLink better, so
larger messages go to it. The thresholds are :class:`~infer.config.EngineConfig` fields
(``symm_mem_one_shot_max_bytes``, ``symm_mem_max_bytes``): the crossovers depend on the GPUs and
their links, and ``benchmarks/allreduce.py`` measures them.

The buffer is allocated and exchanged once, before any CUDA graph is captured; the kernels then
only read device pointers and signal pads, so a graph captures them like any other kernel. The
kernels are PyTorch's (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``,
``two_shot_all_reduce_out``); vLLM's ``SymmMemCommunicator`` (vllm/distributed/device_communicators/
symm_mem.py) and its custom all-reduce (CUDA IPC buffers, ``csrc/custom_all_reduce.cu``) are the
same idea. NVLink multicast (``multimem`` instructions) is not used: the ranks exchange only
peer-to-peer loads and stores, so ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set by default.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("infer")

ONE_SHOT, TWO_SHOT, NCCL = "one_shot", "two_shot", "nccl"
# the dtypes PyTorch's symmetric-memory all-reduce kernels are built for
SYMM_MEM_DTYPES = (torch.float32, torch.bfloat16)
ALIGN = 16  # bytes: the kernels load 16-byte vectors; other sizes go to NCCL


def choose_algorithm(nbytes: int, dtype: torch.dtype, one_shot_max_bytes: int, max_bytes: int) -> str:
    """Which all-reduce a message of ``nbytes`` bytes of ``dtype`` takes.

    Returns:
        ``"one_shot"`` up to ``one_shot_max_bytes``, ``"two_shot"`` up to ``max_bytes`` (the
        symmetric buffer's size), ``"nccl"`` above it, and ``"nccl"`` for a dtype the kernels do
        not support or a size that is not a multiple of 16 bytes.
    """
    # >>> EXERCISE all_reduce_choice
    if dtype not in SYMM_MEM_DTYPES or nbytes % ALIGN or nbytes == 0 or nbytes > max_bytes:
        return NCCL
    return ONE_SHOT if nbytes <= one_shot_max_bytes else TWO_SHOT
    # <<< EXERCISE all_reduce_choice


class SymmMemAllReduce:
    """One rank's symmetric buffer and the all-reduce that uses it (CUDA only).

    Args:
        group: the ranks' NCCL process group (its store carries the rendezvous).
        device: this rank's GPU.
        max_bytes: the buffer's size; larger messages are left to NCCL.
        one_shot_max_bytes: the one-shot / two-shot crossover.

    Every rank must construct it at the same time with the same sizes (``rendezvous`` is a
    collective). Raises RuntimeError from PyTorch when the GPUs cannot map each other's memory.
    """

    def __init__(self, group, device: torch.device, max_bytes: int, one_shot_max_bytes: int) -> None:
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # peer-to-peer only, see above
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes - max_bytes % ALIGN
        self.one_shot_max_bytes = one_shot_max_bytes
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(max(self.max_bytes, ALIGN), dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)  # maps every peer's buffer here
        self.calls = {ONE_SHOT: 0, TWO_SHOT: 0, NCCL: 0}  # per algorithm, counted on the host

    def algorithm(self, x: torch.Tensor) -> str:
        return choose_algorithm(x.numel() * x.element_size(), x.dtype, self.one_shot_max_bytes, self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of ``x`` over the ranks as a new tensor (``x``'s shape and dtype), or None when
        the message should go to NCCL (:func:`choose_algorithm`). ``x`` is not modified."""
        algo = self.algorithm(x)
        self.calls[algo] += 1
        if algo == NCCL:
            return None
        flat = x.reshape(-1)
        buf = self.buffer.view(x.dtype)[: flat.numel()]
        out = torch.empty_like(flat)
        if algo == ONE_SHOT:  # one kernel: copy in, barrier, sum the peers' buffers, barrier
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, flat, "sum", self.group_name, out)
        else:
            buf.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", self.group_name, out)
        return out.view(x.shape)


def make_all_reduce(backend: str, group, device: torch.device, max_bytes: int, one_shot_max_bytes: int,
                    rank: int) -> SymmMemAllReduce | None:
    """The all-reduce that :meth:`~infer.parallel.state.ParallelState.all_reduce` tries before the
    group's own, for ``all_reduce_backend = backend``: a :class:`SymmMemAllReduce` on CUDA, None for
    ``"nccl"`` and on the CPU (gloo has no symmetric memory; rank 0 says so in the log)."""
    if backend != "symm_mem":
        return None
    if device.type != "cuda":
        if rank == 0:
            log.warning("all_reduce_backend='symm_mem' needs CUDA GPUs; on %s the ranks use gloo's all-reduce",
                        device.type)
        return None
    return SymmMemAllReduce(group, device, max_bytes, one_shot_max_bytes)
