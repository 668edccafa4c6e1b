"""The served model and its tokenizer: ``GET /v1/models``, ``GET /v1/models/{id}``, and vLLM's
``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (what lm-eval's remote
tokenizer uses). None of them generates, nor waits for the engine thread: the tokenizer runs on
the event loop.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from infer.lora import LoRARequest
from infer.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from infer.server.responses import error_response, openapi_responses
from infer.server.serving import ServerState, State, check_model, render_chat

router = APIRouter()


def model_card(state: ServerState) -> dict:
    """OpenAI's model object for the served model (vLLM adds ``max_model_len``)."""
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "infer",
            "max_model_len": state.engine.info.max_model_len}


def lora_card(state: ServerState, lora: LoRARequest) -> dict:
    """A LoRA adapter's model object (phase 16), as vLLM lists it: ``root`` its directory, ``parent``
    the served model."""
    return {**model_card(state), "id": lora.lora_name, "root": lora.lora_path, "parent": state.model_name}


@router.get("/v1/models", responses=openapi_responses(ModelList, "The served model and its LoRA adapters"))
async def models(state: State) -> JSONResponse:
    cards = [model_card(state)] + [lora_card(state, lora) for lora in list(state.loras.values())]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}", responses=openapi_responses(ModelCard, "The model", 404))
async def model(model_id: str, state: State) -> JSONResponse:
    lora = check_model(model_id, state)
    return JSONResponse(model_card(state) if lora is None else lora_card(state, lora))


def parse_tokenize(req: TokenizeRequest, state: ServerState) -> str:
    """The text ``/tokenize`` encodes: the prompt, or the messages rendered by the chat template.

    Raises:
        Reject: 404 for another model's name, 400 for messages the chat template refuses.
    """
    check_model(req.model, state)
    if isinstance(req, TokenizeChatRequest):
        return render_chat(state.tokenizer, req.message_dicts(), req.add_generation_prompt, req.chat_template_kwargs)
    return req.prompt


@router.post("/tokenize", responses=openapi_responses(TokenizeResponse, "The prompt's token ids", 400, 404, 413))
async def tokenize(req: TokenizeRequest, state: State) -> JSONResponse:
    text = parse_tokenize(req, state)
    ids = state.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    strs = [state.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": state.engine.info.max_model_len, "tokens": ids,
                         "token_strs": strs})


@router.post("/detokenize", responses=openapi_responses(DetokenizeResponse, "The text of the token ids", 400, 404,
                                                        413))
async def detokenize(req: DetokenizeRequest, state: State) -> JSONResponse:
    check_model(req.model, state)
    vocab = state.engine.info.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        return error_response(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)})


def tokenizer_info_body(state: ServerState) -> dict:
    """vLLM's ``/tokenizer_info``: the special tokens, the chat template and the lengths."""
    tokenizer = state.tokenizer
    specials = getattr(tokenizer, "special_tokens", None) or {}
    return {
        "tokenizer_class": type(tokenizer).__name__,
        **{k: specials.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")},
        "chat_template": getattr(tokenizer, "chat_template", None),
        "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False)),
        "model_max_length": state.engine.info.max_model_len,
        "vocab_size": state.engine.info.vocab_size,
    }


@router.get("/tokenizer_info", responses=openapi_responses(TokenizerInfoResponse, "The tokenizer's special tokens, "
                                                           "chat template and lengths"))
async def tokenizer_info(state: State) -> JSONResponse:
    return JSONResponse(tokenizer_info_body(state))

