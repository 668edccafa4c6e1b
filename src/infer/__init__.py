"""infer: an educational, phased LLM inference engine (PyTorch + Triton).

Start at docs/index.md. The public API grows phase by phase; today:

* :func:`infer.loader.load_model`: a checkpoint (HF directory, GGUF, short name) to a model.
* :class:`infer.config.EngineConfig`: every engine flag.
"""

from infer.config import EngineConfig, ModelConfig
from infer.errors import ModelLoadError

__version__ = "0.1.0"

__all__ = ["EngineConfig", "ModelConfig", "ModelLoadError", "__version__"]
