"""Expert parallelism: dispatch tokens to the ranks that hold their experts, combine them back
(phase 15, second half).

With ``expert_parallel_size = W`` rank ``r`` holds experts ``[r * E / W, (r + 1) * E / W)`` whole,
instead of a ``1 / W`` slice of every expert (tensor-parallel experts). Attention stays
tensor-parallel over the same ranks, so after it every rank holds the same ``[T, H]`` hidden
states. An MoE layer then runs::

    1. split    rank r takes tokens [r * ceil(T / W), ...) of the step        (no communication)
    2. route    top-k experts of each of its tokens: n * k (token, expert) pairs
    3. dispatch sort the pairs by expert (so by owner rank); all_to_all_single of the counts,
                then of the pairs' hidden rows and expert ids (variable split sizes)
    4. compute  the rank's experts on the rows it received (k = 1 each, weight 1)
    5. combine  all_to_all_single back (the reverse splits); each pair's output times its routing
                weight, summed per token (index_add)
    6. gather   all_gather of the token chunks: every rank has the layer's whole [T, H] output

Per layer and token that moves ``k`` hidden rows there and back (minus those whose expert is local)
plus one row in the gather, against one all-reduce of the row for tensor-parallel experts; in
exchange each expert's GEMMs stay whole (as wide as a single GPU's) and each rank reads only its
experts' weights. ``dist.all_to_all`` with unequal tensors fails on gloo, ``all_to_all_single`` with
split sizes works on gloo and NCCL alike; the split sizes must be host integers, so step 3 reads the
counts on the host (one synchronization per layer, so no CUDA graph).

``all2all_backend='fixed_capacity'`` (:func:`fixed_capacity_moe`) removes that synchronization the
way DeepEP's low-latency kernels and vLLM's all2all backends do: every rank sends every rank the
same number of rows, ``capacity``, whatever the routing, so the all-to-alls have equal splits
known from ``T`` alone::

    send buffer of rank r   [ to rank 0: cap rows | to rank 1: cap rows | ... ]   padded
    expert ids beside it    [ e, e, e, -1, -1, ... | e, -1, -1, ...      | ... ]   -1 = padding

The counts travel on the device as the padding marks (expert id -1, which no rank holds, so the
experts leave those rows at zero). The price is bytes: ``W * capacity`` rows per rank instead of
the routed pairs. The default capacity is the worst case, ``ceil(T / W) * min(k, E / W)`` (every
pair of the chunk going to one rank), so nothing is ever dropped; ``ep_capacity_factor`` (GShard's
capacity factor) lowers it to ``factor * ceil(T / W) * k / W``, and the pairs beyond it (in token
order, per destination) are dropped: their expert adds nothing to the token.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from infer.parallel.state import ParallelState, _all_gather_single


def _all_to_all(t: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], ps: ParallelState):
    out = t.new_empty((out_rows, *t.shape[1:]))
    ps.count("all_to_all", t)
    dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=ps.group)
    return out


def expert_parallel_moe(block, x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """An MoE layer's output with its experts partitioned over the ranks (see the module docstring).

    Args:
        block: the :class:`~infer.models.moe.SparseMoeBlock` (its router, and ``experts`` holding
            ``num_local_experts`` experts from ``expert_start``).
        x: ``[T, H]``, the same on every rank.
        ps: the ranks.

    Returns:
        ``[T, H]`` in ``x.dtype``, the same on every rank: ``sum_j w[t, j] * expert_{id[t, j]}(x[t])``.
    """
    if ps.all2all == "fixed_capacity":
        return fixed_capacity_moe(block, x, ps)
    # >>> EXERCISE moe_dispatch_combine
    w, rank = ps.world_size, ps.rank
    t, h = x.shape
    per = -(-t // w)
    lo, hi = min(rank * per, t), min((rank + 1) * per, t)
    xs = x[lo:hi]
    k = block.top_k
    if hi > lo:
        weights, ids = block.route(xs)  # [n, k] float32, int32 (global expert ids)
    else:  # fewer tokens than ranks: this rank has none, but joins every collective
        weights = torch.empty((0, k), dtype=torch.float32, device=x.device)
        ids = torch.empty((0, k), dtype=torch.int32, device=x.device)
    experts = block.experts
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)  # pairs by expert, so by the rank that holds it
    dest = flat[order] // experts.num_local_experts
    send = torch.bincount(dest, minlength=w)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ps.group)
    send_splits, recv_splits = send.tolist(), recv.tolist()
    token = order // k  # the local token of each sorted pair
    rows = sum(recv_splits)
    x_recv = _all_to_all(xs[token], rows, recv_splits, send_splits, ps)
    ids_recv = _all_to_all(flat[order].to(torch.int32), rows, recv_splits, send_splits, ps)
    if rows:
        y_recv = experts(x_recv, torch.ones((rows, 1), dtype=torch.float32, device=x.device), ids_recv[:, None])
    else:
        y_recv = x_recv
    y = _all_to_all(y_recv, len(order), send_splits, recv_splits, ps)
    out = torch.zeros((per, h), dtype=x.dtype, device=x.device)
    out.index_add_(0, token, (y * weights.flatten()[order, None].to(y.dtype)).to(x.dtype))
    gathered = torch.empty((w * per, h), dtype=x.dtype, device=x.device)
    ps.count("all_gather_tokens", out)
    _all_gather_single(gathered, out, group=ps.group)
    return gathered[:t]
    # <<< EXERCISE moe_dispatch_combine


def dispatch_capacity(tokens_per_rank: int, top_k: int, local_experts: int, world_size: int,
                      factor: float | None = None) -> int:
    """Rows each rank sends each rank in :func:`fixed_capacity_moe`: the worst case
    ``tokens_per_rank * min(top_k, local_experts)`` (a token's ``k`` experts are distinct, so at most
    ``min(k, E / W)`` of its pairs go to one rank), or with ``factor`` ``ceil(factor * n * k / W)``
    (the average load times the factor), at least 1 and at most the worst case."""
    worst = tokens_per_rank * min(top_k, local_experts)
    if factor is None:
        return worst
    return max(1, min(worst, math.ceil(factor * tokens_per_rank * top_k / world_size)))


def slot_of_pairs(dest: torch.Tensor, world_size: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each (token, expert) pair goes in the send buffer, on the device.

    Args:
        dest: int64 ``[P]``, the rank holding each pair's expert, pairs in token order.

    Returns:
        ``(slot, keep)``: int64 ``[P]``, ``dest * capacity + (the pair's position among the pairs
        for the same rank)``, or ``world_size * capacity`` (a scratch row) for a pair beyond the
        capacity; bool ``[P]``, whether the pair fits. No host synchronization.
    """
    onehot = (dest[:, None] == torch.arange(world_size, device=dest.device)).long()  # [P, W]
    pos = (onehot.cumsum(0) - 1).gather(1, dest[:, None]).squeeze(1)  # earlier pairs of the same rank
    keep = pos < capacity
    return torch.where(keep, dest * capacity + pos, world_size * capacity), keep


def fixed_capacity_moe(block, x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """:func:`expert_parallel_moe` with fixed-capacity dispatch (see the module docstring): the same
    result when nothing is dropped, with no host synchronization (capturable in a CUDA graph).

    Args and returns as :func:`expert_parallel_moe`; ``ps.capacity_factor`` sizes the buffers
    (:func:`dispatch_capacity`).
    """
    w, rank = ps.world_size, ps.rank
    t, h = x.shape
    per = -(-t // w)
    lo, hi = min(rank * per, t), min((rank + 1) * per, t)
    k, experts = block.top_k, block.experts
    cap = dispatch_capacity(per, k, experts.num_local_experts, w, ps.capacity_factor)
    if hi > lo:
        weights, ids = block.route(x[lo:hi])  # [n, k] float32, int32 (global expert ids)
    else:  # fewer tokens than ranks: this rank sends only padding, but joins every collective
        weights = torch.empty((0, k), dtype=torch.float32, device=x.device)
        ids = torch.empty((0, k), dtype=torch.int32, device=x.device)
    flat = ids.flatten().long()
    token = torch.arange(flat.numel(), device=x.device) // k  # the local token of each pair
    slot, keep = slot_of_pairs(flat // experts.num_local_experts, w, cap)
    rows = w * cap
    send_x = x.new_zeros((rows + 1, h))  # + the scratch row of the dropped pairs
    send_x.index_copy_(0, slot, x[lo:hi][token])
    send_ids = torch.full((rows + 1,), -1, dtype=torch.int32, device=x.device)
    send_ids.index_copy_(0, slot, flat.to(torch.int32))
    x_recv = _all_to_all(send_x[:rows], rows, None, None, ps)
    ids_recv = _all_to_all(send_ids[:rows], rows, None, None, ps)
    # padding rows carry expert id -1, held by no rank: the experts leave them at zero
    y_recv = experts(x_recv, torch.ones((rows, 1), dtype=torch.float32, device=x.device), ids_recv[:, None])
    y = _all_to_all(y_recv, rows, None, None, ps)
    scale = (weights.flatten() * keep).to(y.dtype)  # a dropped pair adds nothing
    out = torch.zeros((per, h), dtype=x.dtype, device=x.device)
    out.index_add_(0, token, (y[torch.where(keep, slot, 0)] * scale[:, None]).to(x.dtype))
    gathered = torch.empty((w * per, h), dtype=x.dtype, device=x.device)
    ps.count("all_gather_tokens", out)
    _all_gather_single(gathered, out, group=ps.group)
    return gathered[:t]
