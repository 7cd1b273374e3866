"""``/v1/responses`` on the chat path, and the in-memory store behind ``previous_response_id``.

docs/serving.md "Responses API".  A request is rewritten as a chat request
(:mod:`tpguide.serving.responses_protocol`), runs through the chat
endpoint's admission, engine and fail-closed checks, and its chat answer
(or chat stream) is written as a ``response`` (:mod:`tpguide.serving.responses_output`,
:mod:`tpguide.serving.responses_stream`).

State, as vLLM keeps it: every response whose request did not say
``store: false`` is kept in memory, the :data:`RESPONSES_STORE_SIZE` most
recent ones (least recently used dropped first), with its conversation
(input items, then output items).  ``previous_response_id`` puts that
conversation before the new ``input`` (not its ``instructions``, as OpenAI
does); an id not in the store is a 400 naming ``previous_response_id``.
``GET /v1/responses/{id}`` returns a stored response.  Nothing survives a
restart.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fastapi import FastAPI, Request

from tpguide.guided.reasoning import THINK_END, single_token_id
from tpguide.serving.errors import APIError, bad_request
from tpguide.serving.protocol import ParsedRequest, parse_request
from tpguide.serving.responses import TokenText, build_answer
from tpguide.serving.responses_output import output_items, response_object, response_usage, status_of
from tpguide.serving.responses_protocol import responses_to_chat
from tpguide.serving.responses_stream import ResponseEvents

#: Responses kept in memory for ``previous_response_id`` and ``GET /v1/responses/{id}``.
RESPONSES_STORE_SIZE = 256


class ResponseStore:
    """The most recent stored responses and their conversations (an LRU of ``capacity`` entries)."""

    def __init__(self, capacity: int = RESPONSES_STORE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: "OrderedDict[str, Tuple[Dict[str, Any], List[Dict[str, Any]]]]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: Dict[str, Any], input_items: List[Dict[str, Any]]) -> None:
        """Keep ``response``; its conversation is ``input_items`` then its output items."""
        self._entries[response["id"]] = (response, [*input_items, *response["output"]])
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Optional[Dict[str, Any]]:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    def conversation(self, response_id: Any) -> List[Dict[str, Any]]:
        """The items of a stored response's conversation; 400 naming ``previous_response_id`` if unknown."""
        entry = self._entries.get(response_id) if isinstance(response_id, str) else None
        if entry is None:
            raise bad_request(f"previous_response_id {response_id!r} is not a stored response (the server keeps "
                              f"the last {self.capacity}, in memory, of requests without store: false)",
                              "previous_response_id")
        self._entries.move_to_end(response_id)
        return list(entry[1])


class ResponsesCall:
    """One ``/v1/responses`` request, as the app's request handler runs it (``parse``, ``answer``, ``events``)."""

    def __init__(self, state: Any, store: ResponseStore, end_token_id: Optional[int]) -> None:
        self.state, self.store, self.end_token_id = state, store, end_token_id
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.body: Dict[str, Any] = {}
        self.items: List[Dict[str, Any]] = []

    def parse(self, body: Any) -> ParsedRequest:
        """The chat request of the Responses body (400 naming the field)."""
        history = None
        if isinstance(body, dict) and body.get("previous_response_id") is not None:
            history = self.store.conversation(body["previous_response_id"])
        converted = responses_to_chat(body, history)
        self.body, self.items = body, converted.items
        return parse_request(converted.chat_body, "chat", self.response_id, self.state.guided_backend,
                             self.state.tool_format)

    def _keep(self, response: Dict[str, Any]) -> None:
        if self.body.get("store") is not False:
            self.store.put(response, self.items)

    def answer(self, parsed: ParsedRequest, outputs: Sequence[Any], token_text: TokenText) -> Dict[str, Any]:
        """The non-streamed ``response`` (the chat answer's fail-closed checks apply first)."""
        chat = build_answer(parsed, self.response_id, outputs, token_text)
        choice = chat["choices"][0]
        response = response_object(self.response_id, self.body, chat["created"], status_of(choice["finish_reason"]),
                                   output_items(choice["message"], choice["finish_reason"]),
                                   response_usage(outputs, self.end_token_id))
        self._keep(response)
        return response

    def events(self, created_at: int) -> ResponseEvents:
        """The stream writer of this response."""
        return ResponseEvents(self.response_id, self.body, created_at, self.end_token_id, on_done=self._keep)


def add_responses_routes(app: FastAPI, state: Any, handle: Any,
                         capacity: int = RESPONSES_STORE_SIZE) -> ResponseStore:
    """Register ``POST /v1/responses`` and ``GET /v1/responses/{id}``; ``handle(request, endpoint, call)``
    is the app's request handler.  Returns the store."""
    store = ResponseStore(capacity)
    end_token_id = single_token_id(state.tokenizer, THINK_END)  # the reasoning parser's own test of it

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await handle(request, "chat", ResponsesCall(state, store, end_token_id))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        found = store.get(response_id)
        if found is None:
            raise APIError(404, f"no stored response {response_id!r} (the server keeps the last {store.capacity} "
                                "in memory)", "invalid_request_error", "response_id", "not_found")
        return found

    return store
