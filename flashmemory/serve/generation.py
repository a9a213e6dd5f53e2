"""The generation endpoints: validate and tokenize a request, hand its sequences to the engine thread, and answer
with one JSON body or with server-sent events; a client that goes away aborts its sequences."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from flashmemory.serve.api_errors import APIError
from flashmemory.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_prompt_ids,
    resolve_max_tokens,
    sampling_params,
)
from flashmemory.serve.state import ServerState
from flashmemory.engine.request import SequenceOutput, SequenceRequest
from flashmemory.engine.sampling import choice_seed

_POLL_S = 1.0  # how often a waiting request checks that the engine is still alive
DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected; its sequences were aborted."""


class _Ended:
    """Queued to a RequestStream that the server ends (at shutdown) before its sequences finish."""

    def __init__(self, error: APIError) -> None:
        self.error = error


class RequestStream:
    """Event-loop side of one API request: its sequences' ids, the queue their outputs arrive on, abort.

    NOTE: a sequence stops counting as pending when the engine reports it done, not when a consumer reads
    that report, so a response that never started streaming (client gone before the headers) leaks nothing.
    """

    def __init__(self, state: ServerState, num_seqs: int) -> None:
        self.state = state
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[SequenceOutput | _Ended | None] = asyncio.Queue()
        self.num_seqs = num_seqs
        self.seq_ids: list[int] = []
        self.finished: set[int] = set()  # choice indices whose last output was consumed
        self._done: set[int] = set()  # choice indices the engine has finished (or failed)
        self._closed = False

    def push(self, out: SequenceOutput) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, out)
        except RuntimeError:
            pass  # the event loop is gone (server shutting down): nobody is listening

    def _deliver(self, out: SequenceOutput) -> None:
        if (out.finish_reason is not None or out.error is not None) and out.index not in self._done:
            self._done.add(out.index)
            if not self._closed:
                self.state.release(1)
        self.queue.put_nowait(out)

    def submit(self, requests: list[SequenceRequest]) -> None:
        self.state.reserve(len(requests))
        self.seq_ids = self.state.worker.submit(requests, self.push)
        self.state.streams.add(self)

    def end(self, error: APIError) -> None:
        """End the request with `error` (its consumer raises it; closing then aborts what is unfinished)."""
        self.queue.put_nowait(_Ended(error))

    async def outputs(self) -> AsyncIterator[SequenceOutput]:
        while len(self.finished) < self.num_seqs:
            try:
                out = await asyncio.wait_for(self.queue.get(), timeout=_POLL_S)
            except TimeoutError:
                if self.state.worker.state != "ready":
                    raise APIError(503, "the engine stopped while this request was running",
                                   code="engine_dead") from None
                continue
            if out is None:
                raise ClientGone()
            if isinstance(out, _Ended):
                raise out.error
            if out.error is not None:
                self.finished.add(out.index)
                raise APIError(500, out.error, code="generation_failed")
            if out.finish_reason is not None:
                self.finished.add(out.index)
            yield out

    def client_disconnected(self) -> None:
        self.close()
        self.queue.put_nowait(None)

    def close(self) -> None:
        """Abort whatever the engine has not finished and stop counting it as pending (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.state.streams.discard(self)
        unfinished = [sid for i, sid in enumerate(self.seq_ids) if i not in self._done]
        if unfinished:
            self.state.worker.abort(unfinished)
            self.state.release(len(unfinished))


async def _watch_disconnect(request: Request, stream: RequestStream) -> None:
    """Wait for the client to hang up (the body is already read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.client_disconnected()
            return


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _check_common(state: ServerState, req: CompletionRequest | ChatCompletionRequest) -> None:
    state.check_model(req.model)
    req.check_supported()
    if req.stream and not state.config.enable_streaming:
        raise APIError(400, "streaming is disabled on this server (started without --enable-streaming); send "
                       "stream=false", param="stream", code="streaming_disabled")
    if not 1 <= req.n <= state.config.max_n:
        raise APIError(400, f"n must be between 1 and {state.config.max_n} (--max-n), got {req.n}", param="n",
                       code="invalid_value")


def _sequence_requests(state: ServerState, req: CompletionRequest | ChatCompletionRequest,
                       prompts: list[list[int]], kind: str, arrival_s: float) -> list[SequenceRequest]:
    engine = state.worker.engine
    out = []
    param = "messages" if kind == "chat" else "prompt"
    for p_index, ids in enumerate(prompts):
        check_prompt_ids(ids, engine.model_config.vocab_size, param)
        max_tokens = resolve_max_tokens(len(ids), req.requested_max_tokens(), engine.max_seq_len,
                                        state.config.max_tokens_limit, kind)
        reason = state.worker.scheduler.unfit_reason(len(ids) + max_tokens)
        if reason is not None:
            raise APIError(400, reason, param="max_tokens", code="kv_capacity_exceeded")
        for j in range(req.n):
            seed = None if req.seed is None else choice_seed(req.seed, j)  # distinct choices, reproducible
            out.append(SequenceRequest(p_index * req.n + j, ids, sampling_params(req, max_tokens, seed), arrival_s))
    return out


async def create_completion(state: ServerState, request: Request, req: CompletionRequest) -> Response:
    arrival_s = time.perf_counter()
    _check_common(state, req)
    tokenizer = state.worker.engine.tokenizer

    def tokenize() -> list[list[int]]:
        return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in req.prompts()]

    prompts = await asyncio.to_thread(tokenize)
    if not prompts:
        raise APIError(400, "the prompt is empty: give at least one token", param="prompt", code="invalid_value")
    seqs = _sequence_requests(state, req, prompts, "completion", arrival_s)
    num_prompt_tokens = sum(len(p) for p in prompts)
    return await _respond(state, request, req, seqs, num_prompt_tokens, kind="completion")


async def create_chat_completion(state: ServerState, request: Request, req: ChatCompletionRequest) -> Response:
    arrival_s = time.perf_counter()
    _check_common(state, req)
    messages = req.chat_messages()
    ids = await asyncio.to_thread(apply_chat_template, state, messages, req.add_generation_prompt)
    seqs = _sequence_requests(state, req, [ids], "chat", arrival_s)
    return await _respond(state, request, req, seqs, len(ids), kind="chat")


def apply_chat_template(state: ServerState, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    from flashmemory.errors import FlashMemoryError

    tokenizer = state.worker.engine.tokenizer
    if not tokenizer.has_chat_template:  # a base model: chat has no meaning for it
        raise APIError(400, f"{state.model_name} has no chat template (a base model): send "
                       "the text as 'prompt' to POST /v1/completions instead of 'messages'",
                       param="messages", code="invalid_value")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except FlashMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a Jinja template that rejects the messages is the client's problem
        raise APIError(400, f"the model's chat template rejected the messages: {e}", param="messages",
                       code="invalid_value") from None


async def _respond(state: ServerState, request: Request, req: CompletionRequest | ChatCompletionRequest,
                   seqs: list[SequenceRequest], num_prompt_tokens: int, kind: str) -> Response:
    stream = RequestStream(state, len(seqs))
    stream.submit(seqs)  # 503 when the queue is full
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    meta = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    if req.stream:
        events = _stream_events(request, stream, req, meta, num_prompt_tokens, kind)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          "X-Request-Id": meta["id"]})
    watcher = asyncio.create_task(_watch_disconnect(request, stream))
    texts, num_completion_tokens = [""] * len(seqs), 0
    ends: list[dict[str, Any]] = [{"finish_reason": None} for _ in seqs]
    try:
        async for out in stream.outputs():
            texts[out.index] += out.text
            num_completion_tokens += out.num_new_tokens
            if out.finish_reason is not None:
                ends[out.index] = _finish(out)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the status shows in the access log
    finally:
        watcher.cancel()
        stream.close()
    if kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    **end} for i, (t, end) in enumerate(zip(texts, ends))]
        body = {**meta, "object": "chat.completion", "choices": choices}
    else:
        choices = [{"index": i, "text": t, "logprobs": None, **end}
                   for i, (t, end) in enumerate(zip(texts, ends))]
        body = {**meta, "object": "text_completion", "choices": choices}
    body["usage"] = _usage(num_prompt_tokens, num_completion_tokens)
    return JSONResponse(body, headers={"X-Request-Id": meta["id"]})


def _finish(out: SequenceOutput) -> dict[str, Any]:
    """A choice's finish_reason, and vLLM's stop_reason where a guardrail says what it flagged."""
    if out.stop_reason is None:
        return {"finish_reason": out.finish_reason}
    return {"finish_reason": out.finish_reason, "stop_reason": out.stop_reason}


async def _stream_events(request: Request, stream: RequestStream, req: CompletionRequest | ChatCompletionRequest,
                         meta: dict[str, Any], num_prompt_tokens: int, kind: str) -> AsyncIterator[str]:
    """SSE: `data: {chunk}` per piece of text, finish_reason on each choice's last chunk, an optional usage chunk
    (empty choices), and always `data: [DONE]` — after an error too."""
    watcher = asyncio.create_task(_watch_disconnect(request, stream))
    include_usage = req.include_usage
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(choices: list[dict[str, Any]]) -> str:
        payload = {**meta, "object": obj, "choices": choices}
        if include_usage:
            payload["usage"] = None
        return _sse(payload)

    num_completion_tokens = 0
    try:
        try:
            if kind == "chat":
                for i in range(stream.num_seqs):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            async for out in stream.outputs():
                num_completion_tokens += out.num_new_tokens
                if not out.text and out.finish_reason is None:
                    continue
                if kind == "chat":
                    delta = {"content": out.text} if out.text else {}
                    choice = {"index": out.index, "delta": delta, "logprobs": None, **_finish(out)}
                else:
                    choice = {"index": out.index, "text": out.text, "logprobs": None, **_finish(out)}
                yield chunk([choice])
            if include_usage:
                yield _sse({**meta, "object": obj, "choices": [],
                            "usage": _usage(num_prompt_tokens, num_completion_tokens)})
        except APIError as e:
            yield _sse(e.body())
        yield DONE
    except ClientGone:
        return
    finally:
        watcher.cancel()
        stream.close()
