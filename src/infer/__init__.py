"""infer: an educational, phased LLM inference engine (PyTorch + Triton).

Start at docs/index.md. The public API grows phase by phase; today:

* :class:`infer.LLM` and :class:`infer.SamplingParams`: the offline API, in vLLM's shape.
* :func:`infer.loader.load_model`: a checkpoint (HF directory, GGUF, short name) to a model.
* :class:`infer.config.EngineConfig`: every engine flag.
* ``python -m infer.server`` (OpenAI-compatible API) and ``python -m infer.generate`` (terminal).
"""

import os

# How torch's OpenMP workers (libgomp) wait between parallel regions. Its default spins for
# ~300,000 iterations (about a millisecond); when another process shares the cores (a test server,
# a benchmark client, CI), a spinning team and the busy process preempt each other, and CPU decode
# became up to 10x slower in our measurements. Not spinning at all (OMP_WAIT_POLICY=PASSIVE) makes
# every region pay for waking its worker, ~40-60 us, hundreds of times per decode step: the split
# one-row products of the fused forward (infer.kernels.fused_reference.linear) ran at 27 instead
# of 19 ms per SmolLM2 token. A short spin keeps the worker awake between the back-to-back
# operations of a step and lets it sleep as soon as the engine pauses. Only effective before torch
# loads; an OMP_WAIT_POLICY or GOMP_SPINCOUNT of the user's wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from infer.config import EngineConfig, ModelConfig  # noqa: E402
from infer.errors import InvalidRequestError, ModelLoadError  # noqa: E402
from infer.llm import LLM  # noqa: E402
from infer.lora import LoRARequest  # noqa: E402
from infer.sampling import RequestOutputKind, SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "InvalidRequestError", "LoRARequest", "ModelConfig", "ModelLoadError", "RequestOutputKind",
           "SamplingParams", "__version__"]
