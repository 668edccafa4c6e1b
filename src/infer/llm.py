"""The offline API, in vLLM's shape::

    from infer import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    print(out[0].outputs[0].text)

    for delta in llm.generate_stream("Once upon a time", SamplingParams(max_tokens=32)):
        print(delta.outputs[0].delta_text, end="", flush=True)

    llm.chat([{"role": "user", "content": "Hi!"}])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from infer.chat import apply_chat_template
from infer.config import EngineConfig
from infer.engine import LLMEngine
from infer.errors import InvalidRequestError
from infer.lora import LoRARequest
from infer.outputs import RequestOutput
from infer.sampling import SamplingParams

Prompt = str | list[int]


class LLM:
    """Load a model once and generate from it.

    Args:
        model: short name, ``.gguf`` path or Hugging Face directory (default ``smollm2-135m``).
        **engine_config: any :class:`~infer.config.EngineConfig` field (``device``, ``dtype``,
            ``max_model_len``, ...).

    Raises:
        TypeError: for an unknown engine option; ValueError for an invalid one;
        :class:`~infer.errors.ModelLoadError` when the model cannot be loaded.
    """

    def __init__(self, model: str = "smollm2-135m", progress: bool = True, **engine_config: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_config)
        self.engine = LLMEngine(self.config, progress=progress)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def close(self) -> None:
        """Shut the engine down (:meth:`LLMEngine.shutdown`): the KV offload tiers released, a parallel
        engine's worker processes stopped and, with ``trace=PATH``, the step trace written. Idempotent;
        ``with LLM(...) as llm:`` calls it on leaving the block."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @staticmethod
    def _normalize(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        return list(prompts)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns finished outputs in prompt order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or one per prompt.
            use_tqdm: show a progress bar over requests.
            lora_request: the LoRA adapter (phase 16, ``enable_lora=True``) for every prompt, or one per
                prompt (None: the base model), vLLM's argument.

        Raises:
            InvalidRequestError: for a prompt or parameter the engine cannot serve; no request
                is queued in that case.
            EngineStepError: a step failed (a bug, a device error); this call's other requests
                are aborted too, and the engine stays usable.
        """
        items = self._normalize(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(items):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(items)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(items)
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != len(items):
                raise ValueError(f"{len(lora_request)} lora_requests for {len(items)} prompts")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(items)
        ids = []
        try:
            for p, sp, lora in zip(items, params, loras):
                ids.append(self.engine.add_request(p, sp, lora_request=lora).request_id)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(stream=False):
                    done[out.request_id] = out
                    bar.update(1)
        except BaseException:  # EngineStepError, KeyboardInterrupt: leave nothing of this call queued
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in ids]

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                        lora_request: LoRARequest | None = None) -> Iterator[RequestOutput]:
        """Yield a :class:`RequestOutput` per step with what is new (``delta_text`` etc.).

        Closing the iterator early aborts the request.
        """
        req = self.engine.add_request(prompt, sampling_params, lora_request=lora_request)
        finished = False
        try:
            while not finished:
                for out in self.engine.step(stream=True):
                    if out.request_id == req.request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(req.request_id)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate a reply (under the LoRA
        adapter ``lora_request``, phase 16, or the base model).

        Raises:
            ValueError: when the model has no chat template or a message is malformed.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.chat_prompt_ids(c, add_generation_prompt, **(chat_template_kwargs or {})) for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def chat_prompt_ids(self, messages, add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of a rendered conversation (the template writes its own BOS if any).

        Raises:
            ValueError: see :meth:`chat`; :class:`~infer.errors.InvalidRequestError` when the
                rendered text encodes to zero tokens.
        """
        text = apply_chat_template(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, **kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidRequestError("the chat template rendered these messages to zero tokens", param="messages")
        return ids
