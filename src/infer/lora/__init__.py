"""LoRA adapters served beside the base model (phase 16, ``EngineConfig.enable_lora``).

* :mod:`.request`: :class:`LoRARequest`, how a request names its adapter (vLLM's class);
* :mod:`.adapter`: reading a PEFT adapter directory, every unsupported case rejected with its reason;
* :mod:`.layers`: :class:`LoRALinear`, a projection plus its stack of adapter slots, and
  :class:`LoRAMapping`, the step's rows grouped by slot, shared by every layer;
* :mod:`.manager`: :class:`LoRAModelManager`, which adapter sits in which device slot (LRU, never
  evicting one a running request uses) and the LRU of adapters kept in host memory.

The kernels (shrink / expand over rows grouped by adapter) are in :mod:`infer.kernels.lora_triton`
and their plain-PyTorch twin :mod:`infer.kernels.lora_reference`.
"""

from infer.lora.adapter import LoRAAdapter, load_adapter
from infer.lora.layers import LoRALinear, LoRAMapping
from infer.lora.manager import LoRAModelManager
from infer.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRALinear", "LoRAMapping", "LoRAModelManager", "LoRARequest", "load_adapter"]
