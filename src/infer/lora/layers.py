"""LoRA-wrapped projections: the base ``nn.Linear`` plus a stack of adapter slots.

Every adaptable projection of the model (q/k/v/o, gate/up/down) is replaced, once at start-up, by a
:class:`LoRALinear` holding the base layer (its weights untouched: nothing is merged) and two
zero-initialized buffers, ``lora_a [L, R, in]`` and ``lora_b [L, out, R]`` (``L = max_loras`` slots,
``R = max_lora_rank``). Loading an adapter into slot ``l`` copies its A and (scaled) B into row ``l`` of
every projection it changes and zeros the others. The forward is the base product, then the LoRA
delta of each row's slot, added in place::

    y = x W^T (+ b)                    every row, one GEMM, as without LoRA
    y[t] += (x[t] A_l^T) B_l^T         rows t of slot l, grouped by slot (infer.kernels.lora_*)

Which row uses which slot is one :class:`LoRAMapping` shared by every layer, set once per step by the
model runner (vLLM's ``PunicaWrapper``, its "LoRA mapping").
"""

from __future__ import annotations

import torch
from torch import nn

from infer.kernels.lora_reference import LoRAKernelMeta, make_lora_meta
from infer.lora.adapter import ATTENTION_PROJS, MLP_PROJS
from infer.models.layers import GatedMLP


class LoRAMapping:
    """The step's rows grouped by adapter slot, read by every :class:`LoRALinear` of the model.

    Args:
        ops: the module whose ``add_lora`` runs (:func:`infer.kernels.lora_ops`).
        num_slots: ``max_loras``.
    """

    def __init__(self, ops, num_slots: int) -> None:
        self.ops = ops
        self.num_slots = num_slots
        self.meta: LoRAKernelMeta | None = None  # None: no row has an adapter (the layers add nothing)

    def set(self, token_slots: list[int], device: torch.device) -> None:
        """Set the step's per-row slots (``[T]``, -1 for a row without adapter)."""
        self.meta = make_lora_meta(token_slots, self.num_slots, device) if any(s >= 0 for s in token_slots) else None

    def clear(self) -> None:
        self.meta = None

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """``y`` plus each row's adapter delta (in place); ``y`` unchanged without any."""
        meta = self.meta
        if meta is None:
            return y
        if meta.num_tokens != x.shape[0]:
            raise RuntimeError(f"the LoRA mapping is for {meta.num_tokens} rows, the forward has {x.shape[0]}")
        return self.ops.add_lora(y, x, lora_a, lora_b, meta)


class LoRALinear(nn.Module):
    """A projection with ``max_loras`` adapter slots (see the module docstring).

    Args:
        base: the model's ``nn.Linear`` (kept as ``base_layer``, unchanged).
        max_loras, max_lora_rank: the slots and their width.
        mapping: the model's shared :class:`LoRAMapping`.

    Shapes: ``x [T, in]`` -> ``[T, out]``.
    """

    def __init__(self, base: nn.Linear, max_loras: int, max_lora_rank: int, mapping: LoRAMapping) -> None:
        super().__init__()
        self.base_layer = base
        w = base.weight
        self.in_features, self.out_features = base.in_features, base.out_features
        kw = dict(dtype=w.dtype, device=w.device)
        self.register_buffer("lora_a", torch.zeros(max_loras, max_lora_rank, self.in_features, **kw),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_lora_rank, **kw),
                             persistent=False)
        self.mapping = mapping

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mapping.apply(self.base_layer(x), x, self.lora_a, self.lora_b)

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's ``(A [r, in], B [out, r])`` in ``slot`` (the rank padded with zeros), or zeros
        (``None``: the adapter leaves this projection alone)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if weights is not None:
            a, b = weights
            r = a.shape[0]
            self.lora_a[slot, :r].copy_(a)
            self.lora_b[slot, :, :r].copy_(b)


def add_lora_layers(model: nn.Module, max_loras: int, max_lora_rank: int, mapping: LoRAMapping
                    ) -> dict[tuple[int, str], LoRALinear]:
    """Replace every adaptable projection of ``model`` (a :class:`~infer.models.layers.CausalLM`) by a
    :class:`LoRALinear`; an MoE block's experts are left alone.

    Returns:
        ``{(layer index, projection name): the LoRALinear}``. Idempotent.
    """
    layers: dict[tuple[int, str], LoRALinear] = {}
    for i, layer in enumerate(model.model.layers):
        modules = [(layer.self_attn, ATTENTION_PROJS)]
        if isinstance(layer.mlp, GatedMLP):
            modules.append((layer.mlp, MLP_PROJS))
        for module, names in modules:
            for name in names:
                proj = getattr(module, name)
                if not isinstance(proj, LoRALinear):
                    proj = LoRALinear(proj, max_loras, max_lora_rank, mapping)
                    setattr(module, name, proj)
                layers[(i, name)] = proj
    return layers
