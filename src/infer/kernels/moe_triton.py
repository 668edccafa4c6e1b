"""The fused MoE expert computation in Triton (phase 15): sort by expert, then a grouped GEMM.

Same ``fused_experts`` signature and values as the loop over experts of
:mod:`infer.kernels.moe_reference` (vLLM's ``fused_experts``, mini-sglang's
``kernel/triton/fused_moe.py``):

0. **Route** (:func:`select_experts`, one program per token): softmax, top-k, renormalization.
1. **Dispatch.** :func:`moe_align_block_size` (one program; the reference's device ops above
   ``ALIGN_ONE_PROGRAM_MAX_PAIRS`` pairs) sorts the ``T * k`` (token, expert) pairs by expert and pads
   each expert's run to a multiple of ``BLOCK_M``, into a buffer whose size depends only on ``T * k``
   (never on the routing).
2. **Grouped GEMM 1** (:func:`_grouped_gemm_kernel`): each program computes a ``BLOCK_M x BLOCK_N``
   tile of ``x[token] @ w13[e].T``: its ``BLOCK_M`` rows are pairs of one expert ``e`` (the block's
   entry of ``expert_ids``), gathered from ``x`` by token index, so one weight tile read from memory
   serves every token routed to that expert. Output: ``[T * k, 2I]`` in pair order (no un-permute
   copy: the store scatters back through the same indices).
3. ``act(gate) * up`` (:func:`infer.kernels.fused_triton.act_and_mul`) -> ``[T * k, I]``.
4. **Grouped GEMM 2**: ``h @ w2[e].T`` per pair, scaled by the pair's routing weight in float32
   before the one rounding -> ``[T * k, H]``.
5. **Combine**: ``sum`` over the ``k`` pairs of each token.

**CUDA graphs.** Nothing here reads the device from the host: the sort is device tensor ops with
shapes fixed by ``T`` (:func:`~infer.kernels.moe_reference.max_padded_tokens`), the GEMM grid covers
the whole padded buffer and programs past ``num_tokens_post_padded`` (a device scalar the kernel
loads) return at once, and the tile sizes depend only on ``T``. So a decode step is captured once
per batch-size bucket and replays correctly for any routing.

The block sizes (:func:`block_config`) follow vLLM's defaults for untuned shapes: 16-row blocks when
each expert receives few pairs (decode), larger tiles otherwise. No autotuning (it breaks the
interpreter and graph capture). On the CPU this runs only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import moe_reference
from infer.kernels.fused_triton import act_and_mul
from infer.kernels.moe_reference import check_experts, max_padded_tokens
from infer.kernels.triton_common import INTERPRET, first_argmax, round_to

ALIGN_ONE_PROGRAM_MAX_PAIRS = 1024  # larger steps sort with the reference's parallel device ops

__all__ = ["fused_experts", "select_experts", "moe_align_block_size", "block_config", "grouped_gemm"]


# ============================================================================ routing


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l,
                         E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                         RENORMALIZE: tl.constexpr):
    # One program per token: softmax over its E logits in float32, then K rounds of "take the largest,
    # mask it out" (the lowest expert id wins a tie, and a NaN beats any number: router logits that
    # overflowed still give K distinct experts in [0, E)), then the optional renormalization.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(offs < E, p, -1.0)
    slots = tl.arange(0, K_PAD)
    w = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(K):
        best, idx = first_argmax(p, offs, E_PAD)
        w = tl.where(slots == j, best, w)
        ids = tl.where(slots == j, idx, ids)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        w = w / tl.sum(w, 0)
    tl.store(weights_ptr + row * K + slots, w, mask=slots < K)
    tl.store(ids_ptr + row * K + slots, ids, mask=slots < K)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing in one launch (vLLM's ``topk_softmax``); the values of
    :func:`infer.kernels.moe_reference.select_experts` (float32 ``[T, k]`` weights, largest first, and
    int32 ids; a tie goes to the lower expert id).

    Raises:
        ValueError: ``top_k`` out of range or logits not 2-D.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    e_pad = triton.next_power_of_2(e)
    _topk_softmax_kernel[(t,)](logits, weights, ids, logits.stride(0), E=e, E_PAD=e_pad, K=top_k,
                               K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                               num_warps=1 if e_pad <= 256 else 4)
    return weights, ids


# ============================================================================ sort by expert


@triton.jit
def _moe_align_kernel(topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, n, size, num_blocks, expert_start,
                      E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr):
    # One program does it all (a decode step has k pairs per token: one chunk). Pass 1 counts the pairs of
    # each expert with one-hot rows [CHUNK, E]; the padded runs and their starts are a cumsum over E. Pass 2
    # gives every pair its slot: its expert's start + the pairs of that expert in earlier chunks + its
    # rank in this chunk (an inclusive cumsum of the one-hot rows down the chunk): token order is kept.
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, n, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        key = tl.load(topk_ids_ptr + offs, mask=offs < n, other=-1) - expert_start
        valid = (offs < n) & (key >= 0) & (key < E)
        onehot = ((key[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)
        counts += tl.sum(onehot, 0)
    padded = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    total = tl.sum(padded, 0)
    tl.store(num_post_ptr, total)
    for p0 in range(0, size, CHUNK):  # every slot starts as padding (the sentinel n)
        offs = p0 + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + n, mask=offs < size)
    for b0 in range(0, num_blocks, CHUNK):  # a block's expert: how many runs end at or before its start
        blocks = b0 + tl.arange(0, CHUNK)
        start = blocks * BLOCK_SIZE
        ended = (padded_end[None, :] <= start[:, None]) & (experts[None, :] < E)
        expert = tl.where(start < total, tl.sum(ended.to(tl.int32), 1), -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < num_blocks)
    tl.debug_barrier()  # the padding fill lands before the pairs overwrite their slots
    seen = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, n, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        key = tl.load(topk_ids_ptr + offs, mask=offs < n, other=-1) - expert_start
        valid = (offs < n) & (key >= 0) & (key < E)
        onehot = ((key[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)
        rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1
        base = tl.sum(onehot * (padded_start + seen)[None, :], 1)
        tl.store(sorted_ids_ptr + base + rank, offs, mask=valid)
        seen += tl.sum(onehot, 0)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_start: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`infer.kernels.moe_reference.moe_align_block_size` in one launch (the same three tensors,
    equal element for element): the reference's ~30 small device ops cost more than the GEMMs in a
    captured batch-1 decode step."""
    n = topk_ids.numel()
    size = max_padded_tokens(n, num_experts, block_size)
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=device)
    expert_ids = torch.empty(size // block_size, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(triton.next_power_of_2(max(n, 1)), 8192 // e_pad))
    _moe_align_kernel[(1,)](ids, sorted_ids, expert_ids, num_post, n, size, size // block_size, expert_start,
                            E=num_experts, E_PAD=e_pad, BLOCK_SIZE=block_size, CHUNK=chunk, num_warps=8)
    return sorted_ids, expert_ids, num_post


# ============================================================================ grouped GEMM


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    N, K, EM, num_valid,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE_FP32: tl.constexpr, UPCAST: tl.constexpr, MANUAL_BF16: tl.constexpr,
):
    # Program -> (row block, column block), GROUP_M row blocks at a time so that the weight
    # tiles they share stay in L2 (Triton's grouped ordering).
    pid = tl.program_id(0)
    num_m = tl.cdiv(EM, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return  # past the last expert's padded run
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)  # (token, expert) pair of each row; num_valid = padding
    row_ok = pair < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)  # one expert per row block
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (pair // ROWS_PER_A).to(tl.int64)  # GEMM 1 reads token pair // k of x; GEMM 2 row pair
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter: float32 math (it does bf16 arithmetic on raw integers)
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
        elif IEEE_FP32:  # float32 weights: no TF32 rounding of the inputs
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c = round_to(acc, c_ptr.dtype.element_ty, MANUAL_BF16)
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, c, mask=row_ok[:, None] & col_ok[None, :])


def block_config(num_tokens: int, top_k: int, num_experts: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes for ``num_tokens`` tokens: ``BLOCK_M`` from the mean pairs per expert (16 for
    decode, where most experts get one or two rows), ``BLOCK_N`` / ``BLOCK_K`` / warps / stages as
    vLLM's untuned defaults. Depends only on shapes, so a captured graph keeps it."""
    if INTERPRET:  # tiny shapes, few programs: the interpreter runs each one in Python
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    per_expert = num_tokens * top_k / max(1, num_experts)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                 expert_ids: torch.Tensor, num_post: torch.Tensor, rows_per_a: int,
                 topk_weights: torch.Tensor | None, config: dict[str, int]) -> torch.Tensor:
    """``out[p] = a[p // rows_per_a] @ w[e(p)].T`` (times ``topk_weights.flatten()[p]`` if given) for
    every pair ``p`` listed in ``sorted_ids``; rows of ``out`` for pairs not listed are not written.

    Args:
        a: ``[rows, K]``; w: ``[E_local, N, K]``; out: ``[num_pairs, N]``.
        sorted_ids, expert_ids, num_post: from :func:`moe_align_block_size` with ``BLOCK_M``.
        rows_per_a: ``k`` when ``a`` holds one row per token, 1 when one row per pair.
    """
    em = sorted_ids.numel()
    n, k = w.shape[1], w.shape[2]
    grid = (triton.cdiv(em, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    weights = topk_weights if topk_weights is not None else out  # unused pointer when not MUL_WEIGHT
    _grouped_gemm_kernel[grid](
        a, w, out, weights, sorted_ids, expert_ids, num_post,
        n, k, em, out.shape[0],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        ROWS_PER_A=rows_per_a, MUL_WEIGHT=topk_weights is not None,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"],
        IEEE_FP32=a.dtype == torch.float32, UPCAST=INTERPRET, MANUAL_BF16=INTERPRET and out.dtype == torch.bfloat16,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return out


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
    activation: str = "silu",
    num_experts: int | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Expert compute + combine over the experts held here, as a grouped GEMM (see the module
    docstring); the values of :func:`infer.kernels.moe_reference.fused_experts`.

    Args:
        x: ``[T, H]`` float32/float16/bfloat16 (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        w13: ``[E_local, 2 * I, H]``; w2: ``[E_local, H, I]``; ``x``'s dtype.
        topk_weights: float ``[T, k]``; topk_ids: int ``[T, k]`` global expert ids.
        expert_start: global id of ``w13[0]``'s expert.
        activation: ``"silu"`` or ``"gelu_tanh"``.
        num_experts: the layer's expert count ``E``, when known: if every expert is held here
            (``E_local == E``, no expert parallelism) every pair is computed and the output buffer
            needs no zero fill.
        config: tile sizes (default :func:`block_config`), for benchmarks.

    Returns:
        ``[T, H]`` in ``x.dtype``.

    Raises:
        ValueError: from :func:`~infer.kernels.moe_reference.check_experts`.
    """
    check_experts(x, w13, w2, topk_weights, topk_ids)
    t, h = x.shape
    e_local, two_i = w13.shape[0], w13.shape[1]
    top_k = topk_ids.shape[1]
    pairs = t * top_k
    if t == 0:
        return torch.zeros_like(x)
    cfg = config or block_config(t, top_k, e_local, two_i, h)
    # the one-program sort is serial over chunks of pairs: for large steps (prefill) the reference's
    # device ops, each parallel over all pairs, are faster; both are graph-safe
    align = moe_align_block_size if pairs <= ALIGN_ONE_PROGRAM_MAX_PAIRS else moe_reference.moe_align_block_size
    sorted_ids, expert_ids, num_post = align(topk_ids, cfg["BLOCK_M"], e_local, expert_start)
    assert sorted_ids.numel() == max_padded_tokens(pairs, e_local, cfg["BLOCK_M"])
    x = x.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    # Pairs of experts held elsewhere are never written: with expert parallelism the buffers start
    # zeroed, so those rows read as 0 in the combine (and the activation never sees garbage).
    every_expert_here = num_experts is not None and expert_start == 0 and e_local == num_experts
    alloc = torch.empty if every_expert_here else torch.zeros
    gate_up = alloc((pairs, two_i), dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gate_up, sorted_ids, expert_ids, num_post, top_k, None, cfg)
    inter = act_and_mul(gate_up, activation)
    down = alloc((pairs, h), dtype=x.dtype, device=x.device)
    grouped_gemm(inter, w2, down, sorted_ids, expert_ids, num_post, 1, weights, cfg)
    return down.view(t, top_k, h).sum(dim=1)
