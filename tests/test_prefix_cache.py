"""Prefix caching: the scheduler's page and snapshot bookkeeping against a model of what the ranks hold, and the
engine's outputs with the cache on against the cache off (greedy tokens identical, log-probs within 1e-5)."""

import asyncio
import random
from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from deltaserve.runtime.engine import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.runtime.prefix_cache import PrefixCache, page_keys
from deltaserve.runtime.scheduler import Scheduler
from deltaserve.runtime.speculation import SpeculationOverride

PS = 4  # a small page, so prompts span many pages


def scheduler(num_pages=48, snapshots=6, budget=10, max_batch=4):
    return Scheduler(num_pages=num_pages, page_size=PS, max_batch=max_batch, max_prefill_slots=2,
                     prefill_token_budget=budget, max_model_len=64, buckets=[1, 2, 4],
                     prefix_cache=PrefixCache(num_pages, PS, snapshots))


class Ranks:
    """What the ranks would hold, by content: each page's token per position, each state slot's and snapshot's
    consumed tokens. Every read checks that what is there is what the reader's request wrote or shares. Requests
    added with `add` draw tokens (a few symbols, so later prompts can resend them) that the scheduler sees."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.page = {}  # (page, offset) -> token written there
        self.slot = {}  # state slot -> the tokens its state has consumed
        self.snap = {}  # snapshot -> the tokens its state has consumed
        self.prompts = {}  # request id -> prompt ids
        self.drawn = {}  # request id -> its drawn tokens (shared with the scheduler)
        self.skipped = {}  # request id -> prompt tokens a cached prefix spared

    def add(self, rid, prompt, max_tokens):
        self.prompts[rid], self.drawn[rid] = prompt, []
        self.s.add(rid, len(prompt), max_tokens, prompt_ids=prompt, drawn=self.drawn[rid])

    def _draw(self, rid):
        if rid in self.drawn:
            self.drawn[rid].append(len(self.drawn[rid]) * 7 % 3)

    def step(self, cancel=()):
        s = self.s
        plan = s.schedule()
        for c in plan.finish_snapshots:  # before the compactions move the slots
            self.snap[c.snapshot] = self.slot[c.slot]
        moved = dict(self.slot)
        for c in plan.compactions:
            if c.moved_from is not None:
                moved[c.hole] = moved[c.moved_from]
        for p in plan.promotions:
            moved[p.to_slot] = self.slot[p.from_slot]
        self.slot = moved
        for c in plan.restores:
            self.slot[c.slot] = self.snap[c.snapshot]
        for src, dst in plan.page_copies:
            for off in range(PS):
                if (src, off) in self.page:
                    self.page[(dst, off)] = self.page[(src, off)]
        for w in plan.prefill:
            prompt = self.prompts[w.request_id]
            if w.first:
                self.skipped[w.request_id] = w.start
            # The state it resumes from and the KV its attention reads are exactly its prompt's.
            assert self.slot.get(w.slot, ()) == tuple(prompt[: w.start]) or w.start == 0, "wrong recurrent state"
            for pos in range(w.start):
                assert self.page.get((w.pages[pos // PS], pos % PS)) == prompt[pos], "a read page was overwritten"
            for pos in range(w.start, w.start + w.length):
                self.page[(w.pages[pos // PS], pos % PS)] = prompt[pos]
            self.slot[w.slot] = tuple(prompt[: w.start + w.length])
            if w.start + w.length == len(prompt):
                self._draw(w.request_id)
        for c in plan.snapshots:
            self.snap[c.snapshot] = self.slot[c.slot]
        for i, rid in enumerate(plan.decode_ids):  # decode reads the prompt's KV, writes its input token's, draws
            req, prompt = s.requests[rid], self.prompts[rid]
            for pos in range(len(prompt)):
                assert self.page.get((req.pages[pos // PS], pos % PS)) == prompt[pos], "a decoding row's page changed"
            pos = len(prompt) + req.generated - 1
            if rid in self.drawn:  # its state: the prompt and every token drawn before the input one
                token = self.drawn[rid][req.generated - 1]
                assert self.slot[i] == tuple(prompt) + tuple(self.drawn[rid][: req.generated - 1])
            else:
                token = ("out", rid, pos)
            self.page[(req.pages[pos // PS], pos % PS)] = token
            self.slot[i] += (token,)
            self._draw(rid)
        s.on_prefill_done(plan.prefill)
        s.on_decode_done(plan.decode_ids)
        for rid in cancel:
            s.finish(rid)
        s.check_invariants()
        return plan


alphabet = st.integers(0, 2)  # few symbols: prompts share prefixes often


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.s = scheduler()
        self.ranks = Ranks(self.s)
        self.n = 0
        self.base = [random.Random(1).randrange(3) for _ in range(40)]

    @rule(cut=st.integers(1, 40), extra=st.lists(alphabet, max_size=8), max_tokens=st.integers(1, 6))
    def add(self, cut, extra, max_tokens):
        self._add((self.base[:cut] + extra)[:50], max_tokens)

    @rule(which=st.integers(0, 50), extra=st.lists(alphabet, min_size=1, max_size=8), max_tokens=st.integers(1, 6))
    def next_turn(self, which, extra, max_tokens):
        """A conversation's next turn: an earlier request's prompt, what it drew so far, a new message."""
        if self.ranks.drawn:
            rid = sorted(self.ranks.drawn)[which % len(self.ranks.drawn)]
            self._add((self.ranks.prompts[rid] + self.ranks.drawn[rid] + extra)[:56], max_tokens)

    def _add(self, prompt, max_tokens):
        self.ranks.add(f"r{self.n}", prompt, max_tokens)
        self.n += 1

    @rule(which=st.integers(0, 50))
    def cancel(self, which):
        live = sorted(self.s.requests)
        if live:
            self.s.finish(live[which % len(live)])

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.ranks.step()

    @rule()
    def forget(self):
        self.s.cache.clear()

    @invariant()
    def consistent(self):
        self.s.check_invariants()

    def teardown(self):
        for _ in range(500):
            if not self.s.has_work:
                break
            self.ranks.step()
        assert not self.s.requests and not self.s.has_work
        # Only the snapshots' tail pages are held; nothing else leaked.
        assert self.s.held_pages == self.s.cache.snapshots.held_pages and len(self.s.free_prefill_slots) == self.s.max_prefill_slots
        self.s.cache.clear()
        assert self.s.held_pages == 0 and self.s.pages.refs == [0] * self.s.num_pages


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def drain(ranks):
    for _ in range(200):
        if not ranks.s.has_work:
            return
        ranks.step()


def test_repeats_extensions_branches_and_short_prompts_hit_where_they_should():
    s = scheduler(num_pages=80, snapshots=8, budget=64)
    ranks = Ranks(s)

    def serve(rid, prompt, max_tokens=2):
        ranks.prompts[rid] = prompt
        s.add(rid, len(prompt), max_tokens, prompt_ids=prompt)
        drain(ranks)
        return ranks.skipped[rid]

    a = list(range(100, 130))  # 30 tokens: 7 full pages and 2 more
    assert serve("a", a) == 0
    assert serve("a+", a + [1, 2, 3]) == 30  # the next turn resumes at the end of the last prompt (a tail)
    # The same prompt again resumes after all of it: the snapshot at its end, taken where a prefill chunk ended,
    # holds the hidden state the first token's logits come from. One taken as a request finished does not (the
    # decode steps do not keep it).
    assert serve("a again", a) == 30
    assert serve("a third", a) == 30
    b = a[:13] + [7, 7, 7, 7, 7]  # diverges inside page 3: pages 0-2 are shared
    first_b = serve("b", b)
    assert first_b <= 12
    assert serve("b'", a[:13] + [9, 9, 9]) == 12  # the branch point b left at its divergence page boundary
    assert serve("short", [5, 6]) == 0
    assert serve("short+", [5, 6, 8]) == 2  # shorter than a page: the tail alone


def test_a_prompt_ending_where_a_request_finished_computes_its_last_tokens():
    """A finish snapshot (a decoding request's state after the tokens it was fed) holds no hidden state: a prompt
    that is exactly that prefix resumes at the request's prompt end instead, and computes the rest."""
    s = scheduler(num_pages=80, snapshots=8, budget=64)
    ranks = Ranks(s)
    a = list(range(100, 130))
    ranks.add("a", a, 3)
    drain(ranks)
    fed = a + ranks.drawn["a"][:2]  # the prompt and the drawn tokens fed back: what its finish snapshot holds
    assert [(snap.position, snap.logits) for snap in s.cache.snapshots.lru.values()] == [(30, True), (32, False)]
    ranks.prompts["b"] = fed
    s.add("b", len(fed), 2, prompt_ids=fed)
    drain(ranks)
    assert ranks.skipped["b"] == len(a)


def test_prompts_arriving_together_resume_where_the_first_leaves_their_shared_prefix():
    """Three prompts with one 30-token system prompt (7 full pages) arrive at once: the first computes it and
    snapshots where they part (page boundary 28, between its page-aligned chunk ends); the others wait for that
    and resume there, instead of computing the same tokens beside it."""
    s = scheduler(num_pages=120, snapshots=8, budget=12)
    ranks = Ranks(s)
    system = list(range(100, 130))
    for i in range(3):
        prompt = system + [200 + i, 300 + i, 400 + i]
        ranks.prompts[f"q{i}"] = prompt
        s.add(f"q{i}", len(prompt), 2, prompt_ids=prompt)
    plan = ranks.step()
    assert [w.request_id for w in plan.prefill] == ["q0"]  # the others wait (no slot, no pages taken)
    assert s.waiting == deque(["q1", "q2"]) and len(s.free_prefill_slots) == 1
    drain(ranks)
    assert ranks.skipped == {"q0": 0, "q1": 28, "q2": 28}
    # Unrelated prompts never wait for each other.
    for i in range(2):
        prompt = [500 + 10 * i + j for j in range(30)]
        ranks.prompts[f"u{i}"] = prompt
        s.add(f"u{i}", len(prompt), 2, prompt_ids=prompt)
    ranks.step()
    assert not s.waiting and set(s.prefilling) == {"u0", "u1"}  # both admitted at once
    drain(ranks)


def test_the_same_prompt_sent_together_is_computed_once():
    """Best-of-n as separate requests: three copies of a 30-token prompt arrive at once. The first computes it in
    one chunk (no branch point splits it); the others wait and resume after all of it."""
    s = scheduler(num_pages=120, snapshots=8, budget=64)
    ranks = Ranks(s)
    prompt = list(range(100, 130))
    for i in range(3):
        ranks.prompts[f"n{i}"] = prompt
        s.add(f"n{i}", len(prompt), 2, prompt_ids=prompt)
    plan = ranks.step()
    assert [(w.request_id, w.start, w.length) for w in plan.prefill] == [("n0", 0, 30)]
    drain(ranks)
    assert ranks.skipped == {"n0": 0, "n1": 30, "n2": 30}


def test_a_prompt_cached_whole_resumes_in_a_step_whose_prompt_budget_is_spent():
    s = scheduler(num_pages=120, snapshots=8, budget=12)
    ranks = Ranks(s)
    cached = list(range(100, 110))
    ranks.prompts["c"] = cached
    s.add("c", 10, 2, prompt_ids=cached)
    drain(ranks)
    for rid, prompt in (("long", list(range(300, 340))), ("again", cached)):
        ranks.prompts[rid] = prompt
        s.add(rid, len(prompt), 2, prompt_ids=prompt)
    plan = ranks.step()
    assert [(w.request_id, w.start, w.length) for w in plan.prefill] == [("long", 0, 12), ("again", 10, 0)]
    drain(ranks)


def test_a_cached_page_is_evicted_least_recently_used_and_never_while_held():
    s = scheduler(num_pages=12, snapshots=2, budget=64)
    ranks = Ranks(s)
    for i in range(6):  # different prompts of 3 pages each, run one at a time: the pool turns over
        prompt = [i * 10 + j for j in range(12)]
        ranks.prompts[f"p{i}"] = prompt
        s.add(f"p{i}", 12, 3, prompt_ids=prompt)
        drain(ranks)
    keys = page_keys([50 + j for j in range(12)], PS)
    assert all(k in s.pages.page_of for k in keys)  # the newest prompt's pages are still cached
    assert page_keys(list(range(12)), PS)[0] not in s.pages.page_of  # the oldest's went first
    assert len(s.cache.snapshots) <= 2


def test_a_pool_without_snapshots_never_matches():
    s = scheduler(snapshots=0, budget=64)
    ranks = Ranks(s)
    for rid in ("x", "y"):
        ranks.prompts[rid] = list(range(20))
        s.add(rid, 20, 2, prompt_ids=list(range(20)))
        drain(ranks)
    assert ranks.skipped == {"x": 0, "y": 0}


# The engine ---------------------------------------------------------------------------------------------------------
def _prompts():
    rng = random.Random(5)
    system = [rng.randrange(500) for _ in range(45)]
    turn = system + [rng.randrange(500) for _ in range(30)]
    return [
        system + [1, 2, 3],  # a shared prefix, three ways
        system + [4, 5, 6, 7, 8],
        system[:37] + [9],  # a branch inside a page
        turn,  # the next turn of a conversation
        turn + [rng.randrange(500) for _ in range(21)],
        turn,  # repeated, twice
        turn,
        [11, 12, 13],  # shorter than a page, then extended
        [11, 12, 13, 14, 15],
    ]


async def _serve(ckpt, cache, tp=1, overlap=True):
    args = EngineArgs(model=ckpt, max_model_len=256, max_batch=4, prefill_slots=2, cpu_memory_bytes=64 << 20,
                      prefill_token_budget=32, tp=tp, enable_prefix_caching=cache, async_scheduling=overlap)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    async with AsyncEngine(args) as engine:
        outs = []
        for prompt in _prompts():  # one after another: each finds what the ones before it left
            out = None
            async for out in engine.generate(prompt, params):
                pass
            outs.append(out)
        together = await asyncio.gather(*[_last(engine.generate(p, params)) for p in _prompts()[:4]])
        metrics = engine.metrics.render().decode()
        assert engine.resources_free()
        return outs + list(together), metrics


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_outputs_with_the_cache_equal_those_without(tiny_ckpt, tiny_tp_ckpt, tp):
    ckpt = tiny_ckpt if tp == 1 else tiny_tp_ckpt
    cached, metrics = asyncio.run(_serve(ckpt, True, tp))
    plain, _ = asyncio.run(_serve(ckpt, False, tp))
    for a, b in zip(cached, plain):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) < 1e-5
    hits = [o.num_cached_tokens for o in cached]
    assert all(o.num_cached_tokens == 0 for o in plain)
    # What must hit: the conversation's next turn resumes at the end of the turn before, a repeated prompt after
    # all of it (its first run's end snapshot kept the last token's hidden state: only lm_head runs), the
    # extended short prompt after its 3 tokens.
    prompts = _prompts()
    assert hits[4] == len(prompts[3]) and hits[5] == hits[6] == len(prompts[5])
    assert hits[8] == 3
    assert sum(hits) > 0 and "deltaserve_prefix_cache_hits_total" in metrics
    hit_line = [line for line in metrics.splitlines() if line.startswith("deltaserve_prefix_cache_hits_total")]
    assert float(hit_line[0].split()[-1]) == sum(hits)


def test_a_prompt_resumed_whole_samples_as_a_computed_one(tiny_ckpt):
    """Sent twice, with penalties (which count the prompt's tokens), seeded sampling and greedy: the repeat resumes
    after all 45 tokens and draws what the engine without a cache draws."""
    prompt = [(i * 37) % 300 for i in range(45)]
    kinds = [dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5), dict(temperature=0.8, seed=7),
             dict(temperature=0.0)]

    async def serve(cache):
        args = EngineArgs(model=tiny_ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=64 << 20,
                          enable_prefix_caching=cache)
        async with AsyncEngine(args) as engine:
            return [await _last(engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, **kind)))
                    for kind in kinds for _ in range(2)]

    cached, plain = asyncio.run(serve(True)), asyncio.run(serve(False))
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert [o.num_cached_tokens for o in cached] == [0] + [45] * 5


def test_prompts_resumed_whole_and_computed_in_one_step_draw_their_own_tokens(tiny_ckpt, monkeypatch):
    """Two prompts sent before, two fresh, arriving together: one step resumes two and computes two, and each
    draws what the engine without a cache draws for it."""
    from deltaserve.devices.rank import RankRuntime

    prompts = [[(i * 37 + 11 * j) % 300 for i in range(20 + 6 * j)] for j in range(4)]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True)
    steps = []  # (prompts computed, prompts resumed) of each step that draws first tokens
    first_token_logits = RankRuntime._first_token_logits

    def spy(self, cmd, last, logits):
        steps.append((sum(1 for p in cmd.prefill if p.token_ids and p.last),
                      sum(1 for p in cmd.prefill if not p.token_ids)))
        return first_token_logits(self, cmd, last, logits)

    monkeypatch.setattr(RankRuntime, "_first_token_logits", spy)

    async def serve(cache):
        args = EngineArgs(model=tiny_ckpt, max_model_len=256, max_batch=4, prefill_slots=4,
                          cpu_memory_bytes=64 << 20, enable_prefix_caching=cache)
        async with AsyncEngine(args) as engine:
            for p in prompts[1::2]:
                await _last(engine.generate(p, params))
            return await asyncio.gather(*[_last(engine.generate(p, params)) for p in prompts])

    cached, plain = asyncio.run(serve(True)), asyncio.run(serve(False))
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    for a, b in zip(cached, plain):
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert [o.num_cached_tokens for o in cached] == [0, len(prompts[1]), 0, len(prompts[3])]
    assert (2, 2) in steps


@pytest.mark.parametrize("tp,overlap", [(1, True), (1, False), (2, True)])
@pytest.mark.parametrize("ending", ["length", "stop token"])
def test_the_next_turn_resumes_after_the_answer(tiny_ckpt, tiny_tp_ckpt, tp, overlap, ending):
    """A request that ends while decoding leaves its answer cached: the next turn (prompt, answer as drawn, a new
    message) resumes after the answer's last fed token, whether the answer ended at max_tokens or at a stop token
    (with overlap scheduling the stop token was fed to one more step), and computes what it would without it."""
    ckpt = tiny_ckpt if tp == 1 else tiny_tp_ckpt
    rng = random.Random(8)
    prompt = [rng.randrange(500) for _ in range(37)]
    message = [rng.randrange(500) for _ in range(21)]

    async def conversation(cache: bool, stop: int | None):
        args = EngineArgs(model=ckpt, max_model_len=256, max_batch=4, prefill_slots=2, cpu_memory_bytes=64 << 20,
                          prefill_token_budget=32, tp=tp, enable_prefix_caching=cache, async_scheduling=overlap)
        first = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                               stop_token_ids=[stop] if stop is not None else [])
        async with AsyncEngine(args) as engine:
            answer = await _last(engine.generate(prompt, first))
            drawn = answer.token_ids + ([stop] if answer.finish_reason == "stop" else [])
            second = await _last(engine.generate(prompt + drawn + message, SamplingParams(
                max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)))
            assert engine.resources_free()
        return answer, drawn, second

    stop = None
    if ending == "stop token":  # a token the greedy answer draws after a few others, for the first time
        greedy, _, _ = asyncio.run(conversation(False, None))
        stop = next(t for i, t in enumerate(greedy.token_ids) if i >= 4 and t not in greedy.token_ids[:i])
    answer, drawn, cached = asyncio.run(conversation(True, stop))
    _, _, plain = asyncio.run(conversation(False, stop))
    assert answer.finish_reason == ("stop" if stop is not None else "length")
    assert cached.token_ids == plain.token_ids and plain.num_cached_tokens == 0
    for x, y in zip(cached.logprobs, plain.logprobs):
        assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) < 1e-5
    fed = len(prompt) + len(drawn) - 1  # every drawn token but the last was an input
    assert cached.num_cached_tokens == fed + (1 if overlap and stop is not None else 0)


@pytest.mark.parametrize("corrupt_at", [(), (2, 3, 7, 8, 9)])
def test_a_speculative_engines_next_turn_resumes_after_the_answer(tiny_tp_ckpt, corrupt_at):
    """With speculation every step drafts three tokens and keeps some (drafts of the model's own continuation,
    wrong at chosen positions): the answer's snapshot is the state rolled back to what the last step kept, and the
    next turn resumes after the answer's last fed token with the outputs of an engine without the cache."""
    rng = random.Random(9)
    prompt = [rng.randrange(500) for _ in range(37)]
    message = [rng.randrange(500) for _ in range(21)]
    first = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    second = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)

    async def conversation(cache: bool, drafter=None, k: int = 3):
        args = EngineArgs(model=tiny_tp_ckpt, max_model_len=256, max_batch=4, prefill_slots=2,
                          cpu_memory_bytes=96 << 20, enable_prefix_caching=cache, speculative_tokens=k,
                          speculative_adaptive=False)
        async with AsyncEngine(args, speculation_override=SpeculationOverride(drafter)) as engine:
            answer = await _last(engine.generate(prompt, first))
            nxt = await _last(engine.generate(prompt + answer.token_ids + message, second))
            accepted = engine.metrics.spec_accepted._value.get()
            assert engine.resources_free()
        return answer, nxt, accepted

    greedy, _, _ = asyncio.run(conversation(False, k=0))
    continuation = greedy.token_ids + [0] * 8  # asked up to 2k + 1 past the end (a step in flight may keep k + 1)

    def drafter(prompt_ids, output, k):
        n = len(output)
        return [(continuation[n + j] + 1) % 300 if n + j in corrupt_at else continuation[n + j] for j in range(k)]

    answer, cached, accepted = asyncio.run(conversation(True, drafter))
    _, plain, _ = asyncio.run(conversation(False, drafter))
    assert answer.token_ids == greedy.token_ids and accepted > 0
    assert cached.token_ids == plain.token_ids and plain.num_cached_tokens == 0
    for x, y in zip(cached.logprobs, plain.logprobs):
        assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) < 1e-5
    # Every answer token but the last was fed; the last too where a step after the answer's last was planned
    # before that one's tokens were back (it fed the last token, and its own were dropped).
    assert len(prompt) + len(answer.token_ids) - 1 <= cached.num_cached_tokens <= len(prompt) + len(answer.token_ids)
