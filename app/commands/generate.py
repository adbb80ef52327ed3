"""``duet generate``: answer one prompt and print the reply (or one JSON object)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from app.options import (
    add_model_args,
    add_sampling_args,
    check_model_args,
    describe,
    engine_config,
    load_engine,
    sampling_params,
    use_fast_blas,
)
from app.peer_options import add_peer_args


def add_generate_parser(sub) -> None:
    """``duet generate``."""
    g = sub.add_parser(
        "generate",
        help="answer one prompt and print the reply",
        description="Answer one prompt: it goes through the model's chat template when the model has "
        "one (like `ollama run`), or as plain text to complete with --raw. Sampling defaults are "
        "Ollama's.",
    )
    add_model_args(g)
    add_peer_args(g)
    g.add_argument(
        "--prompt", "-p", required=True, help="the prompt (a user message, or text to complete with --raw)"
    )
    add_sampling_args(g)
    g.add_argument("--stop", action="append", help="stop when the reply contains this text (repeatable)")
    template = g.add_mutually_exclusive_group()
    template.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as plain text for the model to continue, without the chat template",
    )
    template.add_argument(
        "--chat",
        action="store_true",
        help="apply the model's chat template (the default; kept for older scripts)",
    )
    think = g.add_mutually_exclusive_group()
    think.add_argument(
        "--think",
        dest="think",
        action="store_const",
        const="on",
        help="ask a thinking model to think first (its template's switch; the default is the template's)",
    )
    think.add_argument(
        "--no-think",
        dest="think",
        action="store_const",
        const="off",
        help="ask a thinking model not to think, where its template allows it (Qwen3's enable_thinking)",
    )
    g.add_argument(
        "--tools",
        metavar="FILE",
        help="a JSON file of OpenAI function tools to offer; the reply's calls are parsed in the model's syntax",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, reasoning, tool calls, token ids, usage, timings",
    )
    g.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from mlx_engine.request import GenerationRequest
    from mlx_engine.tokenization.reply_parser import ToolParsing
    from peer.attach import peer_usage

    tools = None
    if args.tools:
        try:
            tools = json.loads(Path(args.tools).read_text())
        except (OSError, ValueError) as e:
            print(f"duet: error: --tools {args.tools}: {e}", file=sys.stderr)
            return 2

    sampling = sampling_params(args)
    config = engine_config(args)
    check_model_args(args)
    use_fast_blas()
    with load_engine(args, config) as engine:
        if not args.json:
            print(describe(engine), file=sys.stderr)
        chat = not args.raw and engine.tokenizer.chat_template is not None
        req = GenerationRequest(
            prompt=None if chat else args.prompt,
            messages=[{"role": "user", "content": args.prompt}] if chat else None,
            max_tokens=args.max_tokens,
            sampling=sampling,
            stop=args.stop or [],
            tools=tools if chat else None,
            tool_parsing=ToolParsing(tuple(t["function"]["name"] for t in tools), tools)
            if tools and chat
            else None,
            template_kwargs=engine.tokenizer.reply_format.thinking_kwargs(args.think) if chat else None,
        )

        async def run():
            text, thought, calls, ids, last = [], [], [], [], None
            async for ev in engine.generate(req):
                text.append(ev.text)
                thought.append(ev.reasoning)
                calls.extend(ev.tool_calls)
                ids.extend(ev.token_ids)
                if not args.json:
                    if ev.reasoning:  # the thinking on stderr, dimmed: stdout is the answer
                        dim = sys.stderr.isatty()
                        print(
                            ("\x1b[2m" if dim else "") + ev.reasoning + ("\x1b[0m" if dim else ""),
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
                    print(ev.text, end="", flush=True)
                    for c in ev.tool_calls:
                        print(f"\n[tool call] {c.name}({c.arguments})", flush=True)
                last = ev
            return "".join(text), "".join(thought), calls, ids, last

        text, reasoning, calls, ids, last = asyncio.run(run())
    u = last.usage
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "reasoning": reasoning,
                    "tool_calls": [c.to_openai() for c in calls],
                    "token_ids": ids,
                    "finish_reason": last.finish_reason,
                    "chat_template": chat,
                    "usage": {
                        "prompt_tokens": u.prompt_tokens,
                        "completion_tokens": u.completion_tokens,
                        "reasoning_tokens": u.reasoning_tokens,
                        "cached_tokens": u.cached_tokens,
                        "ttft_s": round(u.ttft_s, 4),
                        "prefill_tps": round(u.prefill_tps, 1),
                        "decode_tps": round(u.decode_tps, 1),
                        "speculative": u.speculative,
                        **peer_usage(u, engine, req.request_id),
                    },
                }
            )
        )
    else:
        print(
            f"\n[{last.finish_reason}] prompt {u.prompt_tokens} tok, completion {u.completion_tokens} tok, "
            f"TTFT {u.ttft_s * 1000:.0f} ms, decode {u.decode_tps:.1f} tok/s",
            file=sys.stderr,
        )
    if last.error:
        print(f"duet: error: {last.error}", file=sys.stderr)
    return 0 if last.finish_reason in ("stop", "length") else 1
