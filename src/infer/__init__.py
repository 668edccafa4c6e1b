"""infer: an educational, phased LLM inference engine (PyTorch + Triton).

Start at docs/index.md. The public API grows phase by phase; today:

* :class:`infer.LLM` and :class:`infer.SamplingParams`: the offline API, in vLLM's shape.
* :func:`infer.loader.load_model`: a checkpoint (HF directory, GGUF, short name) to a model.
* :class:`infer.config.EngineConfig`: every engine flag.
* ``python -m infer.server`` (OpenAI-compatible API) and ``python -m infer.generate`` (terminal).
"""

import os

# OpenMP's default "active" wait makes idle compute threads spin; when another process shares
# the cores (a test server, a benchmark client, CI), a spinning team and the busy process
# preempt each other and CPU decode became up to 10x slower in our measurements. Passive
# waiting costs nothing measurable here and removes that. Only effective before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from infer.config import EngineConfig, ModelConfig  # noqa: E402
from infer.errors import InvalidRequestError, ModelLoadError  # noqa: E402
from infer.llm import LLM  # noqa: E402
from infer.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "InvalidRequestError", "ModelConfig", "ModelLoadError", "SamplingParams",
           "__version__"]
