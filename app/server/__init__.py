"""The OpenAI-compatible HTTP server (`duet serve`).

Modules: ``main`` (options, the port, start-up, uvicorn, shutdown), ``app`` (routes),
``security`` (ASGI middleware: Host/Origin allowlists, API key, body limits, JSON content type),
``connections`` (fd limit, header timeout, connection cap, rate-limited logs), ``protocol``
(request models = the OpenAPI schema), ``chat`` / ``completions`` (the two generation
endpoints; the engine has parsed each reply's thinking and tool calls in the model family's
format, ``mlx_engine/tokenization/reply_parser.py``), ``generation`` (the n engine requests of one
call, fan-out bound), ``metrics`` (Prometheus), ``errors`` (OpenAI error objects), ``common``;
the other APIs, as adapters onto the chat call (``turns``): ``anthropic`` (Messages, with
``anthropic_protocol`` and ``anthropic_errors``), ``responses`` (OpenAI Responses, with
``responses_protocol``, ``responses_tools`` (namespace and hosted tools) and the in-memory
``ResponseStore``), ``embeddings`` (/v1/embeddings, batched onto the engine worker), and the
Ollama API (``ollama``, ``ollama_protocol``, ``ollama_models``). Several models: ``registry`` (the
servable models and the loaded ones, each its own engine and ``ServerState``: load on first use,
idle keep-alive, least-recently-used unloading for room), ``model_routes`` (a request held on its
model, the loading stream), ``models_api`` (/v1/models, load and unload), ``keep_alive`` (durations);
``tokenize`` (/tokenize, /detokenize, /apply-template as llama.cpp's server).

Behaviour worth knowing (decisions where OpenAI's API leaves room):
- Model names: each served model's id (the GGUF's name or the model directory's name for a
  ``--model``; the ``duet models`` name, e.g. ``owner/repo:Q4_K_M``, for a local model with no
  ``--model``) and, as aliases, what ``--model`` said, its resolved path, its file name and stem
  ("default" for the bundled model). Anything else is a 404 ``model_not_found`` listing the models.
- Every field of OpenAI's chat-completions and completions requests is accepted and type-checked
  (``protocol``). Honoured: sampling, ``max_completion_tokens``, ``logit_bias``, logprobs, ``n``,
  ``seed``, ``stop``, ``stream_options.include_usage``, ``response_format``, tools with
  ``tool_choice`` (``allowed_tools`` included) and ``parallel_tool_calls``, and the legacy
  ``functions`` / ``function_call`` (answered in the legacy ``function_call`` shape). Ignored
  (debug log): ``store``, ``metadata``, ``user``, ``safety_identifier``, ``service_tier``,
  ``verbosity``, ``prompt_cache_*``, ``prediction``, ``audio``,
  ``moderation``, ``web_search_options``. Refused: ``modalities`` other than text, custom
  (free-form) tools, non-text content parts, ``suffix``, ``echo`` with ``logprobs``. Unknown
  top-level fields are a 400, as at OpenAI; messages, tools and content parts accept extra keys
  (clients send back whole response objects). Legacy ``role: "function"`` messages are tool
  results; ``refusal`` parts and fields are read as text. Thinking controls:
  ``reasoning_effort`` and ``chat_template_kwargs`` reach the template, an assistant message's
  ``reasoning_content`` (or ``reasoning``) goes back to it. Extensions: ``top_k``, ``min_p``,
  ``repetition_penalty``, ``ignore_eos``, ``thinking_budget``. Lone surrogates and bodies nested over 100 levels are
  a 400.
- Omitted sampling fields take Duet's defaults (``mlx_engine.defaults``, Ollama's set:
  temperature 0.8, top_p 0.9, top_k 40), not OpenAI's 1.0. ``max_tokens`` absent, on both
  endpoints: until EOS, a stop, or the context is full. ``max_tokens`` beyond what the context
  leaves after the prompt is a cap at that (as llama.cpp's server and Ollama; agents such as
  opencode send 32000): the reply ends there with ``finish_reason: "length"``. A prompt that
  fills the context alone is a 400 ``context_length_exceeded``. `duet serve --max-tokens N`
  caps every reply on every endpoint, asked for or not (llama.cpp's ``--n-predict``).
- System messages after the first turn (Claude Code sends them) stay where they were sent when
  the chat template renders a system turn there, else join the system prompt
  (``mlx_engine.tokenization.system_turns``, decided once per template by a probe render).
- ``GET`` / ``HEAD /`` answer ``Duet is running`` (no key needed, nothing named), as Ollama's
  root does: Claude Code probes it at start.
- Every route also answers without the ``/v1`` prefix and with a trailing slash.
- ``n > 1``: n engine requests; the others fork the first one's prompt KV (copy-on-write), so
  the prompt is computed once. ``seed`` gives choice i the seed ``seed + i``. Usage counts
  the prompt once, and its cached tokens from the first choice.
- Structured output (``response_format`` json_object / json_schema) and forced tool calls
  (``tool_choice`` required / named) are grammars (llguidance, ``mlx_engine.sampling.constraints``).
  JSON comes out compact with ``", "`` and ``": "`` separators. Objects that declare
  properties get only those (``mlx_engine.sampling.json_schema_closing``), and each tool's ``$defs`` are
  hoisted into the call grammar (``mlx_engine.sampling.json_schema_embedding``). A tool without
  ``parameters`` takes ``{}``. A forced tool call is a single call unless
  ``parallel_tool_calls`` is true. ``tool_choice: "none"`` leaves the tools out of the prompt.
  Templates that do not render ``tools`` get a Hermes-style tools system prompt. A reply cut by
  ``max_tokens`` inside a call still comes back as ``mlx_engine.tokenization.tool_calls`` (the arguments generated so
  far) with ``finish_reason: "length"``.
- An unexpected error answers 500 ``internal error``; the traceback goes to the log, once.
- A client that disconnects cancels its requests (counted as ``finish_reason="cancelled"`` in
  ``duet_requests_total``). On SIGINT/SIGTERM the engine stops first, so open streams end with
  an error chunk and ``data: [DONE]``.
"""
