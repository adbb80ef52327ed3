"""The Engine's life and its errors: options checked before loading, the error classes callers
tell apart (ContextLengthError, EngineShutDownError, ConfigError), max_tokens None (until the
context is full), and shutdown (joined, idempotent, in-flight requests ended, clean exit)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pytest

import mlx_engine.engine.api
import mlx_engine.engine.build
from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.errors import ConfigError, ContextLengthError, EngineShutDownError, RequestError
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return load_model(str(tiny_dirs("llama")))


@pytest.fixture(scope="module")
def short_context(short_context_dir):
    """The tiny llama with a 48-token context."""
    return load_model(str(short_context_dir))


async def collect(engine: Engine, request: GenerationRequest):
    return [ev async for ev in engine.generate(request)]


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "duet-engine"]


def test_bad_options_fail_before_the_model_loads(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(mlx_engine.engine.api, "load_model", load)
    for config in (EngineConfig(cache_gb=0), EngineConfig(cache_gb=10**6), EngineConfig(kv_bits=2)):
        with pytest.raises(ConfigError):
            Engine.load(None, config=config)


def test_kv_cache_and_weights_beyond_memory_is_a_config_error(loaded, monkeypatch):
    """Checked after the weights are in (their size is known then) but before the KV pool is
    allocated; the engine's thread does not outlive the failed start."""
    memory = loaded.weight_bytes + 1  # no room for even the smallest KV pool (two blocks)
    monkeypatch.setattr(mlx_engine.engine.build, "total_memory_bytes", lambda: memory)
    before = engine_threads()
    with pytest.raises(ConfigError, match=r"the KV cache \(.* GiB\) and the model's weights"):
        Engine(loaded, EngineConfig(max_running=64))
    assert engine_threads() == before


def test_defaults_come_from_the_shared_set():
    from mlx_engine import defaults

    assert GenerationRequest().max_tokens is None
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (
        defaults.TEMPERATURE,
        defaults.TOP_K,
        defaults.TOP_P,
        defaults.MIN_P,
        defaults.REPETITION_PENALTY,
    )


def test_max_tokens_none_runs_until_the_context_is_full(short_context):
    with Engine(short_context, EngineConfig(cache_gb=0.01)) as engine:
        prompt = list(range(3, 13))
        req = GenerationRequest(prompt=prompt, max_tokens=None, sampling=GREEDY, ignore_eos=True)
        last = asyncio.run(collect(engine, req))[-1]
        assert last.finish_reason == "length"
        assert last.usage.completion_tokens == 48 - len(prompt)  # the whole context, no more
        capped = GenerationRequest(prompt=prompt, max_tokens=5, sampling=GREEDY, ignore_eos=True)
        assert asyncio.run(collect(engine, capped))[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_bad_max_tokens_is_a_request_error(loaded, bad):
    with Engine(loaded, EngineConfig(cache_gb=0.01)) as engine:
        with pytest.raises(RequestError) as e:
            engine.prepare_prompt(GenerationRequest(prompt="hi", max_tokens=bad))
        assert e.value.param == "max_tokens" and not isinstance(e.value, ContextLengthError)


def test_prompts_that_do_not_fit_are_context_length_errors(short_context, loaded):
    with Engine(short_context, EngineConfig(cache_gb=0.01)) as engine:
        with pytest.raises(ContextLengthError, match="the model's context is 48 tokens") as e:
            asyncio.run(collect(engine, GenerationRequest(prompt=list(range(3, 51)))))
        assert e.value.param == "prompt"
        with pytest.raises(ContextLengthError) as e:
            engine.prepare_prompt(GenerationRequest(messages=[{"role": "user", "content": "hello " * 60}]))
        assert e.value.param == "messages"
    # a KV cache of one block (the smallest budget) holds 16 tokens, whatever the context
    with Engine(loaded, EngineConfig(cache_gb=1e-9, block_size=16)) as engine:
        assert engine.allocator.num_blocks == 2
        with pytest.raises(ContextLengthError, match="more than the KV cache holds"):
            engine.prepare_prompt(GenerationRequest(prompt=list(range(3, 23))))


class GateAfterFirstToken:
    """A constraint that holds the worker before its second token until released, so a test can
    act while a request is certainly mid-generation (no race with a fast model)."""

    def __init__(self):
        self.calls = 0
        self.reached = threading.Event()
        self.release = threading.Event()

    def allowed_tokens(self):
        self.calls += 1
        if self.calls == 2:
            self.reached.set()
            assert self.release.wait(60), "the test never released the worker"
        return None

    def accept(self, token_id: int) -> None:
        pass

    def is_finished(self) -> bool:
        return False


def test_shutdown_ends_running_requests_and_refuses_new_ones(loaded):
    engine = Engine(loaded, EngineConfig(cache_gb=0.01))
    gate = GateAfterFirstToken()
    req = GenerationRequest(prompt="hello", max_tokens=50, sampling=GREEDY, ignore_eos=True, constraint=gate)

    async def scenario():
        events = []
        stopper = None
        async for ev in engine.generate(req):
            events.append(ev)
            if stopper is None:  # the first token is out and the worker waits at the gate
                await asyncio.to_thread(gate.reached.wait, 60)
                stopper = threading.Thread(target=engine.shutdown)
                stopper.start()
                while not engine._stopping:  # shutdown() raises the flag before it joins
                    await asyncio.sleep(0.001)
                gate.release.set()
        stopper.join(60)
        return events

    events = asyncio.run(scenario())
    last = events[-1]
    assert last.finish_reason == "error" and last.error_type is EngineShutDownError
    assert last.error == "the engine shut down"
    assert not engine._thread.is_alive()  # shutdown waited for the worker
    with pytest.raises(EngineShutDownError):
        asyncio.run(collect(engine, GenerationRequest(prompt="again", max_tokens=2)))
    engine.shutdown()  # a second shutdown is harmless


def test_with_block_shuts_the_engine_down(loaded):
    with Engine(loaded, EngineConfig(cache_gb=0.01)) as engine:
        assert engine._thread.is_alive()
    assert not engine._thread.is_alive()
    assert engine not in mlx_engine.engine.api._live_engines


@pytest.mark.slow
def test_a_script_that_never_shuts_down_exits_cleanly(tiny_dirs, tmp_path):
    """The atexit hook shuts down engines left running: no abort at interpreter exit."""
    script = tmp_path / "forget.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio
            from mlx_engine import Engine, GenerationRequest

            engine = Engine.load({str(tiny_dirs("llama"))!r})

            async def main():
                async for ev in engine.generate(GenerationRequest(prompt="hi", max_tokens=4)):
                    pass
                print(ev.finish_reason)

            asyncio.run(main())
            """
        )
    )
    for run in range(6):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"run {run + 1}: exit {r.returncode}\n{r.stderr}"
        assert r.stdout.strip() in ("stop", "length") and "terminate called" not in r.stderr
