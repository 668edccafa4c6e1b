"""How a request names its LoRA adapter (vLLM's ``LoRARequest``, same argument names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request: ``LLM.generate(prompts, params, lora_request=LoRARequest(...))``.

    Args:
        lora_name: the adapter's name (the server's ``model`` field selects it by this name).
        lora_int_id: a positive integer unique to this adapter: the engine's key for it (its slot, its
            host cache entry and its prefix-cache blocks). Two different adapters must not share one.
        lora_path: the PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    Raises:
        ValueError: an empty name, or an id < 1.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest: lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path (the adapter directory) is required")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
