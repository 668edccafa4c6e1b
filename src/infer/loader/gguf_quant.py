"""GGUF's quantized blocks served as stored (phase 11): the decoder's projections of the types that one of infer's
quantized layouts (:mod:`infer.kernels.quant_reference`) holds *exactly* are repacked once at load into a
:class:`~infer.models.quant.QuantizedLinear`, which the Triton kernels read in its 4 or 8 bits; every other tensor is
dequantized to float as in phase 0 (:func:`infer.loader.gguf.iter_gguf_tensors`).

The block formats (llama.cpp's ``ggml-common.h`` / ``ggml-quants.c``, gguf-py's ``gguf/quants.py``, whose
``dequantize`` is the reference of the tests). A row of ``K`` inputs is ``K / B`` blocks of ``B`` values, in order;
``d``, ``dmin`` and ``m`` are float16, ``u`` a block's unsigned codes:

=====  ===  =====================================================  ==================  ==========================
type   B    bytes of a block                                       value               infer's layout
=====  ===  =====================================================  ==================  ==========================
Q8_0   32   ``d``, 32 int8 ``q``                                   ``d q``             int8, scales ``(1, 32)``
Q4_0   32   ``d``, 16 bytes: value ``i < 16`` in the low nibble    ``d (u - 8)``       int4 group 32, symmetric
            of byte ``i``, value ``16 + i`` in its high nibble
Q4_1   32   ``d``, ``m``, 16 bytes as Q4_0                         ``d u + m``         int4 group 32, float zero
                                                                                       point ``-m / d - 8``
Q4_K   256  ``d``, ``dmin``, 12 bytes of 6-bit ``sc_j``, ``m_j``    ``d sc_j u -``      int4 group 32, scale
            for 8 sub-blocks of 32, 128 bytes: sub-blocks ``2i``   ``dmin m_j``        ``d sc_j``, float zero
            and ``2i + 1`` in the low and high nibbles of bytes                        point ``dmin m_j /
            ``32 i .. 32 i + 31``                                                      (d sc_j) - 8``
Q6_K   256  128 bytes of low 4 bits, 64 of high 2 bits, 16 int8    ``d sc_j (u - 32)`` int8 codes ``u - 32``,
            ``sc_j`` (sub-blocks of 16), ``d``                                         scales ``(1, 16)``
=====  ===  =====================================================  ==================  ==========================

infer's int4 computes ``(q - z) s`` with ``q = u - 8``; a block that stores a minimum (Q4_1, Q4_K) has
``d u + m = d (q - z)`` for ``z = -m / d - 8``, not an integer: its zero point is float32. A block with ``d == 0``
is the constant ``m``: its codes are rewritten to ``q = 0`` with ``z = -1`` and scale ``m`` (no division by zero).

Exactness: the scales ``d``, ``d sc_j`` are exact in float32 (11 + 8 significant bits). Q8_0, Q4_0 and Q6_K give
gguf-py's values bit for bit (one product, rounded once, in both); Q4_1 and Q4_K round ``z`` and ``q - z`` in
float32, within a few ulp of ``|d| 15 + |m|`` (gguf-py rounds ``d u`` and the sum instead).

Not served quantized (dequantized at load): F32, F16, BF16, Q5_0 / Q5_1 / Q5_K, Q2_K, Q3_K and the IQ types (a
5-bit code would need int8 storage; no kernel reads 5, 3 or 2 bits or a codebook), the embeddings, the norms, and
the LM head unless ``quantize_lm_head`` (:func:`gguf_lm_head`).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from infer.config import ModelConfig
from infer.models.quant import QUANTIZED_PROJECTIONS, QuantizedLinear, QuantScheme

__all__ = ["SERVED_TYPES", "GGUF_SCHEME", "repack", "gguf_layouts", "gguf_lm_head", "describe_gguf_weights"]

#: the GGUF types served quantized, and the layout each becomes
SERVED_TYPES: dict[str, QuantScheme] = {
    "Q8_0": QuantScheme("int8", (1, 32), prequantized=True, format="gguf"),
    "Q4_0": QuantScheme("int4", (1, 32), prequantized=True, format="gguf"),
    "Q4_1": QuantScheme("int4", (1, 32), prequantized=True, format="gguf", symmetric=False,
                        zero_point_dtype=torch.float32),
    "Q4_K": QuantScheme("int4", (1, 32), prequantized=True, format="gguf", symmetric=False,
                        zero_point_dtype=torch.float32),
    "Q6_K": QuantScheme("int8", (1, 16), prequantized=True, format="gguf"),
}
#: what :class:`~infer.loader.quantized.QuantizedParams` routes a GGUF's repacked tensors by (each module has its
#: own layout: :func:`gguf_layouts`)
GGUF_SCHEME = QuantScheme("int4", (1, 32), prequantized=True, format="gguf")
_BYTES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (last axis) as float16 -> float32, the last axis dropped."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` unsigned codes: the low nibbles, then the high ones (Q4_0, Q4_1)."""
    return np.concatenate([b & 0x0F, b >> 4], axis=-1)


def _pack(u: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit codes ``[N, K]`` (``q + 8``) -> int32 ``[N, K / 8]`` in infer's int4 layout (value ``k`` in
    bits ``4 (k % 8) ..`` of word ``k // 8``: :func:`~infer.kernels.quant_reference.pack_int4`)."""
    u = u.reshape(u.shape[0], -1, 8).astype(np.uint32)
    word = np.zeros(u.shape[:2], np.uint32)
    for j in range(8):
        word |= u[:, :, j] << np.uint32(4 * j)
    return word.view(np.int32)


def _with_minimum(u: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups of value ``d u + m`` (``u [N, G, B]`` in 0..15, ``d``, ``m`` float32 ``[N, G]``) as infer's
    ``(q - z) s``: ``(qweight, scale d, zero point -m / d - 8)``; a group with ``d == 0`` (the constant ``m``)
    gets codes 8 (``q = 0``), ``z = -1`` and scale ``m``."""
    zero = d == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(zero, -1.0, -(m.astype(np.float64) / d) - 8.0).astype(np.float32)
    u = np.where(zero[:, :, None], np.uint8(8), u)
    return _pack(u.reshape(u.shape[0], -1)), np.where(zero, m, d).astype(np.float32), z


def repack(data: np.ndarray, qtype: str) -> dict[str, torch.Tensor]:
    """One GGUF tensor's blocks in infer's quantized layout (:data:`SERVED_TYPES` says which).

    Args:
        data: the tensor's bytes, uint8 ``[N, K / B * bytes per block]`` (a ``GGUFReader`` tensor's ``data``: one
            row of blocks per output).
        qtype: ``"Q8_0"``, ``"Q4_0"``, ``"Q4_1"``, ``"Q4_K"`` or ``"Q6_K"``.

    Returns:
        CPU tensors by parameter name: ``qweight`` (int8 ``[N, K]`` or int32 ``[N, K / 8]``), ``weight_scale``
        (float32 ``[N, K / G]``) and, for Q4_1 and Q4_K, ``weight_zero_point`` (float32 ``[N, K / G]``); ``G``
        the layout's group (32; 16 for Q6_K). Dequantized (:func:`~infer.kernels.quant_reference.dequantize`) they
        are gguf-py's ``dequantize`` of the same bytes (module docstring: exact, or within a few ulp).

    Raises:
        ValueError: a type not in :data:`SERVED_TYPES`, or rows that are not whole blocks.
    """
    if qtype not in _BYTES:
        raise ValueError(f"GGUF type {qtype} has no quantized layout in infer (served: {sorted(_BYTES)})")
    nbytes = _BYTES[qtype][1]
    data = np.asarray(data).view(np.uint8)
    if data.ndim != 2 or data.shape[1] % nbytes:
        raise ValueError(f"{qtype}: rows of {data.shape[1:]} bytes are not whole {nbytes}-byte blocks")
    n = data.shape[0]
    b = data.reshape(n, -1, nbytes)  # [N, blocks, bytes]
    out: dict[str, np.ndarray] = {}
    if qtype == "Q8_0":
        out["qweight"] = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, -1)
        out["weight_scale"] = _f16(b[..., 0:2])
    elif qtype == "Q4_0":
        out["qweight"] = _pack(_nibbles(b[..., 2:]).reshape(n, -1))
        out["weight_scale"] = _f16(b[..., 0:2])
    elif qtype == "Q4_1":
        out["qweight"], out["weight_scale"], out["weight_zero_point"] = _with_minimum(
            _nibbles(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4]))
    elif qtype == "Q4_K":
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]  # [N, blocks, 1]
        sc, mn = _q4_k_scales(b[..., 4:16])  # [N, blocks, 8] each
        qs = b[..., 16:].reshape(n, -1, 4, 1, 32)  # sub-blocks 2i (low nibbles) and 2i + 1 (high) of 32 bytes
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 32)  # [N, sub-blocks, 32]
        s = (d * sc).reshape(n, -1)  # exact: 11 x 6 significant bits
        out["qweight"], out["weight_scale"], out["weight_zero_point"] = _with_minimum(u, s, -(dmin * mn).reshape(n, -1))
    else:  # Q6_K, as gguf-py's dequantize_blocks lays the bits out
        ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208], b[..., 208:210]
        lo = (ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F  # [N, blocks, 2, 2, 64]
        hi = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03  # [.., 2, 4, 32]
        q = (lo.reshape(n, -1, 256) | (hi.reshape(n, -1, 256) << 4)).astype(np.int8) - np.int8(32)
        out["qweight"] = q.reshape(n, -1)
        out["weight_scale"] = (_f16(d)[..., None] * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)).reshape(n, -1)
    return {k: torch.from_numpy(np.ascontiguousarray(v).reshape(n, -1)) for k, v in out.items()}


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes ``[..., 12]`` -> the 6-bit scales and minimums of its 8 sub-blocks, float32 ``[..., 8]``
    each (llama.cpp's ``get_scale_min_k4``): bytes 0-3 hold ``sc_0..3`` (low 6 bits) and the top 2 bits of
    ``sc_4..7``, bytes 4-7 ``m_0..3`` and the top 2 bits of ``m_4..7``, bytes 8-11 the low 4 bits of ``sc_4..7``
    (low nibble) and ``m_4..7`` (high nibble)."""
    a, m, lo = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 0x3F, (lo & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (lo >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def gguf_layouts(types: dict[str, str]) -> dict[str, tuple[str, QuantScheme]]:
    """The decoder projections served quantized: ``{module name (model.layers.0.self_attn.q_proj): (GGUF type,
    its layout)}``, for every projection whose type is in :data:`SERVED_TYPES`.

    Args:
        types: the GGUF type of each tensor the model loads, by Hugging Face name
            (:func:`infer.loader.gguf.tensor_types`).
    """
    out = {}
    for name, qtype in types.items():
        if not name.endswith(".weight") or qtype not in SERVED_TYPES:
            continue
        prefix = name.removesuffix(".weight")
        if prefix.startswith("model.layers.") and prefix.rpartition(".")[2] in QUANTIZED_PROJECTIONS:
            out[prefix] = (qtype, SERVED_TYPES[qtype])
    return out


def _type_name(t) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(t.tensor_type).name


@torch.no_grad()
def gguf_lm_head(reader, cfg: ModelConfig, device: torch.device) -> tuple[QuantizedLinear | None, str]:
    """``quantize_lm_head`` on a GGUF served quantized: the LM head in the layout of its own GGUF type, from
    ``output.weight`` (or ``token_embd.weight`` when the embeddings are tied: the input embedding keeps its
    dequantized float table). On the CPU the kernel's layout is made at once.

    Returns:
        ``(the head [vocab, hidden], its GGUF type)``, or ``(None, the type)`` when that type has no quantized
        layout (:data:`SERVED_TYPES`).

    Raises:
        ValueError: the tensor's shape is not the config's ``[vocab_size, hidden_size]``.
    """
    name = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    t = next(t for t in reader.tensors if t.name == name)
    qtype = _type_name(t)
    if qtype not in SERVED_TYPES:
        return None, qtype
    s = SERVED_TYPES[qtype]
    with torch.device("meta"):
        head = QuantizedLinear(cfg.hidden_size, cfg.vocab_size, False, s.method, s.block, zero_point=not s.symmetric,
                               zero_point_dtype=s.zero_point_dtype)
    for leaf, v in repack(t.data, qtype).items():
        if tuple(v.shape) != tuple(getattr(head, leaf).shape):
            raise ValueError(f"{name}: {leaf} {tuple(v.shape)}, the config implies {tuple(getattr(head, leaf).shape)}")
        setattr(head, leaf, torch.nn.Parameter(v.to(device), requires_grad=False))
    if head.qweight.device.type == "cpu":
        head.cpu_packed()
    return head, qtype


def describe_gguf_weights(types: dict[str, str], layouts: dict[str, tuple[str, QuantScheme]],
                          head: str | None = None) -> str:
    """One log line: how many of the decoder's projections of each GGUF type are served quantized (and in which
    layout), how many of the model's other tensors (``types``: as :func:`gguf_layouts` takes them) of each type
    are dequantized to float, and ``head``: the LM head's type when it is served quantized
    (``quantize_lm_head``)."""

    def layout(qtype: str) -> str:
        s = SERVED_TYPES[qtype]
        return f"{s.method} groups of {s.block[1]}" + (" with float zero points" if not s.symmetric else "")

    served = Counter(qtype for qtype, _ in layouts.values())
    dequantized = Counter(qtype for name, qtype in types.items() if name.removesuffix(".weight") not in layouts)
    line = ("GGUF weights: served quantized: "
            + (", ".join(f"{n} {q} ({layout(q)})" for q, n in sorted(served.items())) or "none")
            + "; dequantized to float: " + (", ".join(f"{n} {q}" for q, n in sorted(dequantized.items())) or "none"))
    return line + (f"; the LM head from its {head} blocks ({layout(head)})" if head is not None else "")
