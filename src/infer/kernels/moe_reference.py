"""Mixture-of-experts operations in plain PyTorch (phase 15): routing, the token sort by expert,
and the expert computation as a loop over experts (the reference the Triton kernel is tested against).

A sparse MoE block (Shazeer et al., arXiv:1701.06538; GShard, arXiv:2006.16668; Qwen3-MoE,
arXiv:2505.09388) replaces the dense MLP with ``E`` expert MLPs and a router. It runs in four
steps, each a function with a clean boundary (so expert parallelism can swap the middle two for
an all-to-all exchange between ranks):

1. **route** (:func:`select_experts`): router logits ``[T, E]`` -> ``topk_weights[T, k]``
   (float32) and ``topk_ids[T, k]`` (int32): softmax over the experts, keep the ``k`` largest,
   optionally renormalize them to sum to 1 (``norm_topk_prob``).
2. **dispatch** (:func:`moe_align_block_size`): sort the ``T * k`` (token, expert) pairs by
   expert and pad each expert's run to a multiple of the GEMM's row block, so that every row
   block of the grouped GEMM belongs to one expert.
3. **expert compute** over the experts this rank holds (``expert_start`` ..
   ``expert_start + E_local - 1``; pairs routed elsewhere contribute nothing):
   ``down_e(act(gate_e(x)) * up_e(x))`` for each pair, times its routing weight.
4. **combine**: sum each token's ``k`` weighted expert outputs.

:func:`fused_experts` here is steps 3-4 as Hugging Face's ``Qwen3MoeExperts`` loop does them: for
each expert, gather its tokens, run its MLP, scale and ``index_add_`` into the output. It syncs
with the host (``torch.where``) and its shapes depend on the routing, so it cannot be captured in
a CUDA graph; :mod:`infer.kernels.moe_triton` has the same signature and can.

Weights are stacked per expert (Hugging Face transformers 5's in-memory layout, vLLM's ``w13`` /
``w2``): ``w13[E_local, 2 * I, H]`` (gate rows, then up rows) and ``w2[E_local, H, I]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.kernels.activations import ACTIVATIONS

__all__ = ["select_experts", "moe_align_block_size", "fused_experts", "check_experts"]



def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing (Shazeer et al., arXiv:1701.06538; Qwen3-MoE, Mixtral).

    ``p = softmax(router_logits)`` in float32 over the experts; keep the ``top_k`` largest; with
    ``renormalize`` (Hugging Face's ``norm_topk_prob``) divide them by their sum, so each token's
    weights sum to 1. (Renormalized top-k of the softmax equals the softmax of the top-k logits,
    Mixtral's order; without renormalization they differ.)

    Args:
        router_logits: ``[T, E]``, any float dtype.
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the kept probabilities by their sum.

    Returns:
        ``(topk_weights, topk_ids)``: float32 ``[T, top_k]`` and int32 ``[T, top_k]``, the largest
        probability first.

    Raises:
        ValueError: ``top_k`` out of range or logits not 2-D.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {router_logits.shape[1]}], got {top_k}")
    # >>> EXERCISE moe_topk_routing
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    # <<< EXERCISE moe_topk_routing
    return topk_weights, topk_ids.to(torch.int32)


def max_padded_tokens(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Length of the sorted-pair buffer :func:`moe_align_block_size` returns: a bound that depends
    only on shapes (never on the routing), a multiple of ``block_size``.

    Each expert's run is padded by at most ``block_size - 1`` and at most ``min(E, num_pairs)``
    experts receive a pair, so ``num_pairs + min(E, num_pairs) * (block_size - 1)`` always fits
    (vLLM's ``max_num_tokens_padded``, tightened for small batches).
    """
    n = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    return max(block_size, -(-n // block_size) * block_size)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_start: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, expert) pairs by expert and pad each expert's run to ``block_size``
    (vLLM's ``moe_align_block_size``; the "permute" of a grouped-GEMM MoE).

    Pair ``j`` is ``topk_ids.flatten()[j]``: token ``j // k``'s ``(j % k)``-th expert. Within an
    expert the pairs keep their order. Pairs whose expert is not one of this rank's
    ``expert_start .. expert_start + num_experts - 1`` are left out (expert parallelism).

    Everything is computed on the device with shapes fixed by ``topk_ids.shape``: no host
    synchronization, so it can be captured in a CUDA graph.

    Args:
        topk_ids: int ``[T, k]`` global expert ids.
        block_size: rows per block of the grouped GEMM (``BLOCK_M``).
        num_experts: experts held here (``E_local``).
        expert_start: global id of the first of them.

    Returns:
        ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``:

        * int32 ``[P]`` with ``P = max_padded_tokens(T * k, E_local, block_size)``: pair indices
          grouped by expert, each group padded with the sentinel ``T * k`` to a multiple of
          ``block_size``; the tail after the last group is sentinel too;
        * int32 ``[P // block_size]``: the (local) expert of each block, ``-1`` past the end;
        * int32 ``[1]``: the used length (sum of the padded group sizes).
    """
    device = topk_ids.device
    n = topk_ids.numel()
    size = max_padded_tokens(n, num_experts, block_size)
    local = topk_ids.flatten().to(torch.int64) - expert_start
    # pairs for experts held elsewhere get the key num_experts: they sort last and are dropped
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    # >>> EXERCISE moe_align_block_size
    padded = (counts + block_size - 1) // block_size * block_size
    padded[num_experts:].zero_()  # the dropped pairs take no room (a fill: capturable in a CUDA graph)
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts  # where each expert's pairs begin in the sorted order
    order = torch.sort(key, stable=True).indices  # pair indices grouped by expert, in order
    sorted_key = key[order]
    rank = torch.arange(n, device=device) - start[sorted_key]  # position within its expert
    dest = torch.where(sorted_key < num_experts, padded_start[sorted_key] + rank, size)
    block_start = torch.arange(0, size, block_size, device=device)
    expert_ids = torch.searchsorted(padded_end[:num_experts], block_start, right=True)
    # <<< EXERCISE moe_align_block_size
    sorted_ids = torch.full((size + 1,), n, dtype=torch.int32, device=device)  # + 1: the drop slot
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    num_post = padded_end[num_experts - 1:num_experts].to(torch.int32)
    expert_ids = torch.where(block_start < num_post.to(torch.int64), expert_ids, -1).to(torch.int32)
    return sorted_ids[:size], expert_ids, num_post


def check_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> None:
    """Shape/dtype checks shared by both :func:`fused_experts`.

    Raises:
        ValueError: naming the argument that does not fit.
    """
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={x.shape[0]}, k]")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"weights ({w13.dtype}, {w2.dtype}) must have x's dtype {x.dtype}")


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
    activation: str = "silu",
    num_experts: int | None = None,
) -> torch.Tensor:
    """Expert compute + combine, as a loop over experts (Hugging Face's ``Qwen3MoeExperts``).

    ``out[t] = sum_j w[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t]))`` with ``e = topk_ids[t, j]``,
    over the pairs whose expert is held here (``expert_start <= e < expert_start + E_local``).

    Args:
        x: ``[T, H]`` hidden states (float32/float16/bfloat16).
        w13: ``[E_local, 2 * I, H]`` gate rows then up rows of each expert, ``x``'s dtype.
        w2: ``[E_local, H, I]`` down projection of each expert.
        topk_weights: float ``[T, k]`` routing weights.
        topk_ids: int ``[T, k]`` global expert ids.
        expert_start: global id of ``w13[0]``'s expert.
        activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"``.
        num_experts: the layer's expert count (unused here; the Triton version skips a zero fill
            when every expert is held).

    Returns:
        ``[T, H]`` in ``x.dtype`` (zeros for a token none of whose experts is held here).

    Raises:
        ValueError: from :func:`check_experts`.
    """
    check_experts(x, w13, w2, topk_weights, topk_ids)
    act = ACTIVATIONS[activation]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e + expert_start)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, w2[e])
        out.index_add_(0, token, (y * topk_weights[token, slot, None].to(y.dtype)).to(x.dtype))
    return out
