"""The OpenAI-compatible HTTP app (FastAPI): /v1/models, /v1/completions,
/v1/chat/completions, vLLM's /tokenize, /detokenize, /version and /ping, /health and
/metrics; with VLLM_SERVER_DEV_MODE=1, vLLM's dev route POST /reset_prefix_cache.

Until the engine is loaded /health and /v1 answer 503.  Request bodies are run only as
``application/json`` (else 415).  Every refusal is OpenAI's error JSON, and nothing a
request does can stop the server from serving the next one.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import os
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunklocal import __version__
from chunklocal.server import generate, params, prompts, responses
from chunklocal.server.metrics import ServerMetrics
from chunklocal.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from chunklocal.server.tool_choice import ToolRequestError, check_tools

log = logging.getLogger("chunklocal.server")


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None
    limits: params.ServeLimits = field(default_factory=params.ServeLimits)
    chat_template: str | None = None  # --chat-template (the text): instead of the tokenizer's
    tokenize_workers: int = 4
    # --enable-auto-tool-choice / --tool-call-parser: tool_choice "auto" parses the output.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


class ServerState:
    """What the routes share: the engine core (None until loaded) and the metrics."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.core = None
        self.vocab_size: int | None = None
        self.default_max_tokens: int | None = None  # generation_config's max_new_tokens
        self.decode_tokenizer = None
        self.shutting_down = False
        self.metrics = ServerMetrics(self, config.served_model_names[0])
        # Tokenizing a long prompt takes a while: off the event loop, on a few threads.
        self.tokenizers = prompts.TokenizerPool(config.tokenize_workers)

    def set_core(self, core) -> None:
        llm = getattr(core, "llm", None)
        self.vocab_size = getattr(core, "vocab_size", None) or getattr(
            getattr(llm, "config", None), "vocab_size", None)
        defaults = getattr(core, "default_sampling", None)  # an engine process's
        self.default_max_tokens = (defaults if defaults is not None else
                                   getattr(llm, "default_sampling", {})).get("max_tokens")
        # The event loop decodes logprob tokens while the tokenize threads encode: a fast
        # tokenizer must not be shared by two threads, so the loop gets its own copy.
        self.decode_tokenizer = copy.deepcopy(core.tokenizer)
        self.core = core

    def ready_core(self):
        if self.shutting_down:
            raise APIError("the server is shutting down", status=503, code="shutting_down")
        if self.core is None:
            raise APIError("the model is still loading", status=503, code="model_loading")
        return self.core


class _AuthMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would hide client disconnects from streams)."""

    def __init__(self, app, api_key: str | None, refused=None):
        self.app, self.expected = app, f"Bearer {api_key}".encode() if api_key else None
        self.refused = refused  # called once per 401 (the error counter)

    async def __call__(self, scope, receive, send):
        if (self.expected is not None and scope["type"] == "http"
                and scope["path"].startswith("/v1")):
            got = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
            if len(got) != 1 or not hmac.compare_digest(got[0], self.expected):
                why = ("more than one Authorization header" if len(got) > 1 else
                       "missing or wrong API key: send 'Authorization: Bearer KEY'")
                err = APIError(why, status=401, code="invalid_api_key",
                               type="invalid_request_error")
                if self.refused is not None:
                    self.refused()
                await JSONResponse(err.body(), status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _body(request: Request, limit: int) -> bytes:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":  # as vLLM: no form or text bodies (no CORS-free
        # cross-site POST from a browser page can send application/json)
        raise APIError("Unsupported Media Type: only 'application/json' is allowed, got "
                       f"{media_type or 'no Content-Type'!r}", status=415,
                       code="unsupported_media_type", type="invalid_request_error")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(f"request body of {declared} bytes exceeds the limit of {limit} bytes "
                       "(--max-request-bytes)", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(f"request body exceeds the limit of {limit} bytes "
                           "(--max-request-bytes)", code="request_too_large")
    return bytes(body)


def _parse(cls, body: bytes):
    try:
        return cls.model_validate_json(body)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"] if p not in ("str", "int", "list[int]"))
        shown = repr(first.get("input"))[:80] if first["type"] != "json_invalid" else ""
        raise APIError(f"invalid request body: {loc or 'body'}: {first['msg']}"
                       + (f", got {shown}" if shown else ""), param=loc or None) from err


def build_app(state: ServerState) -> FastAPI:
    cfg = state.config
    app = FastAPI(title="chunklocal", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    def model_of(req) -> str:
        if req.model is None:
            return cfg.served_model_names[0]
        if req.model not in cfg.served_model_names:
            raise APIError(f"model {req.model!r} is not served here (served: "
                           f"{', '.join(cfg.served_model_names)})", param="model",
                           code="model_not_found")
        return req.model

    async def read(request: Request, cls):
        body = await _body(request, cfg.limits.body_limit(
            getattr(state.core, "max_model_len", None)))
        if cls is None:  # /tokenize: messages or a prompt, as vLLM's union of the two
            try:
                chat = isinstance(data := json.loads(body), dict) and "messages" in data
            except ValueError:
                chat = False
            cls = TokenizeChatRequest if chat else TokenizeCompletionRequest
        req = _parse(cls, body)
        core = state.ready_core()
        model_of(req)
        params.warn_extra(req)
        return req, core

    async def prepare(request: Request, cls):
        req, core = await read(request, cls)
        model = model_of(req)
        params.check_fields(req)
        top = params.check_limits(req, cfg.limits)
        return req, core, model, top

    async def tokenize(request, fn, req, tokenizer, *args):
        return await state.tokenizers.run(request, fn, req, tokenizer, *args)

    async def answer(request, req, core, model, top, prompt_list, rid, chat, parser=None):
        first_call_only = chat and req.parallel_tool_calls is False
        kwargs = [params.sampling_kwargs(req, top, len(ids), core.max_model_len,
                                         state.default_max_tokens) for _, ids in prompt_list]
        streams = await generate.submit_async(core, prompt_list, kwargs, rid)
        tok = responses.TokenText(state.decode_tokenizer)
        observe = state.metrics.observe
        if req.stream:
            opts = req.stream_options
            st = responses.StreamState(chat, rid, model, req.n, tok, top,
                                       bool(opts and opts.include_usage),
                                       bool(opts and opts.continuous_usage_stats),
                                       parser, first_call_only)
            opening = st.role_chunks(req.n) if chat else ()
            return StreamingResponse(generate.sse(streams, st, observe, opening),
                                     media_type="text/event-stream")
        try:
            finals = await generate.collect(request, streams, observe)
        except asyncio.CancelledError:
            return Response(status_code=499)  # the client is gone; nobody reads this
        except Exception as err:  # a failed engine step fails its requests: say so
            log.exception("request %s failed in the engine", rid)
            raise APIError(f"generation failed: {type(err).__name__}: {err}", status=500,
                           code="engine_error") from err
        if state.shutting_down and any(o.finish_reason == "abort" for f in finals
                                       for o in f.outputs):
            raise APIError("the server is shutting down: the request was not completed",
                           status=503, code="shutting_down", type="shutting_down")
        body = (responses.chat_response(rid, model, finals[0], tok, top, parser,
                                        first_call_only) if chat
                else responses.completion_response(rid, model, finals, req.n, tok, top))
        return Response(body.model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, core, model, top = await prepare(request, CompletionRequest)
        prompt_list = await tokenize(request, prompts.completion_prompts, req, core.tokenizer,
                                     state.vocab_size, cfg.limits, core.max_model_len)
        return await answer(request, req, core, model, top, prompt_list,
                            f"cmpl-{uuid.uuid4().hex}", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, core, model, top = await prepare(request, ChatCompletionRequest)
        policy = params.tools_of(req, cfg.enable_auto_tool_choice, cfg.tool_call_parser)
        text, ids = await tokenize(request, prompts.chat_prompt, req, core.tokenizer,
                                   state.vocab_size, core.max_model_len, cfg.chat_template,
                                   policy.tools)
        return await answer(request, req, core, model, top, [(text, ids)],
                            f"chatcmpl-{uuid.uuid4().hex}", chat=True, parser=policy.parser)

    @app.get("/v1/models")
    async def models():
        max_len = getattr(state.core, "max_model_len", None)
        cards = [ModelCard(id=name, root=cfg.model_path, max_model_len=max_len)
                 for name in cfg.served_model_names]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        req, core = await read(request, None)
        if isinstance(req, TokenizeChatRequest):
            if req.chat_template is not None and not cfg.limits.trust_request_chat_template:
                raise APIError("a chat_template in the request is used only when the server "
                               "runs with --trust-request-chat-template", param="chat_template")
            try:
                tools = check_tools(req.tools)
            except ToolRequestError as err:
                raise APIError(str(err), param=err.param) from err
            _, ids = await tokenize(request, prompts.chat_prompt, req, core.tokenizer, None,
                                    None, cfg.chat_template, tools)
        else:
            ids = await tokenize(request, prompts.prompt_ids, req, core.tokenizer)
        tok = state.decode_tokenizer
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs and tok else None
        body = TokenizeResponse(count=len(ids), max_model_len=core.max_model_len, tokens=ids,
                                token_strs=strs)
        return Response(body.model_dump_json(), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        req, core = await read(request, DetokenizeRequest)
        text = await tokenize(request, prompts.detokenize, req, core.tokenizer,
                              state.vocab_size)
        return JSONResponse({"prompt": text})

    if os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip() not in ("", "0"):  # as vLLM
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():  # vLLM's dev route: 200 either way, a warning if not
            core = state.ready_core()  # an engine process's core has its own; else the LLM's
            reset = core.reset_prefix_cache if hasattr(core, "reset_prefix_cache") \
                else core.llm.reset_prefix_cache
            if not reset():
                log.warning("reset_prefix_cache: requests still hold KV blocks; nothing reset")
            return Response(status_code=200)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": __version__})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/health")
    async def health():
        if state.core is None or state.shutting_down:
            reason = "shutting down" if state.shutting_down else "loading"
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        state.metrics.http_errors.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(prompts.ClientGone)
    async def client_gone(request: Request, err: prompts.ClientGone):
        return Response(status_code=499)  # nobody reads this

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        state.metrics.http_errors.labels(str(err.status_code)).inc()
        body = APIError(str(err.detail), status=err.status_code).body()
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        state.metrics.http_errors.labels("500").inc()
        body = APIError(f"internal error: {type(err).__name__}: {err}", status=500).body()
        return JSONResponse(body, status_code=500)

    app.add_middleware(_AuthMiddleware, api_key=cfg.api_key,
                       refused=state.metrics.http_errors.labels("401").inc)
    return app
