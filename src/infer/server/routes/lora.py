"""LoRA adapters at runtime (phase 16): vLLM's ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, included only when the engine runs with ``enable_lora`` (vLLM
exposes them behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

A loaded adapter is served under its ``lora_name``: requests select it with ``model`` and
``GET /v1/models`` lists it with its ``parent``. Loading reads and checks the adapter at once (an
adapter the engine cannot serve is refused with the reason, 400); unloading an adapter that requests
in flight still use is refused (400: unload it when they finish), so no running request loses its
weights and no slot is reused early. Each load gets a new ``lora_int_id``: blocks cached under an
unloaded adapter can never be hit by a later one of the same name.
"""

from __future__ import annotations

import functools
import operator

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from infer.errors import InvalidRequestError
from infer.lora import LoRARequest
from infer.server.async_engine import EngineDead
from infer.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from infer.server.responses import error_response, text_responses
from infer.server.serving import State

router = APIRouter()


def load_adapter(lora: LoRARequest, eng) -> None:
    """Run by the engine (its thread or process): load ``lora``; nothing comes back (the adapter's weights
    stay with the engine)."""
    eng.add_lora(lora)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
             responses=text_responses("The adapter is loaded and served under lora_name", 400, 503))
async def load_lora_adapter(req: LoadLoRAAdapterRequest, state: State) -> Response:
    name = req.lora_name
    if name in state.loras or name == state.model_name:
        return error_response(400, f"The lora adapter {name!r} has already been loaded.", "lora_name")
    lora = LoRARequest(name, state.next_lora_id, req.lora_path)
    state.next_lora_id += 1
    try:
        await state.engine.call(functools.partial(load_adapter, lora))
    except InvalidRequestError as e:
        return error_response(400, str(e), "lora_path")
    except EngineDead:
        return error_response(503, "the engine is not running", None, "server_unavailable")
    if name in state.loras:  # loaded meanwhile by a concurrent call
        return error_response(400, f"The lora adapter {name!r} has already been loaded.", "lora_name")
    state.loras[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
             responses=text_responses("The adapter is no longer served", 400, 404, 503))
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, state: State) -> Response:
    name = req.lora_name
    lora = state.loras.get(name)
    if lora is None:
        return error_response(404, f"The lora adapter {name!r} cannot be found.", "lora_name", "not_found_error",
                              "model_not_found")
    try:
        await state.engine.call(operator.methodcaller("remove_lora", lora.lora_int_id))
    except InvalidRequestError as e:
        return error_response(400, str(e), "lora_name")
    except EngineDead:
        return error_response(503, "the engine is not running", None, "server_unavailable")
    state.loras.pop(name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
