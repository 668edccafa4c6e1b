"""Model architectures and the registry that maps a checkpoint to one.

``ARCHITECTURES`` maps Hugging Face ``model_type`` values to ``(model class, config
parser)``; the parser turns a ``config.json`` dict into a :class:`~infer.config.ModelConfig`.
"""

from __future__ import annotations

from infer.models.gemma3 import Gemma3ForCausalLM, gemma3_config
from infer.models.layers import CausalLM
from infer.models.llama import LlamaForCausalLM, llama_config
from infer.models.qwen3 import Qwen3ForCausalLM, qwen3_config
from infer.models.qwen3_5 import Qwen3_5ForCausalLM, qwen3_5_config
from infer.models.qwen3_moe import Qwen3MoeForCausalLM, qwen3_moe_config

ARCHITECTURES = {
    "llama": (LlamaForCausalLM, llama_config),
    "qwen3": (Qwen3ForCausalLM, qwen3_config),
    "gemma3_text": (Gemma3ForCausalLM, gemma3_config),
    "qwen3_moe": (Qwen3MoeForCausalLM, qwen3_moe_config),
    "qwen3_5_text": (Qwen3_5ForCausalLM, qwen3_5_config),
    "qwen3_5": (Qwen3_5ForCausalLM, qwen3_5_config),
}
# config.json "architectures" entries -> model_type
HF_CLASS_NAMES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
}
MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM, "gemma3": Gemma3ForCausalLM,
                 "qwen3_moe": Qwen3MoeForCausalLM, "qwen3_5": Qwen3_5ForCausalLM}

__all__ = ["ARCHITECTURES", "CausalLM", "HF_CLASS_NAMES", "MODEL_CLASSES"]
