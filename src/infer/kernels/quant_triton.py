"""Weight-only quantized projections in Triton: ``y = x @ dequantize(W)^T + b``, the weight read in its
stored 8 or 4 bits and dequantized in registers, never materialized in 16 bits.

Decode is bound by the bytes it reads: at batch 1 each weight byte is used for one multiply-add, so a
product over int8 or fp8 weights can take half the time of bf16 and over int4 a quarter (plus the
scales). That holds only if the kernel reads the small weights: dequantizing the whole weight to bf16
first (and reading that) saves memory but no time. Here each program loads a tile of quantized values
and the scale(s) that cover it, turns them into float32 in registers, and multiplies:

* with one row (batch-1 decode) :func:`_quantized_gemv1_kernel`: the weight read as int32 words and each
  int8 or int4 code taken out with one AND, left where it lies in the word: read as a float32 those bits are
  the subnormal ``u * 2^(p - 149)`` (``u`` the unsigned code, ``p`` its bit position), so one FMA with ``x``
  scaled by ``2^(100 - p)`` in advance (once per input, shared by the program's rows) adds ``u * x * 2^-49``, and
  the ``2^49`` and the codes' offset are settled once per step. No
  int->float conversion (a quarter of the FMA rate: it bounded the kernel at 1.4-1.7 TB/s on an H200) and no
  shift per code (the integer units run at half the float rate on Hopper: a shift, two masks and an FMA a
  code bounded int4 at 0.6-1.2 TB/s). FP32 subnormals are exact on the GPU (Triton emits no flush-to-zero)
  and in the interpreter. fp8 codes use the hardware conversion. It waits for the previous kernel with PDL
  (:mod:`infer.kernels.pdl`);
* with a few rows (decode; :func:`default_config` says how many): like
  :mod:`infer.kernels.skinny_gemm`, each program owns ``BLOCK_N`` outputs and streams their rows along
  ``K``, the next tile loaded in its stored 8 or 4 bits before the current one is used, the products
  summed per element in float32 and reduced once at the end (gpt-fast's and Marlin's int4/int8 GEMV idea,
  without their layouts tuned for tensor cores). A per-channel scale multiplies each output once, after
  the reduction; group scales (int4's 128 columns, FP8 blocks) multiply the codes in the loop;
* with more rows (prefill, large batches): on CUDA the weight dequantized once (:func:`dequantize_triton`)
  and one cuBLAS GEMM, since at these sizes the step is bound by arithmetic, not bytes; otherwise (the
  interpreter, an explicit ``config``, ``DEQUANT_THEN_CUBLAS = False``) a tiled GEMM whose inner product is
  ``tl.dot`` on the dequantized tile (cast to ``x``'s 16-bit dtype for the tensor cores, float32 in the
  interpreter): the lesson's form, 3-6x slower than cuBLAS on bf16 at 2,048 rows on an H200.

The scale layout is :mod:`infer.kernels.quant_reference`'s (one scale per ``(br, bc)`` block); in the GEMM a
``K`` tile never straddles two scale columns (``BLOCK_K`` divides ``bc``, or ``bc >= K``), so each program
loads one scale per output row per tile. On the CPU, without the interpreter, :func:`quantized_linear` runs the
plain-PyTorch reference (:func:`~infer.kernels.quant_reference.quantized_linear_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.pdl import launch_options, wait_for_previous
from infer.kernels.quant_reference import check_quantized, quantized_linear_reference
from infer.kernels.triton_common import INTERPRET, manual_bf16, round_to

GEMV_ROWS_LIMIT = 16  # the most rows the GEMV kernel can take (its float32 products held in registers)
_METHOD_CODE = {"int8": 0, "fp8": 1, "int4": 2}


@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, k, k0, n_mask, K, stride_qn, stride_sn, BR, BC,
                  METHOD: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns ``k`` (one tile, ``k0`` its first) of rows ``offs_n`` of the weight, dequantized: float32
    ``[BLOCK_N, BLOCK_K]``, 0 where masked. METHOD 0 int8, 1 fp8 e4m3, 2 int4 (8 per int32 along K); HAS_ZP:
    int4's zero points (one per scale, same strides) subtracted from the codes."""
    mask = n_mask[:, None] & (k < K)[None, :]
    if METHOD == 2:  # each word loaded once, unpacked in registers
        q = _unpack_words(_load_words(q_ptr, offs_n, k0, n_mask, K, stride_qn, BLOCK_K), BLOCK_N, BLOCK_K)
    else:
        q = _load_bytes(q_ptr, offs_n, k0, n_mask, K, stride_qn, BLOCK_K).to(tl.float32)
    # the tile lies in one scale column: one scale (and zero point) per row
    at = (offs_n // BR).to(tl.int64) * stride_sn + k0 // BC
    if HAS_ZP:
        q = q - tl.load(z_ptr + at, mask=n_mask, other=0).to(tl.float32)[:, None]
    q = tl.where(mask, q, 0.0)  # masked lanes zeroed after the conversion (a load's `other` cannot be fp8)
    return q * tl.load(s_ptr + at, mask=n_mask, other=0.0)[:, None]


@triton.jit
def _load_bytes(q_ptr, offs_n, k0, n_mask, K, stride_qn, BLOCK_K: tl.constexpr):
    """int8 / fp8 codes of columns ``k0 ... k0 + BLOCK_K`` of rows ``offs_n``, as stored: ``[BLOCK_N, BLOCK_K]``."""
    k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + k[None, :],
                   mask=n_mask[:, None] & (k < K)[None, :])


@triton.jit
def _load_words(q_ptr, offs_n, k0, n_mask, K, stride_qn, BLOCK_K: tl.constexpr):
    """int4's int32 words (8 codes each, along K) of columns ``k0 ... k0 + BLOCK_K`` of rows ``offs_n``:
    ``[BLOCK_N, BLOCK_K // 8]``, each word loaded once (:func:`_unpack_words` unpacks them)."""
    wk = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    return tl.load(q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + wk[None, :],
                   mask=n_mask[:, None] & (wk * 8 < K)[None, :], other=0)


@triton.jit
def _unpack_words(words, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`_load_words`'s ``[BLOCK_N, BLOCK_K // 8]`` words as float32 codes ``[BLOCK_N, BLOCK_K]``: column
    ``8 w + j`` is nibble ``j`` (low first) of word ``w``, minus 8. Masked words were loaded as 0 (codes -8):
    the caller zeroes those columns."""
    nib = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    return tl.reshape(nib, (BLOCK_N, BLOCK_K)).to(tl.float32) - 8.0


@triton.jit
def _quantized_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym, BR, BC,
    METHOD: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ROW_SCALE: tl.constexpr, MANUAL_BF16: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK_N),): program j computes outputs [j * BLOCK_N, (j + 1) * BLOCK_N) of all M (<= M_PAD)
    # rows, streaming those weight rows along K in BLOCK_K tiles, the next tile loaded (in its stored 8 or 4
    # bits) before the current one is used (skinny_gemm's register loop). The products are summed per element
    # in a [M_PAD, BLOCK_N, BLOCK_K] float32 tile and reduced over K once, at the end. ROW_SCALE: one scale per
    # output row (per-channel int8 / fp8), applied once after the reduction; otherwise each column's scale
    # (its group's: k // BC) multiplies the codes in the loop, after its zero point is subtracted (HAS_ZP).
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    s_rows = s_ptr + (offs_n // BR).to(tl.int64)[:, None] * stride_sn
    z_rows = z_ptr + (offs_n // BR).to(tl.int64)[:, None] * stride_sn
    if METHOD == 2:
        raw = _load_words(q_ptr, offs_n, 0, n_mask, K, stride_qn, BLOCK_K)
    else:
        raw = _load_bytes(q_ptr, offs_n, 0, n_mask, K, stride_qn, BLOCK_K)
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if METHOD == 2:  # the next tile, in its stored bits, before this one is used
            raw_next = _load_words(q_ptr, offs_n, k0 + BLOCK_K, n_mask, K, stride_qn, BLOCK_K)
            w = _unpack_words(raw, BLOCK_N, BLOCK_K)
        else:
            raw_next = _load_bytes(q_ptr, offs_n, k0 + BLOCK_K, n_mask, K, stride_qn, BLOCK_K)
            w = raw.to(tl.float32)
        # masked lanes zeroed after the conversion (a load's `other` cannot be cast to fp8)
        if HAS_ZP:
            w = w - tl.load(z_rows + (k // BC)[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0).to(tl.float32)
        w = tl.where(n_mask[:, None] & (k < K)[None, :], w, 0.0)
        xk = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        if not ROW_SCALE:
            w = w * tl.load(s_rows + (k // BC)[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
        acc += xk[:, None, :] * w[None, :, :]
        raw = raw_next
    y = tl.sum(acc, 2)
    if ROW_SCALE:
        y = y * tl.load(s_ptr + (offs_n // BR).to(tl.int64) * stride_sn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, round_to(y, y_ptr.dtype.element_ty, MANUAL_BF16), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _quantized_gemv1_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, K, stride_qn, stride_sn, BR, BC,
    METHOD: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr,
    IN_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, STAGES: tl.constexpr,
    MANUAL_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One row (batch-1 decode). Grid (cdiv(N, BLOCK_N),): program j owns outputs [j * BLOCK_N, ...) and streams
    # their rows as int32 words ([N, K / PER]: PER = 4 int8/fp8 bytes or 8 int4 nibbles, code i of word c is
    # column PER * c + i), BLOCK_W words a step, pipelined by Triton (STAGES). The codes of word position i are
    # taken out in registers (a static loop over i; 2-D tiles only) without an int->float conversion, which
    # runs at a quarter of the FMA rate, and without a shift (the integer units' half rate bounded the GEMV
    # before): the code u (unsigned: int8 q + 128 after one XOR a word, int4 q + 8) masked in place at bit
    # p = 8j or 4j of the word (j < 2 or 4; the word's upper half shifted down once for the other codes) is,
    # as float32 bits, the subnormal u 2^(p - 149); x is scaled by 2^(100 - p) when loaded, so one FMA adds
    # u x 2^-49, and sum_i q x = 2^49 sum_i u x ... - 128 (or 8) sum_i x once per step (x up to 2^28 stays
    # finite; u x 2^-49 stays normal for |x| > 2^-77);
    # * fp8: the hardware conversion (two codes per instruction).
    # Each step's products T[n, c] = sum_i code x (per word) then take the scale: per row at the end
    # (ROW_SCALE), else per row and group ((T - z sum_i x) s, one group per tile (IN_GROUP) or per word).
    # USE_PDL: launched early (infer.kernels.pdl), it waits before its first load, then lets the next kernel launch.
    wait_for_previous(USE_PDL)
    PER: tl.constexpr = 8 if METHOD == 2 else 4
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BLOCK_W)
    kw = K // PER
    rows = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    s_rows = (offs_n // BR).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in tl.range(0, kw, BLOCK_W, num_stages=STAGES):
        wk = w0 + offs_w
        wm = wk < kw
        words = tl.load(rows + wk[None, :], mask=n_mask[:, None] & wm[None, :], other=0)
        t = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        xs = tl.zeros([BLOCK_W], dtype=tl.float32)
        if METHOD == 0:
            words = words ^ -2139062144  # 0x80808080: each byte the unsigned u = q + 128
        if METHOD != 1:
            high = words >> 16  # codes 4..7 (int4) or bytes 2, 3 (int8) to bits 0..15
        for i in tl.static_range(PER):
            xi = tl.load(x_ptr + wk * PER + i, mask=wm, other=0.0).to(tl.float32)
            if METHOD != 1 or HAS_ZP or not ROW_SCALE:  # sum x: the codes' offset, zero points, group scales
                xs += xi
            if METHOD == 2:  # nibble u at bits 4j..4j+3 (j = i % 4) as the subnormal u 16^j 2^-149; x scaled to match
                if i < 4:
                    code = (words & (0xF << (4 * i))).to(tl.float32, bitcast=True)
                else:
                    code = (high & (0xF << (4 * (i - 4)))).to(tl.float32, bitcast=True)
                if i % 4 == 0:  # x 2^(100 - 4j): sum u x 2^-49, undone once per step (x up to 2^28 stays finite)
                    xi = xi * 1.2676506002282294e30
                elif i % 4 == 1:
                    xi = xi * 7.922816251426434e28
                elif i % 4 == 2:
                    xi = xi * 4.951760157141521e27
                else:
                    xi = xi * 3.094850098213451e26
            elif METHOD == 0:  # byte u at bits 8j..8j+7 (j = i % 2) as the subnormal u 256^j 2^-149
                if i < 2:
                    code = (words & (0xFF << (8 * i))).to(tl.float32, bitcast=True)
                else:
                    code = (high & (0xFF << (8 * (i - 2)))).to(tl.float32, bitcast=True)
                if i % 2 == 0:  # x 2^(100 - 8j)
                    xi = xi * 1.2676506002282294e30
                else:
                    xi = xi * 4.951760157141521e27
            else:
                code = ((words >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            t += code * xi[None, :]
        if METHOD == 2:
            t = t * 562949953421312.0 - 8.0 * xs[None, :]  # 2^49 sum u x - 8 sum x = sum (u - 8) x
        elif METHOD == 0:
            t = t * 562949953421312.0 - 128.0 * xs[None, :]
        if ROW_SCALE:
            acc += t
        else:
            if IN_GROUP:  # the step lies in one scale column
                at = s_rows[:, None] + (w0 * PER) // BC
                sm = n_mask[:, None]
            else:
                at = s_rows[:, None] + ((wk * PER) // BC)[None, :]
                sm = n_mask[:, None] & wm[None, :]
            if HAS_ZP:
                t -= tl.load(z_ptr + at, mask=sm, other=0).to(tl.float32) * xs[None, :]
            acc += t * tl.load(s_ptr + at, mask=sm, other=0.0)
    y = tl.sum(acc, 1)
    if ROW_SCALE:
        y = y * tl.load(s_ptr + s_rows, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, round_to(y, y_ptr.dtype.element_ty, MANUAL_BF16), mask=n_mask)


@triton.jit
def _quantized_linear_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym, BR, BC,
    METHOD: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_16BIT: tl.constexpr, MANUAL_BF16: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)): program (j, i) computes outputs [j * BLOCK_N, ...) of rows
    # [i * BLOCK_M, ...), tl.dot per K tile on the dequantized weight tile, in x's 16-bit dtype (DOT_16BIT) or
    # float32.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, k, k0, n_mask, K, stride_qn, stride_sn, BR, BC, METHOD,
                          HAS_ZP, BLOCK_N, BLOCK_K)
        if DOT_16BIT:
            acc += tl.dot(x.to(dtype), tl.trans(w.to(dtype)))
        else:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, round_to(acc, dtype, MANUAL_BF16), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_qn, stride_sn, BR, BC, METHOD: tl.constexpr,
                       HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MANUAL_BF16: tl.constexpr):
    # Grid (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)): program (j, i) writes tile (j, i) of the weight in w's dtype.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w = _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, k, k0, n_mask, K, stride_qn, stride_sn, BR, BC, METHOD, HAS_ZP,
                      BLOCK_N, BLOCK_K)
    tl.store(w_ptr + offs_n.to(tl.int64)[:, None] * K + k[None, :], round_to(w, w_ptr.dtype.element_ty, MANUAL_BF16),
             mask=n_mask[:, None] & (k < K)[None, :])


def dequantize_triton(qweight: torch.Tensor, weight_scale: torch.Tensor, method: str, block: tuple[int, int],
                      dtype: torch.dtype, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~infer.kernels.quant_reference.dequantize` in one Triton kernel: the ``[N, K]`` weight in ``dtype``
    (float32 products rounded once). What :func:`quantized_linear_triton` does for many rows on CUDA before one
    cuBLAS GEMM: a prefill is bound by arithmetic, and our ``tl.dot`` GEMM on dequantized tiles ran 3-6x slower
    than cuBLAS on bf16 at 2,048 rows of Qwen3-8B's projections on an H200 (offline throughput with fp8 weights:
    0.33x bf16, 0.73x with this); writing a bf16 copy and reading it costs 3 bytes of traffic a weight more than
    bf16 alone (an estimated 10-15% of a 2,048-row GEMM, a large share of a decode step of a few rows). The copy is
    transient (the caching allocator's, one projection at a time)."""
    n = qweight.shape[0]
    k = qweight.shape[1] * (8 if method == "int4" else 1)
    bc = block[1]
    w = torch.empty((n, k), device=qweight.device, dtype=dtype)
    bk = _block_k(128, k, bc)
    z = zero_point.contiguous() if zero_point is not None else weight_scale
    s = weight_scale.contiguous() if zero_point is not None else weight_scale
    _dequantize_kernel[(triton.cdiv(n, 32), triton.cdiv(k, bk))](
        qweight, s, z, w, n, k, qweight.stride(0), s.stride(0), block[0], bc, METHOD=_METHOD_CODE[method],
        HAS_ZP=zero_point is not None, BLOCK_N=32, BLOCK_K=bk, MANUAL_BF16=INTERPRET and dtype == torch.bfloat16,
        num_warps=4)
    return w


def _block_k(preferred: int, k: int, bc: int) -> int:
    """The largest power of two <= ``preferred`` (and >= 16) that keeps every K tile inside one scale column."""
    b = preferred
    while b > 16 and bc < k and bc % b:
        b //= 2
    if bc < k and bc % b:
        raise ValueError(f"scale columns of {bc} inputs: need a multiple of 16 (or one scale per row)")
    return b


def default_config(m: int, n: int, k: int, bc: int, method: str = "int8") -> tuple[int, int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, DOT)`` for ``m`` rows of a ``[n, k]`` ``method`` weight whose
    scale columns span ``bc`` inputs.

    The tiles are the best of ``benchmarks/quantization.py --parts tune`` at Qwen3-4B's shapes on an H100
    (timed in a CUDA graph, each call on its own copy of the weight), or within ~10% of the best:

    * one row (batch-1 decode): the one-row GEMV (:func:`_quantized_gemv1_kernel`, ``DOT`` False, ``BLOCK_M``
      1, then the pipeline's stages: 1, Triton's loop unpipelined), int8 and fp8 ``(8, 2048, 4)``, wide
      projections (gate/up, 16,384+ outputs) ``(16, 512, 4)``; int4 ``(8, 2048, 2)``, ``(8, 2048, 4)`` for long
      rows (down, 8,192+ inputs), ``(16, 1024, 2)`` when wide; up to 2^23 weights (Qwen3-0.6B) ``(2, 1024, 2)``.
      Within 5-15% of each shape's best tile at Qwen3-4B's and 8B's projections on an H200 (``benchmarks/
      quantization.py --parts tune``; the tiles before were 10-50% slower there);
    * up to :data:`GEMV_MAX_ROWS` rows (int4: up to :data:`GEMV_ROWS_LIMIT`): the GEMV with ``(4, 256, 2)``
      (int4 ``(2, 256, 4)``): its float32 products grow with the rows, but unpacking int4 for tensor cores
      costs more;
    * more rows: the tl.dot GEMM on :data:`GEMM_TILE` tiles (``BLOCK_K`` inside one scale column)."""
    m_pad = triton.next_power_of_2(max(m, 1))
    if m <= 1:
        if n * k <= 1 << 23:  # small (Qwen3-0.6B): more programs
            block_n, block_k, warps = 2, 1024, 2
        elif method == "int4":
            block_n, block_k, warps = (16, 1024, 2) if n >= 16384 else (8, 2048, 4 if k >= 8192 else 2)
        else:
            block_n, block_k, warps = (16, 512, 4) if n >= 16384 else (8, 2048, 4)
        return 1, block_n, min(block_k, max(32, triton.next_power_of_2(k))), warps, False, 1
    if m <= (GEMV_ROWS_LIMIT if method == "int4" else GEMV_MAX_ROWS):
        block_n, warps = (2, 4) if method == "int4" else (4, 2)
        return m_pad, block_n, min(256, max(16, triton.next_power_of_2(k))), warps, False
    block_m, block_n, block_k, warps = GEMM_TILE
    return max(block_m, min(64, m_pad)), block_n, _block_k(block_k, k, bc), warps, True


#: more rows than the GEMV takes, on CUDA: dequantize the weight once, then a cuBLAS GEMM (:func:`dequantize_triton`);
#: False: the ``tl.dot`` GEMM on dequantized tiles, 3-6x slower, but a row's result does not depend on how many rows
#: the call has (cuBLAS picks its kernel by shape, so a CUDA graph's padded prefill can round differently from the
#: same prefill run eagerly)
DEQUANT_THEN_CUBLAS = True
#: the most rows (int8, fp8) the GEMV kernel takes in the engine (default_config)
GEMV_MAX_ROWS = 4
#: (BLOCK_M at least, BLOCK_N, BLOCK_K, num_warps) of the GEMM past the GEMV's rows (default_config)
GEMM_TILE = (16, 16, 128, 4)


def _as_words(qweight: torch.Tensor, method: str) -> torch.Tensor | None:
    """``qweight`` as int32 words ``[N, K / 4]`` (int8, fp8: four codes a word, the first in the low byte) or as
    stored (int4); None where its rows cannot be read so (``K % 4``, a row stride or start not on 4 bytes)."""
    if method == "int4":
        return qweight
    if qweight.shape[1] % 4 or qweight.stride(1) != 1 or qweight.stride(0) % 4 or qweight.storage_offset() % 4:
        return None
    return qweight.view(torch.int32)


def quantized_linear_triton(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, method: str,
                            block: tuple[int, int], bias: torch.Tensor | None = None,
                            config: tuple[int, int, int, int, bool] | None = None,
                            zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(W)^T + bias`` by :func:`_quantized_linear_kernel` (CUDA, or the interpreter).

    Args:
        x: ``[..., K]`` float32/bfloat16/float16 (the last dimension contiguous after flattening).
        qweight, weight_scale, method, block: as :mod:`infer.kernels.quant_reference` describes them.
        bias: ``[N]`` in ``x.dtype`` or None.
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, DOT)``, for one row optionally followed by the pipeline's
            stages; default :func:`default_config`.
        zero_point: int4's zero points, int8 or float32 (the scale's shape; asymmetric formats, GGUF's Q4_1 / Q4_K), or None.

    Returns:
        ``[..., N]`` in ``x.dtype``: float32 accumulation, one rounding to the dtype.

    Raises:
        ValueError: as :func:`~infer.kernels.quant_reference.check_quantized`, or scale columns a K tile
            cannot stay inside.
    """
    check_quantized(x, qweight, weight_scale, method, block, bias, zero_point)
    n = qweight.shape[0]
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    bm, bn, bk, warps, dot, *rest = config or default_config(m, n, k, block[1], method)
    br, bc = block
    common = dict(METHOD=_METHOD_CODE[method], HAS_ZP=zero_point is not None, HAS_BIAS=bias is not None, BLOCK_N=bn,
                  BLOCK_K=bk, MANUAL_BF16=manual_bf16(x), num_warps=warps)
    b = bias if bias is not None else y
    z = weight_scale  # (unread without zero points)
    if zero_point is not None:  # read with the scales' strides
        weight_scale, z = weight_scale.contiguous(), zero_point.contiguous()
    row = bc >= k and zero_point is None  # one scale per output row, applied after the reduction
    per = 8 if method == "int4" else 4  # codes per int32 word (the one-row GEMV)
    if dot and config is None and x.is_cuda and DEQUANT_THEN_CUBLAS:  # prefill, large batches: dequantize, cuBLAS
        w = dequantize_triton(qweight, weight_scale, method, block, x.dtype, zero_point)
        return torch.nn.functional.linear(x, w, bias)
    if dot:
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
        _quantized_linear_kernel[grid](x2, qweight, weight_scale, z, b, y, m, n, k, x2.stride(0), qweight.stride(0),
                                       weight_scale.stride(0), y.stride(0), br, bc, BLOCK_M=bm,
                                       DOT_16BIT=x.dtype != torch.float32 and not INTERPRET, **common)
    elif m == 1 and bm == 1 and (words := _as_words(qweight, method)) is not None and (row or bc % per == 0):
        _quantized_gemv1_kernel[(triton.cdiv(n, bn),)](
            x2, words, weight_scale, z, b, y, n, k, words.stride(0), weight_scale.stride(0), br, bc,
            METHOD=common["METHOD"], HAS_ZP=common["HAS_ZP"], HAS_BIAS=common["HAS_BIAS"], ROW_SCALE=row,
            IN_GROUP=not row and bk <= bc and bc % bk == 0, BLOCK_N=bn, BLOCK_W=max(1, bk // per),
            STAGES=rest[0] if rest else 3 if method == "int8" else 1, MANUAL_BF16=common["MANUAL_BF16"], num_warps=warps,
            **launch_options(x2))
    else:
        if bm < m or bm > GEMV_ROWS_LIMIT:
            raise ValueError(f"the GEMV form takes m <= BLOCK_M <= {GEMV_ROWS_LIMIT} rows, got m={m}, BLOCK_M={bm}")
        _quantized_gemv_kernel[(triton.cdiv(n, bn),)](
            x2, qweight, weight_scale, z, b, y, m, n, k, x2.stride(0), qweight.stride(0), weight_scale.stride(0),
            y.stride(0), br, bc, M_PAD=bm, ROW_SCALE=row, **common)
    return y.view(*x.shape[:-1], n)


def quantized_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, method: str,
                     block: tuple[int, int], bias: torch.Tensor | None = None,
                     zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """The quantized projection a model runs: :func:`quantized_linear_triton` on CUDA, the plain-PyTorch
    reference (dequantize per call, then ``F.linear``) on the CPU. Same arguments and result."""
    if x.is_cuda:
        return quantized_linear_triton(x, qweight, weight_scale, method, block, bias, zero_point=zero_point)
    return quantized_linear_reference(x, qweight, weight_scale, method, block, bias, zero_point)
