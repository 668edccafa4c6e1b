"""Who this process is in a tensor/expert-parallel engine, and the collectives the layers call.

One process per rank (phase 14). The model is built *after* :func:`set_parallel` has recorded
this process's rank, so every layer creates only its shard's parameters (Megatron-LM's
``parallel_state``, vLLM's ``vllm.distributed.parallel_state``). With one rank (the default)
nothing here does anything: :func:`tp_size` is 1, the collectives are never called, the layers
are plain ``nn.Linear``/``nn.Embedding`` shapes and the single-process engine is unchanged.

Two process groups: ``group`` is the one the model's collectives use (NCCL on CUDA, gloo on the
CPU); ``cpu_group`` (gloo, the same group on the CPU) carries the host-side step messages rank 0
broadcasts (:mod:`infer.engine.executor`), so the host never waits for the device to send them.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    """This process's place among the ranks.

    Attributes:
        rank: 0 .. ``world_size - 1``; rank 0 hosts the scheduler and samples.
        world_size: number of ranks (``tensor_parallel_size`` or ``expert_parallel_size``).
        tp: attention, dense MLPs and the vocabulary are split across the ranks (Megatron-style);
            True whenever ``world_size`` > 1 (with expert parallelism too).
        ep: MoE experts are partitioned across the ranks (``expert_parallel_size`` > 1) instead of
            each expert being split tensor-parallel.
        group, cpu_group: the torch.distributed groups (None until initialized).
    """

    rank: int = 0
    world_size: int = 1
    tp: bool = False
    ep: bool = False
    group: object | None = None
    cpu_group: object | None = None
    # all_reduce_backend='symm_mem' on CUDA: a SymmMemAllReduce tried before the group's all-reduce
    symm_mem: object | None = None
    # expert parallelism's dispatch: "dynamic" or "fixed_capacity" (EngineConfig.all2all_backend), and
    # the capacity factor of the fixed-capacity one (None: the worst case, nothing dropped)
    all2all: str = "dynamic"
    capacity_factor: float | None = None
    # bytes this rank put into each kind of collective, and the calls (the phase 14 page's
    # "communication per token, measured"): {"all_reduce": [calls, bytes], ...}
    traffic: dict = field(default_factory=dict)

    def count(self, kind: str, t: torch.Tensor) -> None:
        c = self.traffic.setdefault(kind, [0, 0])
        c[0] += 1
        c[1] += t.numel() * t.element_size()

    @property
    def tp_size(self) -> int:
        return self.world_size if self.tp else 1

    @property
    def tp_rank(self) -> int:
        return self.rank if self.tp else 0

    @property
    def ep_size(self) -> int:
        return self.world_size if self.ep else 1

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep else 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks (row-parallel outputs, vocab-parallel embeddings) and return the
        sum: ``x`` itself, summed in place by the group's all-reduce, or with ``symm_mem`` set and a
        message it takes (:mod:`infer.parallel.allreduce`) a new tensor. Every rank must call it
        with the same shape and dtype, in the same order."""
        self.count("all_reduce", x)
        if self.symm_mem is not None:
            out = self.symm_mem(x)
            if out is not None:
                return out
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, V / W]`` on each of the ``W`` ranks -> ``[N, V]`` on every rank, rank 0's columns
        first (the vocabulary-parallel LM head's logits)."""
        w = self.world_size
        n, v = x.shape
        out = torch.empty((w * n, v), dtype=x.dtype, device=x.device)
        self.count("all_gather", x)
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out.view(w, n, v).transpose(0, 1).reshape(n, w * v)


_STATE = ParallelState()
# torch 2.13 renamed all_gather_into_tensor (the older name warns there); the GPU image has 2.11
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_BUILDING = threading.local()  # building_for's state, per thread


def set_parallel(state: ParallelState) -> None:
    """Make ``state`` the one layers read while they are built (a worker process sets it once)."""
    global _STATE
    _STATE = state


def get_parallel() -> ParallelState:
    """The state layers built now take (each layer keeps the one it was built with): this thread's
    :func:`building_for` state, else the process's."""
    return getattr(_BUILDING, "state", None) or _STATE


@contextlib.contextmanager
def building_for(state: ParallelState):
    """Build a model for ``state``'s rank inside this block, on this thread only (rank 0 in the
    engine's own process, which may also hold single-process models; tests play several ranks on
    threads)."""
    saved = getattr(_BUILDING, "state", None)
    _BUILDING.state = state
    try:
        yield
    finally:
        _BUILDING.state = saved


def tp_size() -> int:
    """Ranks the attention heads, MLP columns and vocabulary of a model built now are split over."""
    return get_parallel().tp_size


def tp_rank() -> int:
    return get_parallel().tp_rank


def shard(t: torch.Tensor, spec: tuple[int, ...] | None) -> torch.Tensor:
    """The part of a full checkpoint tensor a rank keeps.

    Args:
        t: the full tensor, e.g. ``q_proj.weight [num_heads * head_dim, hidden]``.
        spec: ``(dim, index, parts)``: cut ``t`` into ``parts`` equal pieces along ``dim`` and keep
            piece ``index``; ``(dim, index, parts, groups)``: ``dim`` is ``groups`` blocks back to
            back (an MoE expert's gate rows then its up rows), each cut so; None keeps all of it
            (a replicated tensor).

    Returns:
        ``t``'s piece: a view for one group (the loader copies it to the device; of a memory-mapped
        checkpoint only the pages of this piece are read), a new tensor for several.
    """
    if spec is None:
        return t
    dim, index, parts, groups = (*spec, 1) if len(spec) == 3 else spec
    block = t.shape[dim] // groups
    n = block // parts
    pieces = [t.narrow(dim, g * block + index * n, n) for g in range(groups)]
    return pieces[0] if groups == 1 else torch.cat(pieces, dim)


def mark_shard(module: torch.nn.Module, dim: int, index: int, parts: int) -> None:
    """Tag ``module.weight`` with the :func:`shard` spec the loader applies to the checkpoint tensor
    (``parts == 1`` tags nothing: the tensor is whole). A column split (``dim`` 0) splits the bias
    with the rows; a row split (``dim`` 1) leaves the bias whole (it is added once, after the sum)."""
    if parts == 1:
        return
    module.weight.tp_shard = (dim, index, parts)
    if dim == 0 and getattr(module, "bias", None) is not None:
        module.bias.tp_shard = (0, index, parts)
