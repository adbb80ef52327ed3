"""Tokenizer + chat-template fixtures for the model families Duet parses (issue 31).

Each fixture is the bundled SmolLM2 tokenizer with the family's marker tokens added (special where
the family's tokenizer makes them special) and a chat template written here to reproduce the
family's published format in the parts that decide parsing and round trips: the generation
prompt (and whether it opens the thinking section), how the template renders tool definitions,
an assistant turn's tool calls and thinking, and tool results. Checked on 2026-12-03 against
llama.cpp's copies of the published templates (models/templates/: Qwen3-0.6B, Qwen3-Coder,
gpt-oss-120b, Llama-3.3-70B, Devstral-Small-2507), rendered on the same conversations: the
generation prompt, the call turn and the tool result match character for character; the tool
definitions' preamble text is shorter here (its markers are the same). Gemma 3's published
template has no tools (its ``tool_code`` form is Google's function-calling guide) and no
published Magistral template was at hand (its ``[THINK]`` form is Mistral's documentation). ``RENDERED`` (in the tests) pins
each rendering to the family's documented text. A recorded reply per family (thinking, then two
calls with nested JSON arguments) is what the parser must take apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.tiny_models import bundled_tokenizer, with_added_tokens

# --- templates ---------------------------------------------------------------------------------
# Written with every character literal: ``_literal`` turns each ``{%-`` into ``{%`` and keeps a
# newline right after a block tag (the renderer's trim_blocks would eat it, as transformers' does).


def _literal(template: str) -> str:
    return template.replace("{%-", "{%").replace("%}\n", "%}{{ '\\n' }}")


QWEN3 = _literal(
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.reasoning_content and loop.index0 > ns.last_query %}"
    "<think>\n{{ m.reasoning_content.strip() }}\n</think>\n\n{%- endif %}"
    "{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}"
    "{%- if loop.first and m.content or not loop.first %}\n{%- endif %}"
    '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{%- endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)

QWEN3_CODER = _literal(
    "{%- if tools %}<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a "
    "computer to solve tasks.\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{%- for tool in tools %}\n<function>\n<name>{{ tool.function.name }}</name>\n</function>{%- endfor %}\n</tools>"
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- if m.content and m.content | trim %}\n{{ m.content | trim }}\n{%- endif %}"
    "{%- for tc in m.tool_calls %}\n<tool_call>\n<function={{ tc.function.name }}>\n"
    "{%- for k, v in tc.function.arguments.items() %}<parameter={{ k }}>\n"
    "{%- if v is mapping or (v is sequence and v is not string) %}{{ v | tojson }}{%- else %}{{ v | string }}{%- endif %}"
    "\n</parameter>\n{%- endfor %}</function>\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}"
    "{%- if messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user\n{%- endif %}"
    "<tool_response>\n{{ m.content }}\n</tool_response>\n"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

# gpt-oss: harmony. The system message carries the reasoning level; tools are a TypeScript-like
# namespace in the developer message; an assistant turn with tool calls keeps its analysis
GPT_OSS = _literal(
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: {{ strftime_now('%Y-%m-%d') }}\n\nReasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{%- endif %}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n"
    "{%- for tool in tools %}\n\n// {{ tool.function.description }}\ntype {{ tool.function.name }} = "
    "(_: {{ tool.function.parameters | tojson }}) => any;{%- endfor %}\n\n} // namespace functions<|end|>"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.thinking and loop.index0 > ns.last_user %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif %}"
    "{%- for tc in m.tool_calls %}<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary "
    "json<|message|>{{ tc.function.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)

# DeepSeek-R1 distills: the generation prompt opens the thinking section; earlier thinking dropped
DEEPSEEK_R1 = _literal(
    "{{ bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{ m.content }}"
    "{%- elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{%- elif m.role == 'assistant' %}<｜Assistant｜>"
    "{%- set c = m.content or '' %}{%- if '</think>' in c %}{%- set c = c.split('</think>')[-1] %}{%- endif %}"
    "{{ c }}<｜end▁of▁sentence｜>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜><think>\n{%- endif %}"
)

# Mistral v11+ (Devstral, Magistral): [AVAILABLE_TOOLS] before the last user turn, calls as
# [TOOL_CALLS]name[ARGS]{json}, results as [TOOL_RESULTS]...[/TOOL_RESULTS]; Magistral thinks in
# [THINK]...[/THINK]
MISTRAL = _literal(
    "{{ bos_token }}"
    "{%- if messages[0].role != 'system' %}[SYSTEM_PROMPT]You are Devstral, a helpful agentic model.[/SYSTEM_PROMPT]{%- endif %}"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]"
    "{%- elif m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' %}{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}"
    "{%- endfor %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)

# Llama 3.1-3.3: custom tools in the first user message; a call is a JSON object with "parameters"
LLAMA3 = _literal(
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\n"
    "{%- if tools %}Environment: ipython\n{%- endif %}"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "{%- for m in messages %}{%- if m.role == 'system' %}{{ m.content }}{%- endif %}{%- endfor %}<|eot_id|>"
    "{%- set ns = namespace(first=true) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|start_header_id|>user<|end_header_id|>\n\n"
    "{%- if tools and ns.first %}Given the following functions, please respond with a JSON for a function "
    'call with its proper arguments that best answers the given prompt.\n\nRespond in the format {"name": '
    'function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n'
    "{%- for tool in tools %}{{ tool | tojson }}\n\n{%- endfor %}{%- set ns.first = false %}{%- endif %}"
    "{{ m.content }}<|eot_id|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for tc in m.tool_calls %}"
    '{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}'
    "{%- endfor %}<|eot_id|>"
    "{%- elif m.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content | tojson }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)

# Gemma 3 with tools: no tool tokens; calls are Python in a ```tool_code block, results in
# ```tool_output (Google's function-calling guide)
GEMMA3 = _literal(
    "{{ bos_token }}{%- for m in messages %}"
    "{%- set role = 'model' if m.role == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n"
    "{%- if loop.first and tools %}You have access to functions. If you decide to invoke any of the "
    "function(s), you MUST put it in the format of\n```tool_code\n[func_name1(params_name1=params_value1)]\n```\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}{%- endif %}"
    "{%- if m.role == 'tool' %}```tool_output\n{{ m.content }}\n```"
    "{%- elif m.tool_calls %}```tool_code\n["
    "{%- for tc in m.tool_calls %}{{ tc.function.name }}("
    "{%- for k, v in tc.function.arguments.items() %}{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}{%- endfor %})"
    "{{ ', ' if not loop.last }}{%- endfor %}]\n```"
    "{%- else %}{{ m.content }}{%- endif %}<end_of_turn>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<start_of_turn>model\n{%- endif %}"
)


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    special: tuple[str, ...] = ()  # added as special tokens
    plain: tuple[str, ...] = ()  # added as ordinary whole tokens
    eos: str = "<|im_end|>"
    # what infer_reply_format must find
    think: tuple[str, str] | None = None
    tools: str | None = None  # the tool syntax's name (None: harmony or Hermes by system prompt)
    harmony: bool = False
    reply: str = ""  # a recorded reply: thinking, then two calls
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, dict]] = field(default_factory=list)
    opens_thinking: bool = False  # the generation prompt opens the thinking section

    def tokenizer(self) -> tuple[str, dict]:
        special = [*self.special, *([self.eos] if self.eos not in (*self.special, "<|im_end|>") else [])]
        tok = with_added_tokens(bundled_tokenizer(self.template), special, special=True)
        tok = with_added_tokens(tok, list(self.plain))
        cfg = {**tok[1], "eos_token": self.eos}
        return tok[0], cfg


ARGS_A = {"city": "Zürich", "when": {"day": "tomorrow", "hours": [9, 12]}}
ARGS_B = {"q": "pizza </tool_call> near me", "limit": 3}
THOUGHT = "The user wants weather and food. I'll call both."

FAMILIES = [
    Family(
        "qwen3",
        QWEN3,
        plain=("<think>", "</think>", "<tool_call>", "</tool_call>"),
        think=("<think>", "</think>"),
        tools="hermes",
        reply=(
            f"<think>\n{THOUGHT}\n</think>\n\nLet me check.\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "when": {"day": "tomorrow", '
            '"hours": [9, 12]}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"q": "pizza </tool_call> near me", "limit": 3}}\n</tool_call>'
        ),
        reasoning=f"\n{THOUGHT}\n",
        content="Let me check.\n",
        calls=[("get_weather", ARGS_A), ("search", ARGS_B)],
    ),
    Family(
        "qwen3_coder",
        QWEN3_CODER,
        plain=("<tool_call>", "</tool_call>"),
        tools="qwen3_coder",
        reply=(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=when>\n"
            '{"day": "tomorrow", "hours": [9, 12]}\n</parameter>\n</function>\n</tool_call>\n'
            "<tool_call>\n<function=search>\n<parameter=q>\npizza near me\n</parameter>\n<parameter=limit>\n3\n"
            "</parameter>\n</function>\n</tool_call>"
        ),
        calls=[("get_weather", ARGS_A), ("search", {"q": "pizza near me", "limit": 3})],
    ),
    Family(
        "gpt_oss",
        GPT_OSS,
        # written out, not harmony.MARKERS: the fixture pins gpt-oss's published token names
        special=(
            "<|start|>",
            "<|channel|>",
            "<|message|>",
            "<|end|>",
            "<|call|>",
            "<|return|>",
            "<|constrain|>",
        ),
        eos="<|return|>",
        harmony=True,
        reply=(
            f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Zürich", "when": {"day": "tomorrow", '
            '"hours": [9, 12]}}<|call|>'
        ),
        reasoning=THOUGHT,
        calls=[("get_weather", ARGS_A)],  # <|call|> ends gpt-oss's turn: one call per reply
    ),
    Family(
        "deepseek_r1",
        DEEPSEEK_R1,
        special=("<｜User｜>", "<｜Assistant｜>"),
        plain=("<think>", "</think>"),
        eos="<｜end▁of▁sentence｜>",
        think=("<think>", "</think>"),
        reply=f"{THOUGHT}\n</think>\n\nIt is sunny.",
        reasoning=f"{THOUGHT}\n",
        content="It is sunny.",
        opens_thinking=True,
    ),
    Family(
        "magistral",
        MISTRAL,
        special=(
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[THINK]",
            "[/THINK]",
        ),
        eos="</s>",
        think=("[THINK]", "[/THINK]"),
        tools="mistral",
        reply=(
            f"[THINK]{THOUGHT}[/THINK]"
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "when": {"day": "tomorrow", "hours": [9, 12]}}'
            '[TOOL_CALLS]search[ARGS]{"q": "pizza </tool_call> near me", "limit": 3}'
        ),
        reasoning=THOUGHT,
        calls=[("get_weather", ARGS_A), ("search", ARGS_B)],
    ),
    Family(
        "llama3",
        LLAMA3,
        special=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>", "<|eom_id|>"),
        eos="<|eot_id|>",
        tools="llama3_json",
        reply=(
            '{"name": "get_weather", "parameters": {"city": "Zürich", "when": {"day": "tomorrow", "hours": [9, 12]}}}; '
            '{"name": "search", "parameters": {"q": "pizza </tool_call> near me", "limit": 3}}'
        ),
        calls=[("get_weather", ARGS_A), ("search", ARGS_B)],
    ),
    Family(
        "gemma3",
        GEMMA3,
        special=("<start_of_turn>", "<end_of_turn>"),
        eos="<end_of_turn>",
        tools="gemma_pythonic",
        reply=(
            '```tool_code\n[get_weather(city="Zürich", when={"day": "tomorrow", "hours": [9, 12]}), '
            'search(q="pizza </tool_call> near me", limit=3)]\n```'
        ),
        calls=[("get_weather", ARGS_A), ("search", ARGS_B)],
    ),
]
BY_NAME = {f.name: f for f in FAMILIES}

# the tools the recorded replies call (parsers that type arguments read their schemas)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Zürich"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "when": {"type": "object"},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["q"],
            },
        },
    },
]
