"""The OpenAI-compatible HTTP server (`duet serve`).

Modules: ``main`` (options, the port, start-up, uvicorn, shutdown), ``app`` (routes),
``security`` (ASGI middleware: Host/Origin allowlists, API key, body limits, JSON content type),
``connections`` (fd limit, header timeout, connection cap, rate-limited logs), ``protocol``
(request models = the OpenAPI schema), ``chat`` / ``completions`` (the two generation
endpoints), ``generation`` (the n engine requests of one call, fan-out bound), ``tool_calls``
(Hermes/Qwen parser), ``metrics`` (Prometheus), ``errors`` (OpenAI error objects), ``common``.

Behaviour worth knowing (decisions where OpenAI's API leaves room):
- Model names: the served id (the GGUF's name, or the model directory's name) and, as aliases,
  what ``--model`` said, its resolved path, its file name and stem ("default" with no --model).
  Anything else is a 404 ``model_not_found``.
- Unknown top-level request fields are a 400, as at OpenAI; messages, tools and content parts
  accept extra keys (clients send back whole response objects). ``store``, ``metadata``,
  ``service_tier`` and ``user`` are accepted and ignored. Extensions: ``top_k``, ``min_p``,
  ``repetition_penalty``, ``ignore_eos``.
- ``max_tokens`` absent: chat fills the context; completions default to 16 (OpenAI's defaults).
  prompt + max_tokens beyond the context is a 400 ``context_length_exceeded``.
- ``n > 1``: n engine requests; the others fork the first one's prompt KV (copy-on-write), so
  the prompt is computed once. ``seed`` gives choice i the seed ``seed + i``. Usage counts
  the prompt once, and its cached tokens from the first choice.
- Structured output (``response_format`` json_object / json_schema) and forced tool calls
  (``tool_choice`` required / named) are grammars (llguidance, ``mlx_engine.constraints``).
  JSON comes out compact with ``", "`` and ``": "`` separators. A forced tool call is a single
  call unless ``parallel_tool_calls`` is true. ``tool_choice: "none"`` leaves the tools out of
  the prompt. Templates that do not render ``tools`` get a Hermes-style tools system prompt.
- A client that disconnects cancels its requests (counted as ``finish_reason="cancelled"`` in
  ``duet_requests_total``). On SIGINT/SIGTERM the engine stops first, so open streams end with
  an error chunk and ``data: [DONE]``.
"""
