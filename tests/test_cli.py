"""The `duet` command as a user runs it: one-line errors before anything loads, the defaults
(chat template, Ollama's sampling), `duet chat` through a pipe, and help for every option.

Argument errors run `app.cli.main` in this process with the model loader, the chat app and the
server replaced by stand-ins that fail the test if called, so "rejected before loading" is
checked directly; the rest run the real command in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from app import cli, options
from app.commands import chat as chat_command
from mlx_engine import defaults


def env() -> dict[str, str]:
    """Read when the process starts: the suite's per-user directories (conftest) are set after import."""
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def duet(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
    )


def test_version():
    r = duet("--version")
    assert r.returncode == 0 and r.stdout.startswith("duet ")


def test_models_lists_the_bundled_model():
    r = duet("models")
    assert r.returncode == 0 and "SmolLM2-135M-Instruct" in r.stdout and "bundled" in r.stdout


# --- generate --------------------------------------------------------------------------------
def generate_json(model, *args: str) -> dict:
    r = duet("generate", "--model", str(model), "--prompt", "Hello world", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_generate_json_with_tiny_model(tiny_dirs):
    args = ("--max-tokens", "6", "--seed", "3", "--temperature", "0.8")
    out = generate_json(tiny_dirs("llama"), *args)
    assert len(out["token_ids"]) == out["usage"]["completion_tokens"] <= 6
    assert out["finish_reason"] in ("stop", "length")
    assert out["usage"]["prompt_tokens"] > 0
    again = generate_json(tiny_dirs("llama"), *args)
    assert again["token_ids"] == out["token_ids"]  # same seed, same request -> same tokens


def test_speculative_decoding_is_reported_and_does_not_change_the_output(tiny_dirs):
    args = ("--max-tokens", "40", "--temperature", "0")
    on = generate_json(tiny_dirs("qwen3"), *args)  # ngram by default
    off = generate_json(tiny_dirs("qwen3"), *args, "--speculative", "off")
    assert on["token_ids"] == off["token_ids"]
    spec = on["usage"]["speculative"]
    assert set(spec) == {"proposed", "accepted"} and 0 <= spec["accepted"] <= spec["proposed"]
    assert off["usage"]["speculative"] is None


def test_a_draft_model_proposes_and_does_not_change_the_output(tiny_dirs):
    """--draft-model alone selects --speculative draft; the same weights as the target: its
    proposals are kept."""
    args = ("--max-tokens", "40", "--temperature", "0", "--speculative")
    off = generate_json(tiny_dirs("qwen3"), *args, "off")
    on = generate_json(tiny_dirs("qwen3"), *args[:-1], "--draft-model", str(tiny_dirs("qwen3")))
    assert on["token_ids"] == off["token_ids"]
    spec = on["usage"]["speculative"]
    assert 0 < spec["accepted"] <= spec["proposed"], spec


def test_generate_applies_the_chat_template_unless_raw(tiny_dirs):
    """Like `ollama run`: the prompt is a user message in the model's chat template by default;
    --raw sends the text as is, for plain completion."""
    model = tiny_dirs("llama")
    from mlx_engine.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(model)
    chat = generate_json(model, "--max-tokens", "1")
    raw = generate_json(model, "--max-tokens", "1", "--raw")
    alias = generate_json(model, "--max-tokens", "1", "--chat")  # the old flag, now the default
    templated = tok.encode_chat([{"role": "user", "content": "Hello world"}], True, None)
    assert chat["chat_template"] and chat["usage"]["prompt_tokens"] == len(templated)
    assert alias["usage"]["prompt_tokens"] == len(templated)
    assert not raw["chat_template"] and raw["usage"]["prompt_tokens"] == len(tok.encode("Hello world"))


def test_generate_reports_blas_and_weight_format(tiny_dirs):
    r = duet("generate", "--model", str(tiny_dirs("llama")), "--prompt", "Hi", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "weights dense float32" in r.stderr and "BLAS" in r.stderr


def test_sampling_defaults_are_the_documented_set():
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi"])
    assert (args.temperature, args.top_p, args.top_k, args.min_p, args.repetition_penalty) == (
        defaults.TEMPERATURE,
        defaults.TOP_P,
        defaults.TOP_K,
        defaults.MIN_P,
        defaults.REPETITION_PENALTY,
    )
    assert args.max_tokens is defaults.MAX_TOKENS is None  # until the model stops
    params = options.sampling_params(args)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.8, 0.9, 40, 0.0)


# --- bad arguments and bad models: one line, exit 2, nothing loaded ---------------------------
@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if a command gets as far as loading a model, opening the chat or serving."""
    import app.server.main
    import app.tui.main
    import mlx_engine.blas
    import mlx_engine.engine.api

    def loaded(*args, **kwargs):
        raise AssertionError("the model loader ran before the arguments were checked")

    monkeypatch.setattr(mlx_engine.engine.api, "load_model", loaded)
    monkeypatch.setattr(mlx_engine.engine.api.Engine, "load", loaded)
    monkeypatch.setattr(app.tui.main, "run_chat", loaded)
    monkeypatch.setattr(app.server.main, "serve", loaded)
    monkeypatch.setattr(mlx_engine.blas, "reexec_with_openblas", lambda: None)  # never re-execute pytest


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-models")
    not_gguf = root / "weights.gguf"
    not_gguf.write_bytes(b"this is not a GGUF file" * 10)
    truncated = root / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    empty_dir = root / "empty"
    empty_dir.mkdir()
    alien = root / "alien"
    alien.mkdir()
    (alien / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    (alien / "model.safetensors").write_bytes(b"")
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"")
    return {
        "missing": (str(root / "nowhere" / "model.gguf"), "model not found"),
        "not a gguf": (str(not_gguf), "is not a GGUF file"),
        "truncated gguf": (str(truncated), "truncated.gguf"),
        "empty dir": (str(empty_dir), "is not a model directory"),
        "unknown architecture": (str(alien), "unsupported architecture 'no_such_architecture'"),
        "bad config.json": (str(broken), "cannot read"),
        "uncached repo": ("nobody/no-such-model-xyz", "nobody/no-such-model-xyz"),
    }


BAD_OPTIONS = {
    "cache-gb 0": (["--cache-gb", "0"], "--cache-gb must be above 0 GiB, not 0"),
    "cache-gb -1": (["--cache-gb", "-1"], "--cache-gb must be above 0 GiB"),
    "cache-gb 1000": (["--cache-gb", "1000"], "--cache-gb 1000 is more than this machine's"),
    "cache-gb nan": (["--cache-gb", "nan"], "--cache-gb must be a number"),
    "cache-fraction 2": (["--cache-fraction", "2"], "--cache-fraction must be above 0 and at most 0.9"),
    "cache-fraction 0": (["--cache-fraction", "0"], "--cache-fraction must be above 0"),
    "both budgets": (
        ["--cache-gb", "1", "--cache-fraction", "0.3"],
        "give --cache-gb or --cache-fraction, not both",
    ),
    "context-length 0": (["--context-length", "0"], "--context-length must be a positive integer, not 0"),
    "context-length 8": (["-c", "8"], "--context-length must be at least 16 tokens"),
    "draft without a draft model": (["--speculative", "draft"], "--speculative draft needs --draft-model"),
    "draft model without draft": (
        ["--speculative", "ngram", "--draft-model", "x"],
        "--draft-model is used only with --speculative draft, not ngram",
    ),
}
GENERATE_ONLY = {
    "max-tokens 0": (["--max-tokens", "0"], "--max-tokens must be a positive integer, not 0"),
    "max-tokens -5": (["--max-tokens", "-5"], "--max-tokens must be a positive integer"),
    "top-p 2": (["--top-p", "2"], "top_p must be in (0, 1] (got --top-p 2"),
    "temperature -1": (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    "top-k -1": (["--top-k", "-1"], "top_k must be >= 0"),
    "min-p 1": (["--min-p", "1"], "min_p must be in [0, 1)"),
}
# the bundled model's context (8192 tokens, no RoPE scaling) cannot be stretched: refused from its
# GGUF header, before any weight is read (`duet serve` with no --model checks each model as it loads)
PAST_THE_CONTEXT = {
    "context-length past the model's": (
        ["-c", "16384"],
        "context length 16384 is more than SmolLM2-135M-Instruct-Q4_1 can attend over: it was trained for "
        "8192 tokens and it has no RoPE scaling to reach further; use at most 8192",
    ),
}
SERVE_ONLY = {
    "max-queue 0": (["--max-queue", "0"], "--max-queue must be"),
    "max-running 0": (["--max-running", "0"], "--max-running must be"),
    "max-tokens 0": (["--max-tokens", "0"], "--max-tokens must be at least 1"),
}
COMMAND_ARGS = {"generate": ["--prompt", "hi"], "chat": [], "serve": []}


def run_main(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code: int, out: str, err: str, message: str) -> None:
    assert code == cli.EXIT_ERROR, (code, err)
    assert "Traceback" not in err and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("duet: error: "), err
    assert message in lines[0], lines[0]


BAD_OPTION_CASES = [
    (command, case, *table[case])
    for command, table in [
        ("generate", {**BAD_OPTIONS, **GENERATE_ONLY, **PAST_THE_CONTEXT}),
        ("chat", {**BAD_OPTIONS, **PAST_THE_CONTEXT}),
        ("serve", {**BAD_OPTIONS, **SERVE_ONLY}),
    ]
    for case in table
]


@pytest.mark.parametrize(
    "command, case, args, message", BAD_OPTION_CASES, ids=[f"{c[0]}-{c[1]}" for c in BAD_OPTION_CASES]
)
def test_bad_option_is_one_line_before_loading(command, case, args, message, nothing_loads, capsys):
    assert_one_line_error(*run_main(capsys, [command, *COMMAND_ARGS[command], *args]), message)


@pytest.mark.parametrize("command", list(COMMAND_ARGS))
@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "not a gguf",
        "truncated gguf",
        "empty dir",
        "unknown architecture",
        "bad config.json",
        "uncached repo",
    ],
)
def test_bad_model_is_one_line_before_loading(command, case, bad_models, nothing_loads, capsys):
    model, message = bad_models[case]
    argv = [command, *COMMAND_ARGS[command], "--model", model]
    assert_one_line_error(*run_main(capsys, argv), message)


def test_cache_gb_limit_names_the_machine_memory(nothing_loads, capsys):
    from mlx_engine.backend import total_memory_bytes

    gib = total_memory_bytes() / 2**30
    code, out, err = run_main(capsys, ["generate", "--prompt", "hi", "--cache-gb", "1000"])
    assert_one_line_error(code, out, err, f"this machine's {gib:.1f} GiB of memory")


@pytest.mark.parametrize(
    "args, named",
    [
        (["--peers", "127.0.0.1:7611"], "--peers"),
        (["--speculative", "off", "--kv-bits", "8"], "--kv-bits, --speculative"),
        (["--cache-gb", "1"], "--cache-gb"),
    ],
)
def test_chat_with_a_server_refuses_options_for_a_local_engine(args, named, nothing_loads, capsys):
    """`duet chat --server URL` loads no model: an engine option (peers, cache, speculation) would be
    silently dropped, so it is one line naming the options, before anything connects or loads."""
    argv = ["chat", "--server", "http://127.0.0.1:9", *args]
    code, out, err = run_main(capsys, argv)
    assert_one_line_error(code, out, err, named)
    assert "--server" in err and "duet serve" in err


def test_chat_options_reach_the_engine_config(monkeypatch):
    """`duet chat` builds its engine options with the same builder as the other commands: the
    full-screen chat gets --cache-fraction and --kv-bits instead of dropping them."""
    import app.tui.main
    from app.tui.backends import LocalBackend

    built = {}
    monkeypatch.setattr(app.tui.main, "ChatApp", lambda model, **kw: built.update(kw, model=model))
    args = cli.build_parser().parse_args(["chat", "--cache-fraction", "0.2", "--kv-bits", "8"])
    app.tui.main.build_app(args)
    load = built["load_backend"]
    assert load.func == LocalBackend.load
    assert load.keywords["config"] == options.engine_config(args)
    assert load.keywords["config"].cache_fraction == 0.2 and load.keywords["config"].kv_bits == 8


def test_bad_arguments_end_to_end_print_one_line(bad_models):
    """The real command: one line on stderr, exit code 2, no traceback."""
    for argv, message in [
        (["generate", "--prompt", "hi", "--cache-gb", "1000"], "is more than this machine's"),
        (["serve", "--model", bad_models["not a gguf"][0]], "is not a GGUF file"),
        (["chat", "--cache-fraction", "2"], "--cache-fraction must be"),
    ]:
        r = duet(*argv, timeout=120)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("duet: error: ") and message in r.stderr
        assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr


# --- chat without a terminal --------------------------------------------------------------------
def test_chat_through_a_pipe_streams_replies_to_stdout(tiny_dirs):
    """`echo hi | duet chat` answers each line of stdin on stdout and exits at end of input,
    instead of opening the full-screen app with no terminal (which hung)."""
    r = duet("chat", "--model", str(tiny_dirs("llama")), stdin="hi\nand again\n", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no reply on stdout"
    assert "Type a message" not in r.stdout and "> " not in r.stdout[:2]  # quiet: replies only
    assert "\x1b[" not in r.stdout  # no terminal escape codes
    assert "Traceback" not in r.stderr and "error" not in r.stderr


@pytest.fixture
def record_line_chat(monkeypatch, capsys):
    """Run ``line_chat`` on the given stdin lines with short replies; returns (exit code, the
    messages of each request, each reply's text, stdout, stderr)."""
    import io

    import app.tui.settings
    from app.tui.backends import LocalBackend

    seen: list[list[dict]] = []
    replies: list[str] = []
    stream = LocalBackend.stream
    sampling = app.tui.settings.Sampling

    async def recording_stream(self, messages, sampling):
        seen.append([dict(m) for m in messages])
        text = []
        async for ev in stream(self, messages, sampling):
            text.append(ev.text)
            if ev.finished:
                replies.append("".join(text))
            yield ev

    monkeypatch.setattr(LocalBackend, "stream", recording_stream)
    monkeypatch.setattr(app.tui.settings, "Sampling", lambda: sampling(max_tokens=8))

    def run(model, stdin: str):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        args = cli.build_parser().parse_args(["chat", "--model", str(model)])
        code = chat_command.line_chat(args, options.engine_config(args), interactive=False)
        out = capsys.readouterr()
        return code, seen, replies, out.out, out.err

    return run


def test_line_chat_sends_the_conversation_and_prints_each_reply(tiny_dirs, record_line_chat):
    """Each line is a user turn, the next request carries the exchange before it, and stdout is
    the replies, each ending its line."""
    code, seen, replies, out, err = record_line_chat(
        tiny_dirs("llama"), "first question\n\nsecond question\n"
    )
    assert code == 0 and err == ""
    assert seen == [  # the blank line is skipped
        [{"role": "user", "content": "first question"}],
        [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": replies[0]},
            {"role": "user", "content": "second question"},
        ],
    ]
    assert out == "".join(reply + "\n" for reply in replies)


def test_line_chat_drops_old_turns_to_fit_and_survives_a_message_too_long(
    short_context_dir, record_line_chat
):
    """When the conversation outgrows the context the oldest exchange goes; a message that
    cannot fit even alone is a one-line error, and the chat goes on (exit code 1 at the end)."""
    first = "The quick brown fox jumps over the lazy dog."  # ~20 tokens: one fits, two do not
    second = "Hello world! Hello again, world. The end."
    too_long = " ".join([first] * 6)
    stdin = f"{first}\n{second}\n{too_long}\nlast\n"
    code, seen, replies, out, err = record_line_chat(short_context_dir, stdin)
    user = [{"role": "user", "content": m} for m in (first, second, too_long, "last")]
    assert seen[:3] == [
        [user[0]],
        [user[0], {"role": "assistant", "content": replies[0]}, user[1]],  # refused: too long
        [user[1]],  # so the first exchange was dropped
    ]
    exchange = [user[1], {"role": "assistant", "content": replies[1]}]
    assert seen[3] == [*exchange, user[2]]
    assert seen[4] == [user[2]]  # refused alone too: a one-line error, and the chat goes on
    assert seen[5:] in ([[*exchange, user[3]]], [[*exchange, user[3]], [user[3]]])
    assert len(replies) == 3
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("duet: error: ") and "context" in lines[0], err
    assert code == 1
    assert out == "".join(reply + "\n" for reply in replies)


# --- help ---------------------------------------------------------------------------------------
def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every command, and every command of a command (``peer serve``), by its name."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    out = dict(sub.choices)
    for name, p in sub.choices.items():
        if any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
            out.update({f"{name} {k}": v for k, v in subcommands(p).items()})
    return out


def test_every_option_of_every_command_has_help():
    parser = cli.build_parser()
    commands = subcommands(parser)
    assert set(commands) == {
        "generate",
        "chat",
        "serve",
        "models",
        "pull",
        "rm",
        "show",
        "ps",
        "peer",
        "peer serve",
        "peer pair",
        "peer unpair",
        "peer plan",
        "peers",
        "doctor",
        "service",
        "service install",
        "service uninstall",
        "service status",
    }
    missing = []
    for name, p in commands.items():
        assert p.description, f"duet {name} has no description"
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"duet {name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help text: {missing}"
    for name, p in commands.items():  # and every help renders (a stray % breaks argparse)
        assert "usage: duet " + name in p.format_help()


def test_engine_flags_are_derived_from_the_config_fields():
    """Each engine flag's type, choices and default come from its EngineConfig field (written once):
    a command given none of them builds exactly EngineConfig's defaults, and each flag given lands
    in its field."""
    import dataclasses

    from app.cli import build_parser
    from app.options import MODEL_FLAGS, engine_config
    from mlx_engine.config import KV_DTYPES, EngineConfig

    parser = build_parser()
    serve = parser.parse_args(["serve"])
    assert engine_config(serve) == EngineConfig()
    actions = {a.dest: a for a in parser._subparsers._group_actions[0].choices["serve"]._actions}
    assert tuple(actions["kv_dtype"].choices) == KV_DTYPES
    assert f"default {EngineConfig().max_queue}" in actions["max_queue"].help
    given = {
        "context_length": "64",
        "kv_bits": "8",
        "cache_gb": "0.5",
        "weights": "dense",
        "speculative": "off",
    }
    argv = ["serve", "--max-queue", "7", "--max-running", "3"]
    for name, value in given.items():
        argv += ["--" + name.replace("_", "-"), value]
    config = engine_config(parser.parse_args(argv))
    assert (config.max_queue, config.max_running, config.context_length, config.kv_bits) == (7, 3, 64, 8)
    assert (config.cache_gb, config.weights, config.speculative) == (0.5, "dense", "off")
    flagged = {f.name for f in dataclasses.fields(EngineConfig) if "flag" in f.metadata}
    assert set(MODEL_FLAGS) | {"max_queue", "max_running"} == flagged
