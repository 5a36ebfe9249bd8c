"""The adaptive prefill chunk (`runtime.step_budget`): against a simulated device whose step times are known, the
chunk it picks keeps a mixed step within the ratio; the scheduler and the engine use it."""

import asyncio
import random

import pytest

from deltaserve.runtime.engine import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.runtime.scheduler import Scheduler
from deltaserve.runtime.step_budget import StepBudget


class Device:
    """Step seconds: decode(bucket) + (fixed + per_token * p when p prompt tokens ride along) * (1 + crowding *
    bucket), noise +-3%."""

    def __init__(self, fixed=1e-3, per_token=10e-6, seed=0, crowding=0.0):
        self.fixed, self.per_token, self.rng, self.crowding = fixed, per_token, random.Random(seed), crowding

    @staticmethod
    def decode(bucket):
        return 2e-3 + 0.05e-3 * bucket

    def chunk(self, bucket, tokens):
        return (self.fixed + self.per_token * tokens) * (1 + self.crowding * bucket) if tokens else 0.0

    def step(self, bucket, tokens):
        seconds = (self.decode(bucket) if bucket else 0.0) + self.chunk(bucket, tokens)
        return seconds * self.rng.uniform(0.97, 1.03)


def run_steps(budget, device, steps, bucket=32, prompt_every=3, outlier_at=None):
    """Mixed steps carrying what the budget allows, every `prompt_every`-th step decode only; some prefill-only
    steps at the start (nothing decodes yet)."""
    for i in range(4):
        budget.observe(0, 2048, device.step(0, 2048))
    for i in range(steps):
        tokens = 0 if i % prompt_every == 0 else budget.tokens(bucket)
        seconds = 10.0 if i == outlier_at else device.step(bucket, tokens)  # a compile in the middle of a step
        budget.observe(bucket, tokens, seconds)


@pytest.mark.parametrize("fixed_ms", [0.0, 1.0, 1.5])
def test_the_chunk_converges_to_where_a_mixed_step_takes_ratio_times_a_decode_step(fixed_ms):
    device, budget = Device(fixed=fixed_ms * 1e-3), StepBudget(max_tokens=2048, ratio=2.0)
    run_steps(budget, device, 90)
    allowed = (2.0 - 1.0) * device.decode(32) - device.fixed  # seconds a chunk may add
    ideal = allowed / device.per_token
    assert ideal < 2048  # the budget binds, so the test says something
    tokens = budget.tokens(32)
    assert abs(tokens - ideal) < 0.12 * ideal, (tokens, ideal)
    mixed = device.decode(32) + device.fixed + device.per_token * tokens
    assert mixed <= 2.0 * device.decode(32) * 1.06
    # A bigger batch's step is longer, so it may carry more; one never measured alone takes its nearest's time.
    assert budget.tokens(64) == budget.tokens(32)
    budget.observe(64, 0, device.decode(64))
    assert budget.tokens(64) > tokens


def test_a_chunk_that_costs_more_beside_more_rows_still_keeps_each_bucket_within_the_ratio():
    """A chunk beside 64 rows costs 1.6x what it costs alone, beside 8 rows 1.1x (the prefill-only steps see
    neither): each bucket's own fit keeps its steps within the ratio."""
    device, budget = Device(crowding=0.01), StepBudget(max_tokens=2048, ratio=2.0)
    for bucket in (8, 64, 8, 64):
        run_steps(budget, device, 60, bucket=bucket)
    for bucket in (8, 64):
        mixed = device.decode(bucket) + device.chunk(bucket, budget.tokens(bucket))
        assert 1.8 * device.decode(bucket) <= mixed <= 2.0 * device.decode(bucket) * 1.06, bucket


def test_a_seeded_budget_keeps_the_fastest_decode_times_only():
    budget = StepBudget(max_tokens=2048, ratio=2.0)
    budget.observe(8, 0, 0.5)  # a step that paid a compile
    run_steps(budget, Device(), 30, bucket=8)
    seeded = budget.seeded()
    assert seeded.chunk_cost() is None
    assert seeded.decode_s[8] == pytest.approx(Device.decode(8), rel=0.04)
    assert seeded.tokens(8) == 2048  # nothing known of chunks yet


def test_no_decode_rows_or_ratio_off_or_nothing_measured_means_the_whole_budget():
    budget = StepBudget(max_tokens=1000, ratio=2.0)
    assert budget.tokens(8) == 1000  # nothing measured yet
    run_steps(budget, Device(), 60, bucket=8)
    assert budget.tokens(8) < 1000
    assert budget.tokens(0) == 1000  # a prefill-only step keeps nobody waiting but the prompts
    off = StepBudget(max_tokens=1000, ratio=0)
    run_steps(off, Device(), 60, bucket=8)
    assert off.tokens(8) == 1000


def test_a_fixed_cost_above_the_ratio_keeps_whole_chunks():
    """When a chunk's fixed cost alone takes a step past the ratio, smaller chunks only add fixed costs."""
    device, budget = Device(fixed=4e-3, per_token=10e-6), StepBudget(max_tokens=2048, ratio=2.0)
    run_steps(budget, device, 60)
    assert budget.tokens(32) == 2048


def test_a_chunk_carries_at_least_its_fixed_costs_worth_of_tokens():
    """The ratio leaves a chunk 1.1 ms (110 tokens) beside a fixed cost of 2.5 ms: most of such a step would be
    the fixed part, so the chunk takes the fixed cost's worth, 250 tokens (a step of decode + twice the fixed)."""
    device, budget = Device(fixed=2.5e-3, per_token=10e-6), StepBudget(max_tokens=2048, ratio=2.0)
    run_steps(budget, device, 90)
    worth = device.fixed / device.per_token
    assert (2.0 - 1.0) * device.decode(32) - device.fixed < worth * device.per_token  # the floor binds
    assert abs(budget.tokens(32) - worth) < 0.12 * worth, budget.tokens(32)


def test_one_stalled_step_moves_the_chunk_a_bounded_factor_and_it_recovers():
    device = Device()
    steady, stalled = StepBudget(2048, 2.0), StepBudget(2048, 2.0)
    run_steps(steady, device, 60)
    run_steps(stalled, device, 60, outlier_at=58)
    assert stalled.tokens(32) >= steady.tokens(32) / StepBudget.MAX_JUMP
    run_steps(stalled, device, 120)
    assert abs(stalled.tokens(32) - steady.tokens(32)) < 0.12 * steady.tokens(32)


def test_bad_budgets_are_refused():
    for kw in (dict(max_tokens=0, ratio=2.0), dict(max_tokens=10, ratio=1.0), dict(max_tokens=10, ratio=-1)):
        with pytest.raises(ValueError):
            StepBudget(**kw)


def test_the_scheduler_sizes_chunks_beside_decode_rows_by_the_budget():
    budget = StepBudget(max_tokens=100, ratio=2.0)
    s = Scheduler(num_pages=400, page_size=4, max_batch=4, max_prefill_slots=2, prefill_token_budget=100,
                  max_model_len=600, buckets=[1, 2, 4], step_budget=budget)
    s.add("a", 10, 50)
    plan = s.schedule()
    assert [w.length for w in plan.prefill] == [10]
    s.on_prefill_done(plan.prefill)
    plan = s.schedule()  # "a" decodes alone: its step time per bucket is learned
    assert plan.decode_ids == ["a"] and not plan.prefill
    budget.observe(plan.bucket, 0, 2e-3)
    budget.observe(0, 100, 100 * 10e-6)  # prompt tokens cost 10 us each: 1 ms of chunk at 100 tokens
    s.on_decode_done(plan.decode_ids)
    s.add("b", 300, 5)
    lengths = []
    while "b" in s.prefilling or "b" in s.waiting:
        plan = s.schedule()
        assert plan.decode_ids == ["a"]
        lengths.append(sum(w.length for w in plan.prefill))
        s.on_prefill_done(plan.prefill)
        s.on_decode_done(plan.decode_ids)
    # 2 ms of decode at ratio 2 leaves 2 ms for the chunk: 200 tokens, but never more than the 100 most.
    assert lengths == [100, 100, 100]
    budget.max_tokens = s.prefill_token_budget = 1000
    s.add("c", 450, 5)
    plan = s.schedule()
    # Beside "a" and "b" decoding, "c" waits for its first token: it weighs as a decoding row does, so the chunk
    # may stall the step by half as much again (300 tokens, where 200 keep the ratio).
    assert plan.decode_ids == ["a", "b"] and 150 < budget.tokens(2) < 250
    assert [w.length for w in plan.prefill] == [budget.tokens(2, rows=2, waiting=1)]
    assert budget.tokens(2, rows=2, waiting=1) == pytest.approx(1.5 * budget.tokens(2), abs=2)


def test_waiting_requests_widen_the_chunk_in_proportion():
    """A burst: many prompts waiting beside few decoding rows carry (nearly) the whole budget; a full batch with
    one waiting, about the ratio's chunk."""
    budget = StepBudget(max_tokens=2048, ratio=2.0)
    budget.observe(16, 0, 14e-3)
    budget.observe(0, 256, 1e-3 + 256 * 72e-6)
    budget.observe(0, 2048, 1e-3 + 2048 * 72e-6)
    alone = budget.tokens(16)
    assert 150 < alone < 200  # 14 ms of chunk at 72 us a token, less its fixed 1 ms
    assert budget.tokens(16, rows=16, waiting=1) < 1.1 * alone
    assert budget.tokens(16, rows=2, waiting=14) > 7 * alone


def test_the_engine_learns_its_step_times_and_serves_exactly_with_adaptive_chunks(tiny_ckpt):
    """Requests arriving while others decode: the engine's budget has measured decode steps and chunks, the
    chunks beside decode rows follow it, and every output equals the same request served alone with the budget
    off (greedy)."""
    rng = random.Random(70)
    prompts = [[rng.randrange(500) for _ in range(40 + 30 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def serve(ratio, together):
        args = EngineArgs(model=tiny_ckpt, max_model_len=512, max_batch=8, cpu_memory_bytes=64 << 20,
                          prefill_token_budget=96, step_latency_ratio=ratio)
        async with AsyncEngine(args) as engine:
            seen = []  # per step: decode bucket, prompt tokens, the budget it was planned with
            schedule = engine.scheduler.schedule

            def record():
                plan = schedule()
                seen.append((plan.bucket, sum(w.length for w in plan.prefill), plan.prompt_budget))
                return plan

            engine.scheduler.schedule = record

            async def late(i):
                await asyncio.sleep(0.02 * i)
                return await alone(i)

            async def alone(i):
                out = None
                async for out in engine.generate(prompts[i], params):
                    pass
                return out.token_ids

            if together:
                outs = await asyncio.gather(*[late(i) for i in range(len(prompts))])
            else:
                outs = [await alone(i) for i in range(len(prompts))]
            return outs, seen, engine.scheduler.step_budget

    adaptive, seen, budget = asyncio.run(serve(2.0, together=True))
    alone, _, _ = asyncio.run(serve(0, together=False))
    assert adaptive == alone
    assert budget.decode_s and budget.chunk_cost() is not None
    mixed = [(bucket, tokens) for bucket, tokens, _ in seen if bucket and tokens]
    assert mixed, "no prompt was prefilled beside decode rows"
    assert all(tokens <= allowed for bucket, tokens, allowed in seen if bucket and tokens)
