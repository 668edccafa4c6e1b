"""Weight-only quantized projections (phase 11): :class:`QuantizedLinear` and the scheme that says which
layers become one.

The shape of vLLM's ``QuantizationConfig`` / ``LinearMethodBase``, cut to what infer needs: a
:class:`QuantScheme` (from ``EngineConfig.quantization``, or read from a pre-quantized checkpoint by
:mod:`infer.loader.quantized`) picks the linear implementation of every decoder projection once, when
the model is built on ``meta`` (:func:`quantize_modules`); the loader then fills each
:class:`QuantizedLinear` either by quantizing the float weight it reads (online quantization,
:meth:`QuantizedLinear.quantize_weight`) or with the checkpoint's own quantized tensors. The forward
reads the quantized weight: on CUDA :func:`infer.kernels.quant_triton.quantized_linear` (int4 decode rows:
PyTorch's tensor-core int4 kernel, :mod:`infer.kernels.quant_tinygemm`, on a layout made once at load:
:meth:`QuantizedLinear.tinygemm_packed`), on the CPU :func:`infer.kernels.quant_cpu.quantized_linear_cpu`
(PyTorch's CPU weight-only kernels, on a layout made once at load: :meth:`QuantizedLinear.cpu_packed`).

What is quantized: the attention projections (q, k, v, o) and the dense MLP's (gate, up, down) of
every decoder layer, as vLLM and the Hub's quantized releases do. The embeddings, the norms and an MoE
block's router and experts keep the model dtype; so does the LM head unless ``EngineConfig.quantize_lm_head``
(:func:`quantize_lm_head`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from infer.kernels import quant_reference as qref
from infer.kernels.quant_cpu import CpuPackedWeight, pack_for_cpu, quantized_linear_cpu
from infer.kernels.quant_tinygemm import TINYGEMM_MAX_ROWS, TinygemmWeight, pack_tinygemm, tinygemm_linear
from infer.kernels.quant_w8a8 import W8A8_MIN_ROWS, w8a8_linear

#: the decoder projections that :func:`quantize_modules` replaces, by attribute name
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class QuantScheme:
    """How a model's projections are quantized.

    Attributes:
        method: ``"int8"``, ``"fp8"`` or ``"int4"`` (:mod:`infer.kernels.quant_reference`).
        block: ``(br, bc)``, rows and columns per scale; ``bc == 0`` means the whole row (per output
            channel). Online: ``(1, 0)`` for int8 and fp8, ``(1, group_size)`` for int4.
        prequantized: the checkpoint holds the quantized tensors (loaded as stored); otherwise the float
            weights are quantized as they load.
        format: where the scheme came from: ``"online"``, ``"fp8"`` (Hugging Face's block-wise FP8),
            ``"compressed-tensors"``, ``"gptq"`` / ``"gptq_v2"`` (4-bit GPTQ) or ``"awq"``.
        symmetric: False for int4 with a zero point per group (AWQ, GPTQ ``sym: false``, compressed-tensors'
            ``W4A16_ASYM``, GGUF's Q4_1 and Q4_K): every projection then has a ``weight_zero_point``.
        zero_point_dtype: the zero points' dtype: ``torch.int8`` (integer codes), or ``torch.float32`` (GGUF's
            minimums, ``-m / d - 8``: :mod:`infer.loader.gguf_quant`).
        fp8_activations: W8A8 (``quantization="fp8_w8a8"``): fp8 weights with one scale per row whose prefills and
            larger batches quantize the activations per token and run on the FP8 tensor cores
            (:mod:`infer.kernels.quant_w8a8`).
    """

    method: str
    block: tuple[int, int]
    prequantized: bool = False
    format: str = "online"
    symmetric: bool = True
    zero_point_dtype: torch.dtype = torch.int8
    fp8_activations: bool = False

    @classmethod
    def online(cls, method: str, group_size: int = 128) -> QuantScheme:
        """The scheme of ``EngineConfig.quantization = method`` (``int4_asym``: int4 with zero points;
        ``fp8_w8a8``: fp8 per channel with per-token fp8 activations)."""
        if method == "int4_asym":
            return cls("int4", (1, group_size), symmetric=False)
        if method == "fp8_w8a8":
            return cls("fp8", (1, 0), fp8_activations=True)
        if method not in qref.QDTYPES:
            raise ValueError(f"unknown quantization method {method!r} (int8, fp8, fp8_w8a8, int4 or int4_asym)")
        return cls(method, (1, group_size) if method == "int4" else (1, 0))

    def block_for(self, in_features: int) -> tuple[int, int]:
        """``(br, bc)`` for a layer with ``in_features`` inputs (``bc == 0`` resolved to the whole row)."""
        return (self.block[0], self.block[1] or in_features)


class QuantizedLinear(nn.Module):
    """``y = x @ dequantize(W)^T + b`` with ``W`` stored quantized (never in 16 bits).

    Parameters (frozen, in the state dict): ``qweight`` and ``weight_scale`` in the layout of
    :mod:`infer.kernels.quant_reference`, ``weight_zero_point`` (the scale's shape, ``zero_point_dtype``: int8
    codes, or float32 for GGUF's minimums) for asymmetric int4 (``zero_point=True``), and ``bias [N]`` in the
    model dtype when the layer has one.

    Shapes: ``x [..., in_features]`` -> ``[..., out_features]`` in ``x``'s dtype.
    """

    #: the CPU forward: PyTorch's weight-only kernels (bfloat16 activations, :mod:`infer.kernels.quant_cpu`),
    #: or with False the float32 reference that dequantizes per call (slow; exactly the float32 model with
    #: the dequantized weights, which the tests of the checkpoint formats compare against)
    cpu_kernels: bool = True
    #: the CUDA int4 forward at up to :data:`~infer.kernels.quant_tinygemm.TINYGEMM_MAX_ROWS` rows (decode), bfloat16
    #: activations: PyTorch's tensor-core int4 kernel (:mod:`infer.kernels.quant_tinygemm`), or with False our
    #: Triton GEMV (:mod:`infer.kernels.quant_triton`; ``benchmarks/quantization.py``'s ``int4-triton`` method)
    tinygemm: bool = True

    def __init__(self, in_features: int, out_features: int, bias: bool, method: str,
                 block: tuple[int, int], zero_point: bool = False, zero_point_dtype: torch.dtype = torch.int8,
                 fp8_activations: bool = False) -> None:
        super().__init__()
        if fp8_activations and (method != "fp8" or block[0] != 1 or block[1] < in_features or zero_point):
            raise ValueError(f"fp8 activations (W8A8) need an fp8 weight with one scale per row, not {method} {block}")
        self.fp8_activations = fp8_activations
        if method not in qref.QDTYPES:
            raise ValueError(f"unknown quantization method {method!r} (int8, fp8 or int4)")
        if method == "int4" and in_features % 8:
            raise ValueError(f"int4 packs 8 values per int32: in_features {in_features} is not a multiple of 8")
        self.in_features, self.out_features = in_features, out_features
        self.method, self.block = method, tuple(block)
        self.qweight = nn.Parameter(torch.empty(qref.qweight_shape(method, out_features, in_features),
                                                dtype=qref.QDTYPES[method]), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(qref.scale_shape(out_features, in_features, self.block),
                                                     dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        if zero_point and method != "int4":
            raise ValueError(f"zero points are for int4 weights, not {method}")
        if zero_point_dtype not in qref.ZERO_POINT_DTYPES:
            raise ValueError(f"zero points are int8 or float32, not {zero_point_dtype}")
        self.weight_zero_point = nn.Parameter(torch.empty(self.weight_scale.shape, dtype=zero_point_dtype),
                                              requires_grad=False) if zero_point else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_activations and not x.is_cuda:  # W8A8 on the CPU: the float32 reference, on cached float32 codes
            codes = self._packed("_w8a8_codes", lambda q, s, block, zp: q.float())
            return qref.w8a8_linear_reference(x, self.qweight, self.weight_scale, self.bias, weight_codes=codes)
        if x.device.type == "cpu" and self.cpu_kernels:
            return quantized_linear_cpu(x, self.cpu_packed(), self.qweight, self.weight_scale, self.method,
                                        self.block, self.bias, self.weight_zero_point)
        if (self.fp8_activations and x.dtype == torch.bfloat16 and x.numel() >= W8A8_MIN_ROWS * self.in_features
                and self.in_features % 16 == 0 and self.out_features % 16 == 0):
            return w8a8_linear(x, self.qweight, self.weight_scale, self.bias)
        if (self.method == "int4" and self.tinygemm and x.is_cuda and x.dtype == torch.bfloat16
                and x.numel() <= TINYGEMM_MAX_ROWS * self.in_features and (tg := self.tinygemm_packed()) is not None):
            return tinygemm_linear(x, tg, self.bias)
        from infer.kernels.quant_triton import quantized_linear

        return quantized_linear(x, self.qweight, self.weight_scale, self.method, self.block, self.bias,
                                self.weight_zero_point)

    def tinygemm_packed(self) -> TinygemmWeight | None:
        """The int4 weight in the layout of PyTorch's CUDA int4 kernel (:func:`~infer.kernels.quant_tinygemm.
        pack_tinygemm`), or None where it does not take this layer; made on the first call (the loader calls it
        at load, and :func:`merge_quantized` for a merged layer) and again only if the weight is replaced, like
        :meth:`cpu_packed`. Held beside ``qweight`` (which prefills read, dequantized): an int4 layer takes twice
        its packed bytes on the GPU."""
        return self._packed("_tinygemm_packed", pack_tinygemm)

    def cpu_packed(self) -> CpuPackedWeight:
        """The weight in the layout of PyTorch's CPU kernel (:func:`~infer.kernels.quant_cpu.pack_for_cpu`),
        made on the first call (the loader calls it once at load) and again only if ``qweight`` or
        ``weight_scale`` is replaced by another tensor or written in place through the parameter (not
        through ``.data``, whose writes PyTorch does not count). Not a parameter: the state dict holds
        the quantized weight only."""
        return self._packed("_cpu_packed", lambda q, s, block, zp: pack_for_cpu(q, s, self.method, block, zp))

    def _packed(self, attr: str, pack):
        """``pack(qweight, weight_scale, block, zero_point)`` cached in ``self.__dict__[attr]``, made again when one
        of those tensors is replaced or written in place through its parameter."""
        zp = self.weight_zero_point
        key = tuple((t.data_ptr(), t._version) for t in (self.qweight, self.weight_scale, zp) if t is not None)
        cached = self.__dict__.get(attr)
        if cached is None or cached[0] != key:
            cached = (key, pack(self.qweight.data, self.weight_scale.data, self.block, zp.data if zp is not None else None))
            self.__dict__[attr] = cached
        return cached[1]

    def quantize_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(qweight, weight_scale)`` of a float ``[out_features, in_features]`` weight (online symmetric
        quantization; :func:`~infer.kernels.quant_reference.quantize`), on the weight's device."""
        return qref.quantize(weight, self.method, self.block)

    def quantized_tensors(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """This layer's quantized parameters of a float ``[out_features, in_features]`` weight, by name (online
        quantization): :meth:`quantize_weight`'s two, or with zero points
        :func:`~infer.kernels.quant_reference.quantize_asymmetric`'s three."""
        if self.weight_zero_point is None:
            return dict(zip(("qweight", "weight_scale"), self.quantize_weight(weight)))
        return dict(zip(("qweight", "weight_scale", "weight_zero_point"), qref.quantize_asymmetric(weight, self.block)))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer multiplies by, ``[out_features, in_features]`` (a new tensor; for tests and
        the reference model, not for the forward)."""
        return qref.dequantize(self.qweight, self.weight_scale, self.method, self.block, dtype, self.weight_zero_point)

    def extra_repr(self) -> str:
        zp = self.weight_zero_point
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}, "
                f"block={self.block}, bias={self.bias is not None}, "
                f"zero_point={str(zp.dtype).removeprefix('torch.') if zp is not None else None}"
                + (", fp8_activations=True" if self.fp8_activations else ""))

    def layout(self) -> tuple:
        """What :func:`merge_quantized` needs equal across parts: ``(method, scale columns, in_features, bias?,
        zero points' dtype or None, fp8 activations?)``."""
        zp = self.weight_zero_point
        return (self.method, self.block[1], self.in_features, self.bias is not None, zp.dtype if zp is not None else None,
                self.fp8_activations)


def merge_quantized(*parts: QuantizedLinear) -> QuantizedLinear:
    """One :class:`QuantizedLinear` whose output rows are ``parts``' rows in order (phase 8's merged QKV
    and gate/up). Exact: every scale belongs to rows of one part. A part whose rows do not fill whole
    row blocks (``N % br != 0``, e.g. block-wise FP8 on a small model) gets one scale row per output row
    first (the same values, repeated). The parts become views of the merged tensors."""
    first = parts[0]
    if any(p.layout() != first.layout() for p in parts):
        raise ValueError("only projections of one input, method and scale layout can be merged (projections of "
                         "different layouts: ConcatLinear)")
    if first.weight_zero_point is not None and any(p.block[0] != 1 for p in parts):
        raise ValueError("zero points are merged for row groups (block (1, G)) only")
    br = first.block[0]
    if any(p.block[0] != br or p.out_features % br for p in parts):
        scales = [qref.expand_scale(p.weight_scale, (p.out_features, -(-p.in_features // p.block[1])),
                                    (p.block[0], 1)) for p in parts]
        br = 1
    else:
        scales = [p.weight_scale for p in parts]
    n = sum(p.out_features for p in parts)
    merged = QuantizedLinear.__new__(QuantizedLinear)
    nn.Module.__init__(merged)
    merged.in_features, merged.out_features = first.in_features, n
    merged.method, merged.block = first.method, (br, first.block[1])
    merged.fp8_activations = first.fp8_activations
    merged.qweight = nn.Parameter(torch.cat([p.qweight for p in parts]), requires_grad=False)
    merged.weight_scale = nn.Parameter(torch.cat(scales).contiguous(), requires_grad=False)
    merged.bias = (nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
                   if first.bias is not None else None)
    merged.weight_zero_point = (nn.Parameter(torch.cat([p.weight_zero_point for p in parts]), requires_grad=False)
                                if first.weight_zero_point is not None else None)
    start = 0
    for p in parts:  # the merged layer computes the parts now: no second copy in a kernel's layout
        for cached in ("_cpu_packed", "_tinygemm_packed", "_w8a8_codes"):
            p.__dict__.pop(cached, None)
        rows = p.out_features
        p.qweight = nn.Parameter(merged.qweight[start:start + rows], requires_grad=False)
        p.weight_scale = nn.Parameter(merged.weight_scale[start // br:(start + rows) // br], requires_grad=False)
        p.block = merged.block
        if p.bias is not None:
            p.bias = nn.Parameter(merged.bias[start:start + rows], requires_grad=False)
        if p.weight_zero_point is not None:
            p.weight_zero_point = nn.Parameter(merged.weight_zero_point[start:start + rows], requires_grad=False)
        start += rows
    if merged.qweight.device.type == "cpu" and not merged.fp8_activations:
        merged.cpu_packed()
    elif merged.method == "int4":
        merged.tinygemm_packed()
    return merged


def quantize_modules(model: nn.Module, scheme: QuantScheme,
                     layouts: dict[str, QuantScheme] | None = None) -> list[str]:
    """Replace every decoder projection (:data:`QUANTIZED_PROJECTIONS` of each layer's attention and dense
    MLP) of ``model``, built on ``meta``, with an empty :class:`QuantizedLinear` of ``scheme``; with
    ``layouts`` (``{module name: scheme}``, a GGUF's projections, each in the layout of its own type) only the
    modules named there, each with its own scheme (the others stay ``nn.Linear``).

    Returns:
        The replaced modules' names (``model.layers.0.self_attn.q_proj``, ...).
    """
    replaced = []
    for name, module in list(model.named_modules()):
        for attr in QUANTIZED_PROJECTIONS:
            child = getattr(module, attr, None)
            full = f"{name}.{attr}" if name else attr
            if not isinstance(child, nn.Linear) or (layouts is not None and full not in layouts):
                continue
            parallel = getattr(child, "parallel", None)
            if parallel is not None and parallel.tp_size > 1:
                raise ValueError("quantized projections are not split across tensor-parallel ranks")
            s = scheme if layouts is None else layouts[full]
            q = QuantizedLinear(child.in_features, child.out_features, child.bias is not None, s.method,
                                s.block_for(child.in_features), zero_point=not s.symmetric,
                                zero_point_dtype=s.zero_point_dtype, fp8_activations=s.fp8_activations)
            setattr(module, attr, q)
            replaced.append(full)
    return replaced


class ConcatLinear(nn.Module):
    """Projections of one input whose outputs sit side by side: ``cat([part(x) for part in parts], -1)``.

    The merged projection of the fused forward (phase 8's ``qkv_proj``, ``gate_up_proj``) when its parts
    cannot share one weight tensor: a GGUF stores each projection in its own type (a Q4_K_M file has q and k
    in Q4_K, v in Q6_K or Q8_0, some in Q5_0 that is dequantized), and each is served in the layout of its
    type (:mod:`infer.loader.gguf_quant`). Rewriting every part into one common layout (int8 codes, groups of
    16, float zero points) would be exact too, but would widen the 4-bit parts to 8 bits plus two float32
    values per 16 weights: 12 bits a weight read per token instead of 4.5. Here each part keeps its bytes
    and its kernel; ``merge_linears`` (:mod:`infer.models.layers`) first merges each run of consecutive parts
    of one layout, so the cost is one product per run and one concatenation.

    Shapes: ``x [..., in_features]`` -> ``[..., out_features]`` (the parts' outputs, in order).
    """

    def __init__(self, *parts: nn.Module) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("the parts of a ConcatLinear must take the same input")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


@torch.no_grad()
def quantize_lm_head(model: nn.Module, scheme: QuantScheme) -> QuantizedLinear:
    """Replace ``model.lm_head`` (a loaded ``nn.Linear``) by a :class:`QuantizedLinear` of its weight, quantized
    with ``scheme``'s method and scale layout (``EngineConfig.quantize_lm_head``). A tied LM head gets its own
    quantized copy: the input embedding keeps the float table (a lookup reads one row per token, the LM head
    every row). On the CPU the kernel's layout is made at once.

    Returns:
        The new LM head.

    Raises:
        ValueError: the LM head is not an ``nn.Linear`` (already quantized) or is split across ranks.
    """
    head = model.lm_head
    if not isinstance(head, nn.Linear):
        raise ValueError(f"the LM head is a {type(head).__name__}, not an nn.Linear")
    parallel = getattr(head, "parallel", None)
    if parallel is not None and parallel.tp_size > 1:
        raise ValueError("a quantized LM head is not split across tensor-parallel ranks")
    with torch.device("meta"):
        q = QuantizedLinear(head.in_features, head.out_features, False, scheme.method,
                            scheme.block_for(head.in_features), zero_point=not scheme.symmetric,
                            zero_point_dtype=scheme.zero_point_dtype, fp8_activations=scheme.fp8_activations)
    for name, t in q.quantized_tensors(head.weight.detach()).items():
        setattr(q, name, nn.Parameter(t, requires_grad=False))
    model.lm_head = q
    if q.qweight.device.type == "cpu":
        q.cpu_packed()
    return q


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """``(bytes of the quantized projections' weights and scales, bytes the same weights take in the model
    dtype)``: what a decode step reads for them, quantized and not."""
    dtype_size = model.model.embed_tokens.weight.element_size()
    storages: dict[int, tuple[int, int]] = {}  # a merged projection and its parts share one storage
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            key = m.qweight.untyped_storage().data_ptr()
            q = m.qweight.numel() * m.qweight.element_size() + m.weight_scale.numel() * 4
            zp = m.weight_zero_point
            q += zp.numel() * zp.element_size() if zp is not None else 0
            storages[key] = max(storages.get(key, (0, 0)), (q, m.out_features * m.in_features * dtype_size))
    return sum(q for q, _ in storages.values()), sum(f for _, f in storages.values())
