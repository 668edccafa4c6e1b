"""infer: an educational, phased LLM inference engine (PyTorch + Triton).

Start at docs/index.md. The public API grows phase by phase; today:

* :class:`infer.LLM` and :class:`infer.SamplingParams`: the offline API, in vLLM's shape.
* :func:`infer.loader.load_model`: a checkpoint (HF directory, GGUF, short name) to a model.
* :class:`infer.config.EngineConfig`: every engine flag.
* ``python -m infer.server`` (OpenAI-compatible API) and ``python -m infer.generate`` (terminal).
"""

from infer.config import EngineConfig, ModelConfig
from infer.errors import InvalidRequestError, ModelLoadError
from infer.llm import LLM
from infer.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "InvalidRequestError", "ModelConfig", "ModelLoadError", "SamplingParams",
           "__version__"]
