"""vLLM's extra routes POST /tokenize and POST /detokenize (its request and response shapes).

The ingress holds no tokenizer: it authenticates the caller like the generate routes, resolves `model` like a
completion's (an adapter, chain or merge must exist and be the caller's to use; adapters share the base's
tokenizer), and asks some replica with one typed call (app/protocol.py's TokenizeCall -> TokenizeReply).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from app.errors import LoraLandError
from app.protocol import TokenizeCall, TokenizeReply
from app.router.http import openai_requests as bodies
from app.router.http.errors import error_reply
from app.router.routing.replica_client import call as replica_call


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # as vLLM: extras are ignored

    model: str = Field(max_length=bodies.MAX_MODEL_CHARS)
    prompt: str | None = None
    messages: list[bodies.ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: StrictBool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=bodies.MAX_MODEL_CHARS)
    tokens: list[StrictInt]


def _call_of(body: TokenizeBody) -> TokenizeCall:
    if (body.prompt is None) == (body.messages is None):
        raise bodies.invalid("prompt", "give exactly one of prompt (a string) or messages (a chat)")
    if body.messages is not None:
        messages = tuple(bodies.messages_of(body))  # type: ignore[arg-type]  # only .messages is read
        special = False if body.add_special_tokens is None else body.add_special_tokens
        return TokenizeCall(
            messages=messages,
            add_special_tokens=special,
            add_generation_prompt=body.add_generation_prompt,
        )
    special = True if body.add_special_tokens is None else body.add_special_tokens
    return TokenizeCall(text=body.prompt, add_special_tokens=special)


async def _ask(service: Any, call: TokenizeCall) -> TokenizeReply:
    reply = await replica_call(service.backend, "tokenize", call)
    if not isinstance(reply, TokenizeReply):
        raise LoraLandError(f"the replica answered tokenize with {type(reply).__name__}")
    return reply


def add_tokenize_routes(api: FastAPI, auth: Any, service: Any) -> None:
    """POST /tokenize {"model", "prompt" | "messages", ...} -> {"count", "max_model_len", "tokens"};
    POST /detokenize {"model", "tokens"} -> {"prompt"}. Errors are OpenAI-shaped."""

    async def answer(request: Request, detokenize: bool) -> Response:
        try:
            caller = auth.caller_for(request)
            data = bodies.parse_body(await request.body())
            if detokenize:
                dbody = bodies.validate_model(DetokenizeBody, data)
                await service.resolve(dbody.model, caller)
                reply = await _ask(service, TokenizeCall(tokens=tuple(dbody.tokens)))
                return JSONResponse({"prompt": reply.text})
            tbody = bodies.validate_model(TokenizeBody, data)
            await service.resolve(tbody.model, caller)
            reply = await _ask(service, _call_of(tbody))
            tokens = list(reply.tokens)
            return JSONResponse(
                {"count": len(tokens), "max_model_len": reply.max_model_len, "tokens": tokens}
            )
        except Exception as e:
            err = error_reply(e)
            return JSONResponse(err.body, status_code=err.status, headers=err.headers)

    async def tokenize(request: Request) -> Response:
        return await answer(request, detokenize=False)

    async def detokenize(request: Request) -> Response:
        return await answer(request, detokenize=True)

    api.add_api_route("/tokenize", tokenize, methods=["POST"], operation_id="tokenize")
    api.add_api_route("/detokenize", detokenize, methods=["POST"], operation_id="detokenize")
