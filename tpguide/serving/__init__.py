"""OpenAI-compatible HTTP front end on rank 0 (docs/architecture.md §1, serving).

One idea per module:

==================  =========================================================
``errors``          OpenAI's error JSON and the HTTP status of each error
``protocol``        an OpenAI request body -> request-line dicts (one per choice)
``chat_messages``   OpenAI messages -> plain role/content strings (tool turns rendered)
``tool_calls``      tool prompts, tool-call grammars, parsing tool calls
``tool_stream``     tool-call deltas while streaming
``detokenizer``     incremental detokenization (never splits a UTF-8 character)
``responses``       the non-streamed answer objects and usage
``sse``             Server-Sent Events chunks
``metrics``         Prometheus metrics
``engine_loop``     the one thread on rank 0 that steps the engine; asyncio bridge
``app``             the FastAPI application
``server``          rank 0's state: engine loop, metrics, guide precompilation
==================  =========================================================
"""
