"""mlx-lm's tool-parser inference without importing transformers (mlx_engine/tokenization/mlx_lm_functions.py):
the same answers as mlx-lm's own function, no transformers in a process that only infers a reply
format, and a function that needs more than builtins comes from the real import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mlx_engine.tokenization.mlx_lm_functions import pure_function

TEMPLATES = [
    None,
    "{{ messages }}",
    "<minimax:tool_call>",
    "<|tool_call>x<tool_call|>",
    "<start_function_call>",
    "<longcat_tool_call>",
    "<arg_key>",
    "<|tool_call_start|>",
    "<tool_call>\n<function=f>",
    "<|tool_calls_section_begin|>",
    '<function name="f"><param name="a">',
    "[TOOL_CALLS]",
    "<atem:function_calls>",
    "<tool_call>{{ tool_call.name }}",
    "<tool_call>",
]
VOCABS = [
    {},
    {"<|open|>": 1, "<|close|>": 2, "<|sep|>": 3, "<|end_of_msg|>": 4},
    {"<|tool_call_start|>": 5, "<|tool_call_end|>": 6},
]


class View:
    def __init__(self, template, vocab):
        self.chat_template = template
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_compiled_inference_answers_as_mlx_lm_does():
    from mlx_lm.tokenizer_utils import _infer_tool_parser  # the real one (imports transformers)

    ours = pure_function("_infer_tool_parser")
    assert ours is not _infer_tool_parser  # compiled from the source, not imported
    answers = set()
    for template in TEMPLATES:
        for vocab in VOCABS:
            want = _infer_tool_parser(View(template, vocab))
            assert ours(View(template, vocab)) == want, (template, vocab)
            answers.add(want)
    assert len(answers) > 10  # the cases reach most of its branches


def test_a_fresh_process_infers_a_reply_format_without_transformers():
    code = textwrap.dedent(
        """
        import sys
        from duet_smollm2 import GGUF_PATH
        from mlx_engine.tokenization.reply_parser import infer_reply_format
        from mlx_engine.tokenization.tool_formats import infer_tool_syntax
        fmt = infer_reply_format("{% for m in messages %}<tool_call>{% endfor %}", {})
        assert fmt.tools is not None and fmt.tools.name == "hermes", fmt
        assert infer_tool_syntax("[TOOL_CALLS]", {}).name == "mistral"
        print("transformers" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_functions_that_need_more_than_builtins_come_from_the_import(tmp_path, monkeypatch):
    (tmp_path / "duet_fake_utils.py").write_text(
        textwrap.dedent(
            """
            import json
            IMPORTED = True

            def pure(x):
                return helper(x) + 1

            def helper(x):
                return len(x) * 2

            def uses_import(x):
                return json.dumps(x)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("duet_fake_utils", None)
    try:
        pure = pure_function("pure", module="duet_fake_utils")
        assert pure("abc") == 7
        assert "duet_fake_utils" not in sys.modules  # compiled alone, with its helper
        assert pure_function("uses_import", module="duet_fake_utils")([1]) == "[1]"
        assert "duet_fake_utils" in sys.modules  # the real module, imported
        with pytest.raises(AttributeError):
            pure_function("missing", module="duet_fake_utils")
    finally:
        sys.modules.pop("duet_fake_utils", None)
        pure_function.cache_clear()
