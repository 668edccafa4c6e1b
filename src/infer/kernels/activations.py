"""The gated MLP's activations by Hugging Face's ``hidden_act`` names, in plain PyTorch.

SiLU for SwiGLU (Llama, Qwen; Shazeer, arXiv:2002.05202) and tanh-approximated GELU for GeGLU
(Gemma). The Triton kernels compute the same two functions in float32
(:func:`infer.kernels.triton_common.silu_or_gelu_tanh`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "ACTIVATION_NAMES", "gelu_tanh"]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Hendrycks & Gimpel, arXiv:1606.08415), as Gemma uses it."""
    return F.gelu(x, approximate="tanh")


#: ``hidden_act`` name -> the activation function.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_tanh": gelu_tanh,
}

#: ``hidden_act`` name -> the kernels' name for it (``"silu"`` or ``"gelu_tanh"``).
ACTIVATION_NAMES = {"silu": "silu", "gelu_tanh": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
