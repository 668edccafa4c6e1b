"""The piecewise capture of mixed-step CUDA graphs (phase 9; vLLM's piecewise CUDA graphs): while a
mixed-step bucket is captured, :class:`Pieces` stands in for the attention backend and ends the graph being
captured at each attention call, and each :class:`Hole` records where one attention call's inputs and
output live between two pieces. :class:`~infer.engine.cuda_graphs.CUDAGraphRunner` replays the pieces and
runs the attention eagerly in the holes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Hole", "Pieces"]


@dataclass
class Hole:
    """One attention call between two captured pieces: where the earlier piece leaves its inputs
    and the later one reads its output (``[T_bucket, heads, head_dim]`` tensors in the pool)."""

    layer_idx: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    scale: float
    window: int | None
    kv_written: bool


class Pieces:
    """The attention backend while a mixed-step bucket is captured: each call ends the graph being
    captured and begins the next one (before :meth:`begin`, it returns zeros: the warm-up run).

    ``cache_write_in_rope`` is the real backend's, so the layers write K/V the same way (inside the
    pieces, with the RoPE kernel, when the Triton backend lets them).
    """

    def __init__(self, backend, pool) -> None:
        self.cache_write_in_rope = getattr(backend, "cache_write_in_rope", False)
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.holes: list[Hole] = []

    def _next(self) -> None:
        graph = torch.cuda.CUDAGraph()
        # thread_local: see CUDAGraphRunner.capture
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs.append(graph)

    def begin(self) -> None:
        self._next()

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def forward(self, layer_idx, q, k, v, meta, scale, window=None, kv_written=False) -> torch.Tensor:
        if not self.graphs:  # the warm-up run
            return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # in the pool: the next piece reads it
        self.graphs[-1].capture_end()
        self.holes.append(Hole(layer_idx, q, k, v, out, scale, window, kv_written))
        self._next()
        return out
