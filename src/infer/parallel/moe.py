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
counts on the host (one synchronization per layer; DeepEP and vLLM's all2all backends avoid it with
fixed-capacity buffers).
"""

from __future__ import annotations

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
