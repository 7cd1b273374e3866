"""The FastAPI application: endpoints, limits, errors (OpenAI's JSON), streaming, cancellation.

Built by :func:`create_app` from a :class:`ServerState`; ``launch/serve.py``
runs it with uvicorn on rank 0 while the engine loop thread steps the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tpguide.engine.text_check import find_invalid_text
from tpguide.serving.engine_loop import EngineDead, EngineLoop
from tpguide.serving.errors import APIError, bad_request
from tpguide.serving.metrics import ServerMetrics
from tpguide.serving.protocol import ParsedRequest, parse_request
from tpguide.serving.receipts import check_guides, receipt_of, wants_receipt
from tpguide.serving.responses import TokenText, build_answer, error_of, usage
from tpguide.serving.responses_api import add_responses_routes
from tpguide.serving.sse import ChatEvents, ChoiceStream, chunk
from tpguide.serving.tokenize_api import add_tokenize_routes
from tpguide.serving.tool_formats import ToolSetup, hermes


@dataclass
class ServerState:
    """Everything the endpoints need (rank 0).

    Attributes
    ----------
    loop : EngineLoop
    tokenizer : transformers tokenizer
    served_model_name : str
    metrics : ServerMetrics
    max_num_seqs, max_waiting_requests : int
        More than ``max_num_seqs + max_waiting_requests`` requests in flight -> 503.
    default_max_tokens : int
    max_model_len : int
    guided_backend : str
    api_key : str or None
    max_body_bytes : int
    tool_format : ToolSetup
        The call format and whether the chat template renders tools (docs/tool-calls.md).
    precompile : callable, optional
        ``precompile(line_dict)`` compiles a request's guide into the engine's
        cache; run in a worker thread before the request joins the batch.
    shutting_down : bool
        Set on SIGINT / SIGTERM before the engine loop aborts the running
        requests: their answers are then 503 "shutting down", not 499.
    return_receipts : bool
        ``--return-receipts``: every answer carries its receipts, asked or not (docs/receipts.md).
    guide_check : callable, optional
        ``structured_output -> report`` for ``POST /v1/guides/check``
        (:func:`tpguide.serving.server.make_guide_check`); None: 503 until set.
    """

    loop: EngineLoop
    tokenizer: Any
    served_model_name: str
    metrics: ServerMetrics
    max_num_seqs: int
    max_waiting_requests: int
    default_max_tokens: int
    max_model_len: int
    guided_backend: str = "xgrammar"
    api_key: Optional[str] = None
    max_body_bytes: int = 4 * 1024 * 1024
    tool_format: ToolSetup = field(default_factory=lambda: ToolSetup(hermes()))
    precompile: Optional[Callable[[Dict[str, Any]], None]] = None
    retry_after_s: int = 1
    shutting_down: bool = False
    return_receipts: bool = False
    guide_check: Optional[Callable[[Any], Dict[str, Any]]] = None
    _index: Any = field(default_factory=itertools.count)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_json(), status_code=err.status, headers=err.headers)


def create_app(state: ServerState) -> FastAPI:
    """The OpenAI-compatible app over ``state`` (see the module docstring)."""
    from tpguide.engine.request_io import request_from_dict

    app = FastAPI(title="tpguide", docs_url=None, redoc_url=None)
    token_text = TokenText(state.tokenizer)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, err: APIError):
        return _error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception):
        """A bug in a handler: OpenAI's error object with a 500 naming the exception, not a plain-text page
        (the traceback goes to stderr); the server and the other requests go on."""
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        return _error_response(APIError(500, f"server error: {type(exc).__name__}: {exc}", "server_error",
                                        code="server_fault"))

    app.add_middleware(_LimitsMiddleware, api_key=state.api_key, max_body_bytes=state.max_body_bytes)

    @app.get("/health")
    async def health():
        body = state.loop.health()  # data parallel: each replica's status too
        return body if body["status"] != "dead" else JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics():
        body, ctype = state.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "tpguide", "max_model_len": state.max_model_len}]}

    async def _body(request: Request) -> Any:
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > state.max_body_bytes:
                raise _too_large(len(raw), state.max_body_bytes)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise bad_request(f"the request body is not valid JSON: {type(exc).__name__}: {exc}") from exc
        invalid = find_invalid_text(body)  # a lone surrogate: refused here, naming the client's field
        if invalid is not None:
            raise bad_request(invalid)
        return body

    async def _handle(request: Request, endpoint: str, call: Any = None):
        """Run one request; ``call`` (e.g. a Responses call) parses the body and writes the answer instead."""
        rid = call.response_id if call is not None else ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        try:
            body = await _body(request)
            parsed = call.parse(body) if call is not None else parse_request(body, endpoint, rid, state.guided_backend,
                                                                             state.tool_format)
            with_receipts = call is None and wants_receipt(body, state.return_receipts)  # chat and completions
        except APIError as err:
            state.metrics.failed.labels(error_kind="invalid_request").inc()
            raise err
        if parsed.model != state.served_model_name:
            raise APIError(404, f"the model {parsed.model!r} does not exist; this server serves "
                                f"{state.served_model_name!r}", "not_found_error", "model", "model_not_found")
        reqs = []
        for line in parsed.lines:
            try:
                req = request_from_dict(line, next(state._index), state.default_max_tokens)
            except (ValueError, TypeError) as exc:
                state.metrics.failed.labels(error_kind="invalid_request").inc()
                raise bad_request(str(exc)) from exc
            if req.is_finished:
                state.metrics.failed.labels(error_kind="invalid_request").inc()
                raise bad_request(req.error or "bad request")
            reqs.append(req)
        limit = state.max_num_seqs + state.max_waiting_requests
        if state.loop.num_in_flight + len(reqs) > limit:
            state.metrics.failed.labels(error_kind="queue_full").inc()
            raise APIError(503, f"too many requests in flight (limit {limit}: --max-num-seqs "
                                f"{state.max_num_seqs} + --max-waiting-requests {state.max_waiting_requests}); "
                                "retry later", "server_error", code="queue_full",
                           headers={"Retry-After": str(state.retry_after_s)})
        if state.precompile is not None and "structured_output" in parsed.lines[0]:
            try:
                await asyncio.to_thread(state.precompile, parsed.lines[0])
            except ValueError as exc:
                state.metrics.failed.labels(error_kind="invalid_request").inc()
                raise bad_request(str(exc)) from exc
        try:
            q = state.loop.submit(reqs, stream=parsed.stream)
        except EngineDead as exc:
            state.metrics.failed.labels(error_kind="engine_dead").inc()
            raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
        ids = [r.request_id for r in reqs]
        if parsed.stream:
            return await _stream(request, parsed, rid, ids, q, call, with_receipts)
        outputs = await _collect(request, ids, q)
        if call is not None:
            return call.answer(parsed, outputs, token_text)
        answer = build_answer(parsed, rid, outputs, token_text)
        if with_receipts:  # docs/receipts.md
            for choice, out in zip(answer["choices"], outputs):
                choice["receipt"] = receipt_of(out, parsed.tools)
        return answer

    async def _collect(request: Request, ids: List[str], q: asyncio.Queue) -> List[Any]:
        finals: Dict[str, Any] = {}
        watcher = asyncio.create_task(_abort_on_disconnect(request, state.loop, ids))
        try:
            while len(finals) < len(ids):
                item = await q.get()
                if isinstance(item, EngineDead):
                    raise APIError(503, str(item), "server_error", code="engine_dead")
                if item.finish_reason == "abort":
                    if state.shutting_down:
                        raise APIError(503, "the server is shutting down: request aborted", "server_error",
                                       code="shutting_down")
                    raise APIError(499, "the client closed the request", "client_closed_request")
                if item.finish_reason == "error" and not item.token_ids:  # refused or failed before a token
                    raise error_of(item)
                if item.finished:
                    finals[item.request_id] = item
        finally:
            watcher.cancel()
            state.loop.abort([i for i in ids if i not in finals])
        return [finals[i] for i in ids]

    async def _stream(request: Request, parsed: ParsedRequest, rid: str, ids: List[str], q: asyncio.Queue,
                      call: Any = None, with_receipts: bool = False):
        watcher = asyncio.create_task(_abort_on_disconnect(request, state.loop, ids))
        try:
            first = await q.get()
        finally:
            watcher.cancel()
        if isinstance(first, EngineDead):
            raise APIError(503, str(first), "server_error", code="engine_dead")
        if first.finish_reason == "error" and not first.token_ids:
            state.loop.abort(ids)
            raise error_of(first)
        created = int(time.time())
        order = {i: k for k, i in enumerate(ids)}
        streams = [ChoiceStream(parsed, k, state.tokenizer, token_text, parsed.lines[k].get("stop"))
                   for k in range(len(ids))]
        out = call.events(created) if call is not None else ChatEvents()

        async def events():
            finals: Dict[str, Any] = {}
            item = first
            try:
                opening = "".join(out.start())
                if opening:
                    yield opening
                while True:
                    if isinstance(item, EngineDead):
                        yield "".join(out.error(APIError(503, str(item), "server_error", code="engine_dead").to_json()))
                        break
                    if item.finish_reason == "abort":
                        if state.shutting_down:  # the client is still there: tell it why the stream ends
                            yield "".join(out.error(APIError(503, "the server is shutting down: request aborted",
                                                             "server_error", code="shutting_down").to_json()))
                        break
                    if item.finish_reason == "error":
                        yield "".join(out.error(error_of(item).to_json()))
                        finals[item.request_id] = item
                        break
                    entries = streams[order[item.request_id]].on_output(item)
                    if item.finished and with_receipts and entries:  # the choice's last chunk: its receipt
                        entries[-1]["receipt"] = receipt_of(item, parsed.tools)
                    for entry in entries:  # one choice per chunk
                        yield "".join(out.chunk(chunk(parsed, rid, created, [entry])))
                    if item.finished:
                        finals[item.request_id] = item
                        if len(finals) == len(ids):
                            if parsed.include_usage:
                                yield "".join(out.chunk(chunk(parsed, rid, created, [],
                                                              usage([finals[i] for i in ids], parsed.n))))
                            break
                    item = await q.get()
                yield "".join(out.done(list(finals.values())))
            finally:  # also on a client that went away (the generator is closed)
                state.loop.abort([i for i in ids if i not in finals])

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, "completion")

    add_responses_routes(app, state, _handle)
    add_tokenize_routes(app, state, _body)

    @app.post("/v1/guides/check")
    async def guides_check(request: Request):
        """Admit guides as generation would, without generating (docs/receipts.md "The guide check")."""
        if state.guide_check is None:
            raise APIError(503, "the guide check is not ready yet (the grammar backend is being built)",
                           "server_error", code="not_ready", headers={"Retry-After": str(state.retry_after_s)})
        body = await _body(request)

        def parse(chat_body):
            return parse_request(chat_body, "chat", "guide-check", state.guided_backend, state.tool_format)

        return await asyncio.to_thread(check_guides, body, state.guide_check, parse)

    return app


class _LimitsMiddleware:
    """ASGI middleware for ``/v1/*``: 401 without the right Bearer token, 413 on a declared oversize body.

    (Pure ASGI rather than ``BaseHTTPMiddleware``, which would get in the way
    of disconnect detection and streaming.)  Bodies without a
    ``Content-Length`` are bounded while they are read (``_body``).
    """

    def __init__(self, app, api_key: Optional[str], max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            err = None
            if self.api_key is not None and not _same_secret(headers.get("authorization", ""),
                                                             f"Bearer {self.api_key}"):
                err = APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                               "authentication_error", code="invalid_api_key")
            length = headers.get("content-length", "")
            if err is None and length.isdigit() and int(length) > self.max_body_bytes:
                err = _too_large(int(length), self.max_body_bytes)
            if err is not None:
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _same_secret(given: str, expected: str) -> bool:
    """Compare a credential in constant time (``hmac.compare_digest`` on bytes: no early exit to time)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes (--max-body-bytes)",
                    "invalid_request_error", code="request_too_large")


async def _abort_on_disconnect(request: Request, loop: EngineLoop, ids: List[str], poll_s: float = 0.25) -> None:
    """Abort ``ids`` once the client has gone (polls ``request.is_disconnected``; cancelled when done)."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)
    loop.abort(ids)
