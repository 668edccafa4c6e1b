"""The engine: what runs each step, where its KV cache lives, how it runs, and what it means.

One step of :class:`LLMEngine` is ``schedule() -> execute() -> process outputs`` (nano-vllm's
shape, vLLM v1's ``EngineCore.step``). The rooms, top to bottom:

* :mod:`.llm_engine`: the loop, requests in, :class:`~infer.outputs.RequestOutput` out (async
  scheduling's overlap loop too); :mod:`.executor` runs it over several ranks (phase 14).
* :mod:`.scheduler` decides *what* runs (which sequences, how many tokens each), with its admission
  policy from :mod:`.batching`; :mod:`.sequence` holds a request's state.
* :mod:`.kv_cache_manager` gives each sequence its block table over :mod:`.block_pool`;
  :mod:`.prefix_cache` keeps finished blocks by hash (phase 7); :mod:`.kv_offload` is the tier below
  (phase 10); :mod:`.memory` sizes the pool.
* :mod:`.model_runner` decides *how* a step runs (tensors, forward, sampling), reading the step
  through :mod:`.step`, replaying :mod:`.cuda_graphs` where a captured graph fits (phase 9).
* :mod:`.output_processor` turns sampled tokens into text, stop decisions and logprobs.
"""

from infer.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
