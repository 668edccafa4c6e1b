"""The sparse mixture-of-experts block (phase 15): a router and ``E`` expert MLPs held as stacked
tensors.

::

    topk_weights, topk_ids = route(x)              # select_experts: softmax, top-k, renormalize
    out = experts(x, topk_weights, topk_ids)       # dispatch (sort by expert) -> grouped expert
                                                   # compute -> combine (weighted sum over k)

:class:`SparseMoeBlock` keeps these two calls apart so that expert parallelism can hold a subset of
the experts (``MoEExperts.expert_start`` .. ``+ num_local_experts``) and replace what happens
between them. The expert compute is a function of the ``ops`` module chosen by
:meth:`MoEExperts.set_impl`: :mod:`infer.kernels.moe_reference` (a loop over experts, Hugging
Face's) or :mod:`infer.kernels.moe_triton` (sort by expert + grouped GEMM, vLLM's ``fused_moe``);
both take and return the same tensors.

Parameter names are Hugging Face transformers 5's in-memory ones (``mlp.gate.weight``,
``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``); checkpoints that store one tensor per
expert (``mlp.experts.{e}.gate_proj.weight``, every released Qwen3-MoE) are stacked while loading
(:meth:`MoEExperts.checkpoint_slice`).
"""

from __future__ import annotations

import re
from types import ModuleType

import torch
from torch import nn

from infer.config import ModelConfig
from infer.kernels import moe_reference
from infer.parallel.moe import expert_parallel_moe
from infer.parallel.state import get_parallel

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class MoEExperts(nn.Module):
    """The experts of one MoE layer as two stacked tensors.

    Attributes:
        gate_up_proj: ``[E_local, 2 * I, H]``: each expert's gate rows, then its up rows.
        down_proj: ``[E_local, H, I]``.
        num_experts: ``E``, experts of the whole layer (what the router scores).
        expert_start: global id of the first expert held here (0 without expert parallelism).
        num_local_experts: ``E_local``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 expert_start: int = 0, num_local_experts: int | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.expert_start = expert_start
        self.num_local_experts = num_experts if num_local_experts is None else num_local_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation
        e = self.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, intermediate_size))
        self.ops: ModuleType = moe_reference

    def set_impl(self, ops: ModuleType) -> None:
        """Choose the expert computation: :mod:`infer.kernels.moe_reference` or
        :mod:`infer.kernels.moe_triton` (same ``fused_experts`` signature)."""
        self.ops = ops

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Dispatch, expert compute and combine over the experts held here.

        Args:
            x: ``[T, H]``.
            topk_weights: float32 ``[T, k]``.
            topk_ids: int32 ``[T, k]`` global expert ids.

        Returns:
            ``[T, H]`` in ``x.dtype``: ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``
            over the pairs whose expert is held here.
        """
        return self.ops.fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                                      self.expert_start, self.activation, self.num_experts)

    def checkpoint_slice(self, local_name: str) -> tuple[str, tuple] | None:
        """Where a per-expert checkpoint tensor goes: ``experts.{e}.gate_proj.weight`` ->
        ``("gate_up_proj", (e - expert_start, slice(0, I)))`` etc., or None if that expert is
        not held here. ``local_name`` starts at ``{e}.``."""
        e_str, proj, _ = local_name.split(".", 2)
        e = int(e_str) - self.expert_start
        if not 0 <= e < self.num_local_experts:
            return None
        i = self.intermediate_size
        if proj == "gate_proj":
            return "gate_up_proj", (e, slice(0, i))
        if proj == "up_proj":
            return "gate_up_proj", (e, slice(i, 2 * i))
        return "down_proj", (e,)


class SparseMoeBlock(nn.Module):
    """Router + experts (Hugging Face's ``Qwen3MoeSparseMoeBlock``; no shared expert).

    ``gate`` is the router, a bias-free ``Linear(H, E)``; ``experts`` a :class:`MoEExperts`.
    """

    def __init__(self, cfg: ModelConfig, activation: str = "silu") -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        # phases 14-15: each rank holds E / ep whole experts (expert parallelism, infer.parallel.moe),
        # or a 1 / tp slice of every expert's intermediate columns (tensor parallelism)
        self.parallel = ps = get_parallel()
        e, inter = cfg.num_experts, cfg.moe_intermediate_size
        if ps.ep_size > 1:
            n = e // ps.ep_size
            self.experts = MoEExperts(e, cfg.hidden_size, inter, activation, ps.ep_rank * n, n)
            for p in (self.experts.gate_up_proj, self.experts.down_proj):
                p.tp_shard = (0, ps.ep_rank, ps.ep_size)  # a stacked checkpoint: its experts
        else:
            tp, r = ps.tp_size, ps.tp_rank
            self.experts = MoEExperts(e, cfg.hidden_size, inter // tp, activation)
            if tp > 1:  # stacked: gate rows and up rows each cut; per expert: the piece_shard of each
                self.experts.gate_up_proj.tp_shard = (1, r, tp, 2)
                self.experts.down_proj.tp_shard = (2, r, tp)
                self.experts.piece_shard = {"gate_proj": (0, r, tp), "up_proj": (0, r, tp), "down_proj": (1, r, tp)}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x[T, H]`` -> ``(topk_weights float32 [T, k], topk_ids int32 [T, k])``."""
        return self.experts.ops.select_experts(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[T, H]`` -> ``[T, H]``."""
        ps = self.parallel
        if ps.ep_size > 1:
            return expert_parallel_moe(self, x, ps)
        topk_weights, topk_ids = self.route(x)
        out = self.experts(x, topk_weights, topk_ids)
        return ps.all_reduce(out) if ps.tp_size > 1 else out  # tensor-parallel experts: partial sums

    # the fused forward of the decoder layer (phase 8) calls these on its MLP
    def merge_gate_up(self) -> None:
        """Nothing to merge: the experts' gate and up rows are stacked already."""

    def forward_fused(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.forward(x)


def per_expert_shard(model: nn.Module, name: str) -> tuple[int, ...] | None:
    """Tensor-parallel experts: the :func:`~infer.parallel.state.shard` spec of a per-expert
    checkpoint tensor (``...experts.{e}.gate_proj.weight``: this rank's rows), or None."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    return getattr(model.get_submodule(m["prefix"]), "piece_shard", {}).get(m["proj"])


def stacked_checkpoint_slice(model: nn.Module, name: str) -> tuple[str, tuple] | None:
    """For a per-expert checkpoint tensor name (``...mlp.experts.{e}.{gate,up,down}_proj.weight``),
    the stacked parameter of ``model`` it fills and the index into it; None for any other name,
    and ``("", ())`` for an expert this rank does not hold (skip the tensor)."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    experts = model.get_submodule(m["prefix"])
    if not isinstance(experts, MoEExperts):
        return None
    where = experts.checkpoint_slice(f"{m['e']}.{m['proj']}.weight")
    if where is None:
        return "", ()
    return f"{m['prefix']}.{where[0]}", where[1]
