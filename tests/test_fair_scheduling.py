"""Fair scheduling between client requests (issue 11: "one request can take the whole engine").

The sequences of one client request (its prompts x n choices) share a group; the scheduler serves
groups round-robin and, when slots or KV blocks are all taken, moves a sequence of the biggest group
aside for a group that runs fewer. Scheduler cases are driven step by step without a model; the
engine case counts scheduler steps on a tiny model (never seconds).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.kv_cache.block_allocator import BlockAllocator
from mlx_engine.request import GenerationRequest, SamplingParams
from mlx_engine.scheduler import FINISHED, RUNNING, WAITING, Scheduler, SchedulerConfig, Sequence

BS = 4


class Driver:
    """Runs scheduler steps the way the engine does, with a token per finished prefill."""

    def __init__(self, num_blocks: int = 2000, **config):
        self.alloc = BlockAllocator(num_blocks, BS)
        self.sched = Scheduler(self.alloc, SchedulerConfig(**{"max_queue": 10_000, **config}))
        self.seqs: dict[str, Sequence] = {}
        self.steps: list[dict[str, int]] = []

    def add(self, rid: str, prompt: list[int], max_new: int, group: str | None = None) -> Sequence:
        seq = Sequence(rid, list(prompt), len(prompt), len(prompt) + max_new, group=group)
        self.seqs[rid] = seq
        self.sched.add(seq)
        return seq

    def fan_out(self, group: str, count: int, max_new: int, prompt_len: int = 6) -> list[Sequence]:
        return [
            self.add(f"{group}{i}", [i % 50 + 1] * prompt_len, max_new, group=group) for i in range(count)
        ]

    def step(self) -> dict[str, int]:
        step = self.sched.schedule()
        for rid in step.tokens:
            assert self.seqs[rid].status == RUNNING
        for rid in self.sched.advance(step):
            seq = self.seqs[rid]
            seq.tokens.append(7)
            if len(seq.tokens) >= seq.max_total:
                self.sched.finish(seq)
        self.alloc.check_invariants()
        self.steps.append(step.tokens)
        return step.tokens

    def run_until(self, done, limit: int = 10_000) -> int:
        """Steps until ``done()``; fails past ``limit`` (a starved sequence never finishes)."""
        for i in range(limit):
            if done():
                return i
            self.step()
        raise AssertionError(f"not done after {limit} steps")


def test_a_fan_out_that_fills_every_slot_delays_a_small_request_by_one_step():
    # 16 prompts x n=16 against 64 running slots, as in the issue; each choice writes 100 tokens
    d = Driver(max_running=64, max_batch_tokens=512, prefill_chunk=256)
    big = d.fan_out("big", 256, max_new=100)
    d.run_until(lambda: sum(s.status == RUNNING and s.num_pending == 1 for s in big) == 64)
    assert sum(s.status == WAITING for s in big) == 192
    small = d.add("small", [60, 61, 62, 63, 64], max_new=10)
    first = d.step()
    assert first["small"] == 5  # admitted and prefilled in the very next step
    assert small.num_generated == 1
    # then decoded every step until it is done: 9 more steps
    for _ in range(9):
        assert d.step()["small"] == 1
    assert small.status == FINISHED
    assert d.sched.preemptions == 1  # one choice of the fan-out stepped aside, once
    # the fan-out itself still completes, every choice of it
    d.run_until(lambda: all(s.status == FINISHED for s in big))
    assert all(s.num_generated == 100 for s in big)
    assert d.alloc.num_used == 0


def test_the_small_request_is_not_preempted_back_and_forth():
    d = Driver(max_running=8, max_batch_tokens=64, prefill_chunk=16)
    d.fan_out("big", 40, max_new=30)
    d.run_until(lambda: len(d.sched.running) == 8)
    small = d.add("small", [60] * 5, max_new=20)
    d.run_until(lambda: small.status == FINISHED)
    assert small.preemptions == 0
    assert d.sched.preemptions == 1
    admitted = next(i for i, s in enumerate(d.steps) if "small" in s)
    ran = [i for i, s in enumerate(d.steps) if "small" in s]
    assert ran == list(range(admitted, admitted + 20))  # a token in every step from admission on


def test_waiting_groups_are_admitted_round_robin():
    d = Driver(max_running=6, max_batch_tokens=512, prefill_chunk=64)
    a = d.fan_out("a", 10, max_new=5)
    b = d.fan_out("b", 10, max_new=5)
    c = d.add("c", [1, 2, 3], max_new=5)
    step = d.step()
    # one of each group, then the second of each group that still waits, ...
    assert list(step) == ["a0", "b0", "c", "a1", "b1", "a2"]
    assert [s.status for s in a[:3] + b[:2]] == [RUNNING] * 5 and c.status == RUNNING
    assert d.sched.preemptions == 0  # room was free: nobody was moved aside


def test_ungrouped_sequences_keep_arrival_order():
    # a sequence without a group is a group of its own: first come, first served, as before
    d = Driver(max_running=2, max_batch_tokens=512, prefill_chunk=64)
    for i, max_new in enumerate([2, 4, 6, 8]):
        d.add(f"r{i}", [1, 2, 3], max_new=max_new)
    admitted = []
    d.run_until(lambda: all(s.status == FINISHED for s in d.seqs.values()))
    for step in d.steps:
        admitted += [rid for rid in step if rid not in admitted]
    assert admitted == ["r0", "r1", "r2", "r3"]
    assert d.sched.preemptions == 0


def test_a_waiting_sequence_gives_its_prefix_hit_back_when_it_cannot_start():
    # 16 sequences outgrow 32 blocks and are preempted in turn. A preempted sequence that finds its
    # prefix cached but no block for the rest must not keep the cached blocks while it waits: with
    # every waiting sequence holding some, nothing could run again (a deadlock).
    d = Driver(num_blocks=33, max_running=64, max_batch_tokens=512, prefill_chunk=64)
    seqs = [d.add(f"s{i}", [i + 1] * 7, max_new=40) for i in range(16)]
    d.run_until(lambda: all(s.status == FINISHED for s in seqs), limit=2000)
    assert d.sched.preemptions > 0 and d.alloc.num_used == 0
    assert all(not s.blocks for s in d.sched.waiting)


def test_kv_blocks_taken_by_a_fan_out_are_shared_with_a_small_request():
    # slots are plenty, KV blocks are not: the fan-out holds every block
    d = Driver(num_blocks=33, max_running=64, max_batch_tokens=512, prefill_chunk=64)
    big = d.fan_out("big", 16, max_new=40, prompt_len=7)  # 2 blocks each, more as they decode
    d.run_until(lambda: d.alloc.num_free == 0 and all(s.status != FINISHED for s in big))
    small = d.add("small", [60] * 7, max_new=6)
    d.run_until(lambda: small.num_generated >= 1, limit=3)
    d.run_until(lambda: small.status == FINISHED, limit=10)
    d.run_until(lambda: all(s.status == FINISHED for s in big))
    assert all(s.num_generated == 40 for s in big)
    assert d.alloc.num_used == 0


def test_running_prefills_share_the_token_budget_round_robin():
    # the fan-out's long prompts are being prefilled in chunks; a small request's prompt is not
    # held back until all of them are done
    d = Driver(max_running=64, max_batch_tokens=64, prefill_chunk=32)
    d.fan_out("big", 8, max_new=5, prompt_len=400)
    d.step()
    small = d.add("small", [60] * 40, max_new=3)
    d.run_until(lambda: small.num_generated >= 1, limit=3)


def test_two_fan_outs_split_the_slots_evenly():
    d = Driver(max_running=8, max_batch_tokens=512, prefill_chunk=64)
    d.fan_out("a", 30, max_new=50)
    d.run_until(lambda: len(d.sched.running) == 8)
    d.fan_out("b", 30, max_new=50)
    for _ in range(4):  # one sequence changes hands per step
        d.step()
    groups = [s.group for s in d.sched.running]
    assert groups.count("a") == 4 and groups.count("b") == 4
    before = d.sched.preemptions
    for _ in range(10):
        d.step()
    assert d.sched.preemptions == before  # balanced: nobody is moved aside again


# --- the engine: a fan-out request and a small one, counted in scheduler steps --------------------


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    e = Engine.load(
        str(tiny_dirs("llama")),
        config=EngineConfig(cache_gb=0.05, max_running=8, max_queue=256, max_batch_tokens=256),
    )
    yield e
    e.shutdown()


GREEDY = SamplingParams(temperature=0.0)


def test_engine_serves_a_small_request_within_a_few_steps_of_a_fan_out(engine):
    """4 prompts x n=8 fill the 8 running slots (24 more wait); a small request submitted then
    gets its first token within 2 scheduler steps and a token in every step after that."""
    log: list[tuple[set[str], dict[str, int]]] = []  # (waiting before the step, the step)
    paused, resume = threading.Event(), threading.Event()
    schedule = engine.scheduler.schedule
    sched = engine.scheduler

    def logged_schedule(proposals=None):
        if not resume.is_set() and len(sched.running) == 8 and sched.waiting:
            paused.set()  # the fan-out holds every slot and more of it waits: submit now
            resume.wait(60)
        waiting = {s.request_id for s in sched.waiting}
        step = schedule(proposals)
        log.append((waiting, dict(step.tokens)))
        return step

    engine.scheduler.schedule = logged_schedule
    try:
        fan = []
        for p in range(4):
            for j in range(8):
                fan.append(
                    GenerationRequest(
                        prompt=[5 + p, 6, 7, 8, 9, 10],
                        max_tokens=40,
                        sampling=GREEDY,
                        ignore_eos=True,
                        request_id=f"fan-{p}-{j}",
                        fork_of=f"fan-{p}-0" if j else None,
                        group="fan",
                    )
                )
        small = GenerationRequest(
            prompt=[11, 12, 13, 14], max_tokens=5, sampling=GREEDY, ignore_eos=True, request_id="small"
        )

        async def consume(req) -> list[int]:
            out = []
            async for ev in engine.generate(req):
                out.extend(ev.token_ids)
            return out

        async def run():
            tasks = [asyncio.create_task(consume(r)) for r in fan]
            assert await asyncio.to_thread(paused.wait, 120), "the fan-out never filled the slots"
            small_task = asyncio.create_task(consume(small))
            await asyncio.sleep(0)  # runs generate() up to its first wait: the request is queued
            resume.set()
            return await asyncio.gather(*tasks), await small_task

        fan_out, small_out = asyncio.run(run())
    finally:
        engine.scheduler.schedule = schedule
    assert len(small_out) == 5 and all(len(o) == 40 for o in fan_out)
    arrived = next(i for i, (waiting, _) in enumerate(log) if "small" in waiting)
    # the scenario happened: when the small request arrived, the fan-out filled every slot and
    # more of it was waiting
    assert sum(rid.startswith("fan") for rid in log[arrived][0]) >= 16
    ran = [i for i, (_, step) in enumerate(log) if "small" in step]
    assert ran[0] - arrived <= 1, f"the small request waited {ran[0] - arrived} steps"
    # prompt in one step, then one token per step: 5 consecutive steps
    assert ran == list(range(ran[0], ran[0] + 5))
    engine.allocator.check_invariants()
    assert engine.allocator.num_used == 0


def test_the_server_puts_the_sequences_of_one_call_in_one_group(engine):
    from app.server.generation import Generation

    reqs = [
        GenerationRequest(prompt=[3 + p, 4, 5], max_tokens=2, sampling=GREEDY, request_id=f"call-{p}-{j}")
        for p in range(2)
        for j in range(3)
    ]
    other = GenerationRequest(prompt=[9, 9], max_tokens=2, sampling=GREEDY, request_id="other")

    async def run():
        gen, alone = Generation(engine, reqs), Generation(engine, [other])
        await gen.start(3)
        await alone.start(1)
        async for _ in gen.events():
            pass
        async for _ in alone.events():
            pass

    asyncio.run(run())
    assert {r.group for r in reqs} == {"call-0-0"}
    assert [r.fork_of for r in reqs] == [None, "call-0-0", "call-0-0", None, "call-1-0", "call-1-0"]
    assert other.group == "other"
