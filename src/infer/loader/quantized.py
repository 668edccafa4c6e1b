"""Quantized weights while loading (phase 11): online quantization of float checkpoints, and pre-quantized
checkpoints read as they are stored (no round trip through 16 bits).

:func:`scheme_from_hf_config` reads a Hugging Face ``config.json``'s ``quantization_config``:

* ``quant_method: "fp8"`` (transformers' ``FineGrainedFP8Config``; the Qwen3-*-FP8 and DeepSeek-V3
  releases): ``weight`` in ``float8_e4m3fn`` and ``weight_scale_inv [ceil(N / 128), ceil(K / 128)]``, the
  scale each ``weight_block_size`` block is *multiplied* by (the name says inverse: it is the inverse of
  the quantizer's multiplier). Their activations are meant to be quantized per token group at run time
  (``activation_scheme: dynamic``); infer serves them weight-only (activations stay in 16 bits: no less
  accurate, but no FP8 tensor cores).
* ``quant_method: "compressed-tensors"`` (Neural Magic's ``llmcompressor``): one config group whose
  ``weights`` are symmetric 8-bit int per channel (``W8A16``; ``weight`` int8, ``weight_scale [N, 1]``),
  symmetric 4-bit int per group (``W4A16``, format ``pack-quantized``: ``weight_packed`` int32 ``[N, K / 8]``,
  ``weight_scale [N, K / G]``, ``weight_shape``), or 8-bit float per channel / tensor / block
  (``FP8_DYNAMIC`` and kin; activations again served in 16 bits).
* ``quant_method: "gptq"`` (AutoGPTQ / GPTQModel, the most common 4-bit checkpoints on the Hub) without
  act-order (or whose ``g_idx`` is the plain group order): ``qweight`` int32 ``[K / 8, N]``, eight 4-bit
  values per word along K, the lowest nibble first, each stored unsigned (``q + 8``); ``scales`` float16
  ``[K / G, N]``; ``qzeros`` int32 ``[K / G, N / 8]``, each group's unsigned zero point, stored minus one
  (AutoGPTQ's format ``gptq``) or as is (``checkpoint_format: gptq_v2``); ``g_idx`` int32 ``[K]``, each
  input's group. That is infer's own int4 layout transposed: the words are the same. With ``sym: true``
  every zero point is 8 (checked, and not kept); with ``sym: false`` they become ``weight_zero_point``.
  Act-order (``desc_act``, groups that are not contiguous inputs) is rejected with the reason.
* ``quant_method: "awq"`` (AutoAWQ's ``version: "gemm"``): ``qweight`` int32 ``[K, N / 8]`` and ``qzeros``
  int32 ``[K / G, N / 8]``, eight unsigned 4-bit values per word along **N** in AWQ's interleaved order
  (word nibble ``j`` of word ``c`` holds column ``8 c + [0, 2, 4, 6, 1, 3, 5, 7][j]``), ``scales`` float16 ``[K / G, N]``;
  ``w = (u - zero) * scale``. Repacked once at load into infer's words along K.
* compressed-tensors with ``symmetric: false`` (``W4A16_ASYM``): ``weight_zero_point`` int32 ``[N / 8, K / G]``,
  packed along N (nibble ``z + 8``).
* GGUF's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K projections (``EngineConfig.gguf_weights``): repacked into infer's
  layouts by :mod:`infer.loader.gguf_quant` (format ``"gguf"``, each module in the layout of its own type) and
  taken here as they come.

:class:`QuantizedParams` then routes each checkpoint tensor of a quantized projection to the module's
parameters (``qweight``, ``weight_scale``), or quantizes a float ``weight`` (online).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from infer.errors import ModelLoadError
from infer.kernels import quant_reference as qref
from infer.models.quant import QuantizedLinear, QuantScheme

__all__ = ["QuantizedParams", "scheme_from_hf_config", "resolve_scheme"]


def _fp8_scheme(q: dict[str, Any], source: Path) -> QuantScheme:
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(source, f"quant_method 'fp8' without a weight_block_size [rows, cols] ({block!r}) is "
                             "not supported (infer loads the block-wise format of the Qwen3-FP8 releases)")
    return QuantScheme("fp8", (block[0], block[1]), prequantized=True, format="fp8")


def _compressed_tensors_scheme(q: dict[str, Any], source: Path) -> QuantScheme:
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ModelLoadError(source, f"compressed-tensors: {len(groups)} config groups; infer loads one")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ModelLoadError(source, f"compressed-tensors: targets {targets}; infer loads ['Linear']")
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    fmt = q.get("format") or group.get("format")
    if not w.get("symmetric", True):
        if kind == "int" and bits == 4 and strategy == "group" and fmt == "pack-quantized":
            return QuantScheme("int4", (1, int(w["group_size"])), prequantized=True, format="compressed-tensors",
                               symmetric=False)
        raise ModelLoadError(source, "compressed-tensors: asymmetric weights (a zero point) are supported for "
                             f"int4 per group pack-quantized only, not {kind}{bits} {strategy!r} {fmt!r}")
    if kind == "int" and bits == 8 and strategy in ("channel", "group") and fmt in ("int-quantized", "naive-quantized",
                                                                                   "pack-quantized"):
        group = int(w["group_size"]) if strategy == "group" else 0
        return QuantScheme("int8", (1, group), prequantized=True, format="compressed-tensors")
    if kind == "int" and bits == 4 and strategy == "group" and fmt == "pack-quantized":
        return QuantScheme("int4", (1, int(w["group_size"])), prequantized=True, format="compressed-tensors")
    if kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        if strategy in ("channel", "tensor"):  # a per-tensor scale is repeated per row when it loads
            a = group.get("input_activations") or {}
            w8a8 = (a.get("type"), a.get("num_bits"), a.get("strategy"), a.get("dynamic")) == ("float", 8, "token", True)
            # FP8_DYNAMIC: activations quantized per token at run time, as infer's fp8_w8a8 does
            return QuantScheme("fp8", (1, 0), prequantized=True, format="compressed-tensors", fp8_activations=w8a8)
        if strategy == "block":
            br, bc = w["block_structure"]
            return QuantScheme("fp8", (int(br), int(bc)), prequantized=True, format="compressed-tensors")
    raise ModelLoadError(source, f"compressed-tensors: weights {kind}{bits} strategy {strategy!r} format {fmt!r} "
                         "are not supported (int8 per channel, int4 per group pack-quantized, fp8)")


def _gptq_scheme(q: dict[str, Any], source: Path) -> QuantScheme:
    bits, group, sym = q.get("bits"), q.get("group_size", 128), q.get("sym", True)
    if bits != 4:
        raise ModelLoadError(source, f"gptq: {bits}-bit weights are not supported (4-bit only)")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(source, f"gptq: checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    # act-order (desc_act) is checked on each g_idx as it loads: a trivial one is the plain group order
    return QuantScheme("int4", (1, 0 if group in (-1, None) else int(group)), prequantized=True, format=fmt,
                       symmetric=bool(sym))


def _awq_scheme(q: dict[str, Any], source: Path) -> QuantScheme:
    bits, group = q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size", 128))
    version = str(q.get("version", "gemm")).lower()
    if bits != 4:
        raise ModelLoadError(source, f"awq: {bits}-bit weights are not supported (4-bit only)")
    if version != "gemm":
        raise ModelLoadError(source, f"awq: version {version!r} is not supported (gemm: the packing of AutoAWQ's "
                             "default kernels)")
    if not q.get("zero_point", True):
        raise ModelLoadError(source, "awq: zero_point false is not supported (AutoAWQ's checkpoints have them)")
    return QuantScheme("int4", (1, int(group)), prequantized=True, format="awq", symmetric=False)


def scheme_from_hf_config(raw: dict[str, Any], source: Path) -> QuantScheme | None:
    """The :class:`QuantScheme` of a pre-quantized Hugging Face checkpoint, or None for a float one.

    Raises:
        ModelLoadError: a quantization method or layout infer does not load, with what it found.
    """
    q = raw.get("quantization_config") or raw.get("compression_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_scheme(q, source)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(q, source)
    if method == "gptq":
        return _gptq_scheme(q, source)
    if method == "awq":
        return _awq_scheme(q, source)
    raise ModelLoadError(source, f"quantization_config.quant_method {method!r} is not supported (fp8, "
                         "compressed-tensors, gptq, awq)")


def resolve_scheme(requested: str, stored: QuantScheme | None, source: Path) -> QuantScheme | None:
    """The scheme a model loads with: the checkpoint's own (``requested`` must be ``"none"``), or
    ``EngineConfig.quantization``'s online one.

    Raises:
        ModelLoadError: online quantization asked of a checkpoint that is already quantized.
    """
    if stored is not None:
        if requested not in ("none", None):
            raise ModelLoadError(source, f"the checkpoint is already quantized ({stored.format}, {stored.method}); "
                                 f"quantization={requested!r} would quantize it again: use quantization='none'")
        return stored
    return None if requested in ("none", None) else QuantScheme.online(requested)


#: AWQ's packing order: nibble j of a word holds column AWQ_ORDER[j] of its 8 (AutoAWQ's ``order_map``)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 ``[R, C / 8]`` (eight unsigned 4-bit values per word along C, :data:`AWQ_ORDER`) -> int8
    ``[R, C]``, each value minus 8 (infer's signed codes and zero points)."""
    by_nibble = qref.unpack_int4(packed.to(torch.int32))  # column 8 c + j: nibble j of word c
    out = torch.empty_like(by_nibble)
    out.view(out.shape[0], -1, 8)[:, :, list(AWQ_ORDER)] = by_nibble.view(out.shape[0], -1, 8)
    return out


def _as_tensor(w) -> torch.Tensor:
    return torch.as_tensor(w) if isinstance(w, torch.Tensor) else torch.from_numpy(np.require(w, requirements="W"))


class QuantizedParams:
    """The checkpoint tensors of the quantized projections: ``take(name, tensor)`` claims the ones that
    belong to a :class:`QuantizedLinear` and puts them on the device as its parameters; ``tensors`` holds
    them for ``load_state_dict`` (:func:`infer.loader.materialize`)."""

    def __init__(self, model: torch.nn.Module, scheme: QuantScheme, device: torch.device, dtype: torch.dtype,
                 source: Path) -> None:
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        self.scheme, self.device, self.dtype, self.source = scheme, device, dtype, source
        self.tensors: dict[str, torch.Tensor] = {}

    def take(self, name: str, w) -> bool:
        prefix, _, leaf = name.rpartition(".")
        module = self.modules.get(prefix)
        if module is None:
            return False
        t = _as_tensor(w)
        if leaf == "bias":
            self._shape(name, t, (module.out_features,))
            self.tensors[name] = t.to(device=self.device, dtype=self.dtype, copy=True)
        elif not self.scheme.prequantized:
            if leaf != "weight":
                raise ModelLoadError(self.source, f"unexpected tensor {name} in a float checkpoint")
            self._shape(name, t, (module.out_features, module.in_features))
            for leaf, q in module.quantized_tensors(t.to(device=self.device, dtype=torch.float32)).items():
                self._put(f"{prefix}.{leaf}", q, getattr(module, leaf))
        else:
            self._take_stored(prefix, leaf, t, module)
        return True

    def _take_stored(self, prefix: str, leaf: str, t: torch.Tensor, module: QuantizedLinear) -> None:
        """One tensor of a pre-quantized checkpoint, by its name in the format."""
        if self.scheme.format == "gguf":  # repacked into infer's layout already (infer.loader.gguf_quant)
            if leaf not in ("qweight", "weight_scale", "weight_zero_point") or getattr(module, leaf) is None:
                raise ModelLoadError(self.source, f"unexpected tensor {prefix}.{leaf} for a GGUF projection")
            self._put(f"{prefix}.{leaf}", t.to(self.device), getattr(module, leaf))
        elif self.scheme.format in ("gptq", "gptq_v2"):
            self._take_gptq(prefix, leaf, t, module)
        elif self.scheme.format == "awq":
            self._take_awq(prefix, leaf, t, module)
        elif leaf == "weight_packed" and module.method == "int8":  # 4 per int32, each stored + 128: one byte each
            t = t.to(self.device)
            shifts = torch.arange(0, 32, 8, device=t.device, dtype=torch.int32)
            t = (((t[:, :, None] >> shifts) & 0xFF) - 128).to(torch.int8).flatten(1)
            self._put(f"{prefix}.qweight", t, module.qweight)
        elif leaf in ("weight", "weight_packed"):  # fp8 / int8 values, or int4 packed 8 per int32 (our layout)
            self._put(f"{prefix}.qweight", t.to(self.device, copy=True), module.qweight)
        elif leaf in ("weight_scale_inv", "weight_scale"):
            s = t.to(device=self.device, dtype=torch.float32, copy=True)
            if s.numel() == 1:  # compressed-tensors' per-tensor strategy: one scale for every row
                s = s.reshape(1, 1).expand(module.weight_scale.shape).contiguous()
            self._put(f"{prefix}.weight_scale", s.reshape(module.weight_scale.shape)
                      if s.numel() == module.weight_scale.numel() else s, module.weight_scale)
        elif leaf == "weight_shape":
            if tuple(int(v) for v in t.tolist()) != (module.out_features, module.in_features):
                raise ModelLoadError(self.source, f"{prefix}.weight_shape {t.tolist()} differs from the config's "
                                     f"{[module.out_features, module.in_features]}")
        elif leaf == "weight_zero_point" and module.weight_zero_point is not None:  # packed along N: [N / 8, K / G]
            self._shape(f"{prefix}.weight_zero_point", t, (module.out_features // 8, module.weight_scale.shape[1]))
            z = qref.unpack_int4(t.to(torch.int32).t().contiguous()).t().contiguous()
            self._put(f"{prefix}.weight_zero_point", z.to(self.device), module.weight_zero_point)
        elif leaf == "weight_zero_point":
            if bool(t.ne(0).any()):
                raise ModelLoadError(self.source, f"{prefix}.weight_zero_point is not zero, but the config says the "
                                     "weights are symmetric")
        else:
            raise ModelLoadError(self.source, f"unexpected tensor {prefix}.{leaf} for a {self.scheme.format} "
                                 f"{self.scheme.method} projection")

    def _take_gptq(self, prefix: str, leaf: str, t: torch.Tensor, module: QuantizedLinear) -> None:
        """A GPTQ tensor (module docstring): ``qweight`` and ``scales`` transposed into infer's layout; the
        zero points and the group index checked, as they carry nothing a symmetric layout keeps."""
        n, k = module.out_features, module.in_features
        group = self.scheme.block_for(k)[1]
        if leaf == "qweight":
            self._shape(f"{prefix}.qweight", t, (k // 8, n))
            self._put(f"{prefix}.qweight", t.to(self.device).t().contiguous(), module.qweight)
        elif leaf == "scales":
            self._shape(f"{prefix}.scales", t, (k // group, n))
            self._put(f"{prefix}.weight_scale", t.to(device=self.device, dtype=torch.float32).t().contiguous(),
                      module.weight_scale)
        elif leaf == "qzeros":
            self._shape(f"{prefix}.qzeros", t, (k // group, n // 8))
            # the nibbles run along N here as along K in infer's int4 words: the same unpacking (value - 8);
            # format gptq stores the zero point minus one, modulo 16
            z = qref.unpack_int4(t.to(torch.int32))
            if self.scheme.format == "gptq":
                z = (z + 9) % 16 - 8
            if module.weight_zero_point is not None:
                self._put(f"{prefix}.weight_zero_point", z.t().contiguous().to(self.device), module.weight_zero_point)
            elif bool(z.ne(0).any()):
                raise ModelLoadError(self.source, f"{prefix}.qzeros: zero points other than the symmetric "
                                     "quantizer's 8, but the config says sym: true")
        elif leaf == "g_idx":
            if not torch.equal(t.to(torch.int64), torch.arange(k) // group):
                raise ModelLoadError(self.source, f"{prefix}.g_idx: act-order (desc_act) groups, whose inputs are "
                                     "not contiguous, are not supported")
        else:
            raise ModelLoadError(self.source, f"unexpected tensor {prefix}.{leaf} for a GPTQ int4 projection")

    def _take_awq(self, prefix: str, leaf: str, t: torch.Tensor, module: QuantizedLinear) -> None:
        """An AWQ tensor (module docstring): ``qweight`` and ``qzeros`` unpacked from AWQ's order along N, the
        weight repacked along K; ``scales`` transposed."""
        n, k = module.out_features, module.in_features
        group = self.scheme.block_for(k)[1]
        if leaf == "qweight":
            self._shape(f"{prefix}.qweight", t, (k, n // 8))
            q = awq_unpack(t.to(self.device))  # [K, N], signed
            self._put(f"{prefix}.qweight", qref.pack_int4(q.t().contiguous()), module.qweight)
        elif leaf == "qzeros":
            self._shape(f"{prefix}.qzeros", t, (k // group, n // 8))
            self._put(f"{prefix}.weight_zero_point", awq_unpack(t.to(self.device)).t().contiguous(),
                      module.weight_zero_point)
        elif leaf == "scales":
            self._shape(f"{prefix}.scales", t, (k // group, n))
            self._put(f"{prefix}.weight_scale", t.to(device=self.device, dtype=torch.float32).t().contiguous(),
                      module.weight_scale)
        else:
            raise ModelLoadError(self.source, f"unexpected tensor {prefix}.{leaf} for an AWQ int4 projection")

    def _shape(self, name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
        if tuple(t.shape) != tuple(want):
            raise ModelLoadError(self.source, f"tensor {name} has shape {tuple(t.shape)}, the config implies "
                                 f"{tuple(want)}")

    def _put(self, name: str, t: torch.Tensor, like: torch.nn.Parameter) -> None:
        self._shape(name, t, tuple(like.shape))
        if t.dtype != like.dtype:
            raise ModelLoadError(self.source, f"tensor {name} is {t.dtype}; a {self.scheme.method} projection "
                                 f"needs {like.dtype}")
        self.tensors[name] = t
