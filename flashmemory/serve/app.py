"""create_app: the FastAPI application — routes, the API-key and body-size guard, and the error handlers.

Routes: GET /health, /version, /metrics, /v1/models; POST /v1/completions, /v1/chat/completions, /tokenize,
/detokenize. Every failure leaves through `error_response` as OpenAI-shaped JSON; clients never see a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashmemory.errors import FlashMemoryError
from flashmemory.serve.api_errors import APIError, error_response
from flashmemory.serve.body import parse_body
from flashmemory.serve.config import ServerConfig
from flashmemory.serve.generation import apply_chat_template, create_chat_completion, create_completion
from flashmemory.serve.metrics import ServerMetrics
from flashmemory.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    PreloadRequest,
    TokenizeRequest,
    check_prompt_ids,
)
from flashmemory.serve.state import ServerState
from flashmemory.serve.worker import EngineWorker
from flashmemory.version import __version__

logger = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health"})  # reachable without the API key (load balancers, probes)


class GuardMiddleware:
    """Pure ASGI guard in front of every route: the API key (constant-time compare) and the body-size cap."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS:
            error = self._check_key(headers.get(b"authorization"))
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await error_response(self._too_large(int(length)))(scope, receive, send)
            return
        await self.app(scope, self._capped(receive), send)

    def _check_key(self, authorization: bytes | None) -> APIError | None:
        if not authorization:
            return APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                            code="invalid_api_key")
        scheme, _, token = authorization.partition(b" ")
        # compare_digest takes time independent of where the strings differ; never log the key or the token.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return None

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"the request body is {size} bytes; this server accepts at most {self.max_body_bytes} "
                        "(--max-body-bytes)", code="request_too_large")

    def _capped(self, receive: Receive) -> Receive:
        """Count the body as it streams in (chunked uploads carry no Content-Length)."""
        received = 0

        async def wrapped() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large(received)
            return message

        return wrapped


def served_model_name(config: ServerConfig, model_path: str | None) -> str:
    if config.served_model_name:
        return config.served_model_name
    from flashmemory.model.loader import resolve_model_path

    path = resolve_model_path(model_path)
    return path.stem if path.suffix.lower() == ".gguf" else Path(path).name


def create_app(config: ServerConfig, engine_kwargs: dict[str, Any],
               engine_factory: Callable[[], Any] | None = None,
               on_load_failure: Callable[[str], None] | None = None,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The server for one engine; the engine loads in its own thread when the app starts (GET /health: 503 until
    it is ready)."""
    model_name = served_model_name(config, engine_kwargs.get("model_path"))
    metrics = ServerMetrics(model_name)
    if engine_factory is None:
        def engine_factory() -> Any:
            from flashmemory.engine.engine import FlashMemoryEngine

            return FlashMemoryEngine(**engine_kwargs)
    worker = EngineWorker(engine_factory, metrics, config.max_num_batched_tokens, config.stats_log_interval_s,
                          on_load_failure, on_fatal)
    state = ServerState(config, worker, metrics, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="FlashMemory", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(FlashMemoryError)
    async def on_typed_error(request: Request, e: FlashMemoryError) -> JSONResponse:
        # NOTE: typed errors need their own handler: the catch-all below runs in Starlette's outermost
        # middleware, which re-raises after answering, and uvicorn then drops the keep-alive connection.
        return error_response(APIError.from_exception(e))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        detail = e.detail if isinstance(e.detail, str) else None
        error = APIError.for_status(e.status_code, detail)
        error.headers = dict(e.headers or {})  # e.g. Allow on a 405
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, str(e.errors()[0].get("msg", "invalid request"))))

    @app.exception_handler(Exception)
    async def on_any_error(request: Request, e: Exception) -> JSONResponse:
        mapped = APIError.from_exception(e)
        if mapped.status >= 500:
            logger.error("error on %s %s", request.method, request.url.path, exc_info=e)
        return error_response(mapped)


# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones in a
# worker thread, so that the loop serves other requests and streams between parse_body's steps.
INLINE_BODY_BYTES = 64 * 1024


async def _json_body(request: Request, model: type) -> Any:
    raw = await request.body()
    if len(raw) <= INLINE_BODY_BYTES:
        return parse_body(raw, model)
    return await asyncio.to_thread(parse_body, raw, model)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        state.require_ready()
        # 200 either way: a degraded server still answers every request.
        return JSONResponse(state.worker.health)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        state.require_ready()
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "flashmemory",
                "root": str(state.worker.engine.model_path), "max_model_len": state.worker.engine.max_seq_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        state.require_ready()
        req = await _json_body(request, CompletionRequest)
        return await create_completion(state, request, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        state.require_ready()
        req = await _json_body(request, ChatCompletionRequest)
        return await create_chat_completion(state, request, req)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        state.require_ready()
        req = await _json_body(request, TokenizeRequest)
        state.check_model(req.model)
        engine = state.worker.engine
        if req.messages is not None:
            messages = req.chat_messages()
            ids = await asyncio.to_thread(apply_chat_template, state, messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "give either 'prompt' or 'messages'", param="prompt", code="invalid_value")
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_seq_len, "tokens": ids})

    @app.post("/v1/preload")
    async def preload(request: Request) -> Response:
        state.require_ready()
        req = await _json_body(request, PreloadRequest)
        state.check_model(req.model)
        given = [k for k in ("prompt", "messages", "session") if getattr(req, k) is not None]
        if len(given) != 1:
            raise APIError(400, "give one of 'prompt', 'messages' or 'session'", param="prompt",
                           code="invalid_value")
        ids = None
        if req.messages is not None:
            ids = await asyncio.to_thread(apply_chat_template, state, req.chat_messages(),
                                          req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await asyncio.to_thread(state.worker.engine.tokenizer.encode, req.prompt)
        future = state.worker.preload(ids, req.session, req.timeout_ms / 1e3)
        result = await asyncio.wrap_future(future)
        return JSONResponse({"object": "preload", **result.as_dict()})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        state.require_ready()
        req = await _json_body(request, DetokenizeRequest)
        state.check_model(req.model)
        engine = state.worker.engine
        if req.tokens:
            check_prompt_ids(req.tokens, engine.model_config.vocab_size, "tokens")
        text = await asyncio.to_thread(engine.tokenizer.decode, req.tokens)
        return JSONResponse({"prompt": text})
