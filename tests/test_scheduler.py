"""Scheduler invariants under random arrivals, finishes and cancellations (pure Python, no torch)."""

from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from deltaserve.runtime.scheduler import CapacityError, Phase, Scheduler


def make(**kw):
    args = dict(num_pages=40, page_size=4, max_batch=6, max_prefill_slots=3, prefill_token_budget=10,
                max_model_len=64, buckets=[1, 2, 4, 6])
    args.update(kw)
    return Scheduler(**args)


class Driver:
    """Plays the engine: applies plans, tracks a mirror of worker slot occupancy, checks every move."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.occupied = [None] * sched.max_batch  # request id in each decode slot, as a worker would see it
        self.admitted_order: list[str] = []

    def step(self, finish: set[str]) -> None:
        plan = self.s.schedule()
        for c in plan.compactions:
            assert self.occupied[c.hole] is not None, "retiring a free slot"
            self.occupied[c.hole] = None
            if c.moved_from is not None:
                assert self.occupied[c.moved_from] is not None and self.occupied[c.hole] is None
                self.occupied[c.hole], self.occupied[c.moved_from] = self.occupied[c.moved_from], None
        for p in plan.promotions:
            assert self.occupied[p.to_slot] is None
            self.occupied[p.to_slot] = p.request_id
        assert self.occupied[: len(plan.decode_ids)] == plan.decode_ids, "worker and scheduler disagree"
        assert all(o is None for o in self.occupied[len(plan.decode_ids):])
        if plan.decode_ids:
            assert plan.bucket >= len(plan.decode_ids) and plan.bucket in self.s.buckets
        assert sum(w.length for w in plan.prefill) <= self.s.prefill_token_budget
        for w in plan.prefill:
            if w.start == 0:
                self.admitted_order.append(w.request_id)
        self.s.on_prefill_done(plan.prefill)
        self.s.on_decode_done(plan.decode_ids)
        for rid in plan.decode_ids + [w.request_id for w in plan.prefill if w.last]:
            req = self.s.requests.get(rid)
            if req and (rid in finish or req.generated >= req.max_tokens):
                self.s.finish(rid)
        self.s.check_invariants()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 20)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(0, 30)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from([None, [4, 8], [2, 3, 4, 6, 8, 10]]))
def test_random_traffic_keeps_every_invariant(sequence, graph_sizes):
    """With and without captured prefill sizes (the budget then rounds down to one)."""
    s = make(prefill_graph_sizes=graph_sizes)
    d = Driver(s)
    added, n = [], 0
    for op in sequence:
        if op[0] == "add":
            rid = f"r{n}"
            n += 1
            try:
                s.add(rid, op[1], op[2])
                added.append(rid)
            except CapacityError:
                assert op[1] + op[2] > 64 or s.pages_for(op[1] + op[2]) > 40
        elif op[0] == "cancel" and added:
            s.finish(added[op[1] % len(added)])
        else:
            d.step({added[op[1] % len(added)]} if added else set())
        s.check_invariants()
    # Drain: everything finishes, and every page and slot comes back.
    for _ in range(400):
        if not s.has_work:
            break
        d.step(set())
    assert not s.has_work and not s.requests
    assert s.held_pages == 0 and len(s.free_prefill_slots) == s.max_prefill_slots
    # FCFS: requests start prefilling in arrival order.
    order = [r for r in added if r in d.admitted_order]
    assert d.admitted_order == order


def test_admission_blocks_behind_the_oldest_request():
    s = make(num_pages=10)
    s.add("big", 30, 8)  # 10 pages: all of them
    s.add("small", 2, 2)
    plan = s.schedule()
    assert [w.request_id for w in plan.prefill] == ["big"]
    s.add("later", 2, 2)
    assert s.requests["small"].phase is Phase.WAITING and s.requests["later"].phase is Phase.WAITING
    s.finish("big")
    plan = s.schedule()
    assert [w.request_id for w in plan.prefill] == ["small", "later"]


def test_requests_that_can_never_fit_are_rejected():
    s = make()
    with pytest.raises(CapacityError, match="context length 64"):
        s.add("long", 60, 10)
    with pytest.raises(CapacityError, match="KV pages"):
        make(num_pages=3).add("pages", 10, 10)
    with pytest.raises(CapacityError, match="empty"):
        s.add("empty", 0, 4)


def test_chunked_prefill_respects_the_budget_and_mixes_with_decode():
    s = make(prefill_token_budget=8)
    s.add("a", 3, 5)
    plan = s.schedule()
    s.on_prefill_done(plan.prefill)
    s.add("b", 20, 4)
    plan = s.schedule()  # a is promoted and decodes; b's first chunk fills the rest of the budget
    assert plan.decode_ids == ["a"] and [(w.request_id, w.start, w.length) for w in plan.prefill] == [("b", 0, 8)]
    s.on_prefill_done(plan.prefill)
    plan = s.schedule()
    assert [(w.start, w.length, w.last) for w in plan.prefill] == [(8, 8, False)]
    s.on_prefill_done(plan.prefill)
    plan = s.schedule()
    assert [(w.start, w.length, w.last) for w in plan.prefill] == [(16, 4, True)]


def test_retiring_from_the_middle_moves_the_last_slot_into_the_hole():
    s = make(prefill_token_budget=100, max_prefill_slots=4)
    for r in "abcd":
        s.add(r, 2, 10)
    s.on_prefill_done(s.schedule().prefill)
    plan = s.schedule()
    assert plan.decode_ids == list("abcd") and plan.bucket == 4
    s.finish("b")
    plan = s.schedule()
    assert [(c.hole, c.moved_from) for c in plan.compactions] == [(1, 3)]
    assert plan.decode_ids == ["a", "d", "c"] and plan.bucket == 4
    s.finish("c")
    s.finish("a")
    plan = s.schedule()
    assert plan.decode_ids == ["d"] and plan.bucket == 1
    s.check_invariants()


def test_a_step_budget_rounds_down_to_a_captured_prefill_size():
    """A prefill step pads its prompt tokens up to the next captured graph size, so a budget between two sizes
    would compute the padding: it rounds down to the size below (never below the smallest, nor where no graph
    takes the step), and a long prompt's chunks are then exactly that size."""

    class Fixed:
        def __init__(self):
            self.tokens_now = 0

        def tokens(self, bucket, rows=0, waiting=0):
            return self.tokens_now

    budget = Fixed()
    s = make(num_pages=400, max_model_len=1200, prefill_token_budget=600, step_budget=budget,
             prefill_graph_sizes=[256, 16, 64, 128, 192, 32, 320])
    for asked, given in ((300, 256), (320, 320), (200, 192), (191, 128), (64, 64), (10, 10), (450, 450),
                         (900, 600)):
        budget.tokens_now = asked
        assert s.prompt_budget(1) == given, asked
    budget.tokens_now = 300
    s.add("long", prompt_len=1000, max_tokens=4)
    plan = s.schedule()
    assert [w.length for w in plan.prefill] == [256] and plan.prompt_budget == 256
    assert make(step_budget=budget).prompt_budget(1) == 10  # no graphs: the budget as it is (capped at 10)
    # Fused mixed graphs: a step with decode rows rounds to their sizes, one without to the prefill graphs'.
    fused = make(num_pages=400, max_model_len=1200, prefill_token_budget=600, step_budget=budget,
                 prefill_graph_sizes=[64, 128, 192, 256, 320], mixed_graph_sizes=[64, 128, 256, 384])
    budget.tokens_now = 300
    assert (fused.prompt_budget(4), fused.prompt_budget(0)) == (256, 256)
    budget.tokens_now = 200
    assert (fused.prompt_budget(4), fused.prompt_budget(0)) == (128, 192)


def test_a_speculative_step_counts_one_token_until_its_counts_are_back():
    """Handed over, a speculative step counts one token a row (the next plan is made before its tokens are back);
    its counts add the rest when they come. Until then a snapshot of a request ending there rolls back to that
    one token; a later step handed over before the counts came leaves nothing to roll back."""
    from deltaserve.runtime.prefix_cache import PrefixCache

    s = make(lookahead=8, prefill_token_budget=16, prefix_cache=PrefixCache(40, 4, 4))
    drawn = {rid: [] for rid in "ab"}
    for rid, first in zip("ab", (1, 2)):
        s.add(rid, 6, 12, prompt_ids=[first, 2, 3, 4, 5, 6], drawn=drawn[rid])
    plan = s.schedule()
    s.on_prefill_done(plan.prefill)
    for rid in "ab":
        drawn[rid].append(7)
    plan = s.schedule()
    assert plan.decode_ids == ["a", "b"]
    s.on_decode_done(plan.decode_ids, speculative_step=5)
    a, b = s.requests["a"], s.requests["b"]
    assert (a.generated, a.kept, a.kept_pending) == (2, 1, 5)
    s.on_decode_done(["b"])  # b's next step, handed over before step 5 is back: a one-token step
    s.on_drafts_kept(["a", "b"], [4, 3], speculative_step=5)
    assert (a.generated, a.kept, a.kept_pending) == (5, 4, 0)
    assert (b.generated, b.kept, b.kept_pending) == (5, 0, 0)
    # A request ending while its speculative step is in flight: its snapshot rolls back to the step's first token.
    drawn["a"].extend([8, 9, 10, 11])
    s.on_decode_done(["a"], speculative_step=7)
    s.finish("a")
    snapshot = s.schedule().finish_snapshots[0]
    assert snapshot.keep == 1
    s.on_drafts_kept(["a"], [3], speculative_step=7)  # retired meanwhile: ignored
    assert "a" not in s.requests


def test_max_tokens_retires_on_the_count_of_a_speculative_step():
    s = make(lookahead=8)
    s.add("a", 3, 6)
    s.on_prefill_done(s.schedule().prefill)
    plan = s.schedule()
    s.on_decode_done(plan.decode_ids, speculative_step=2)
    assert "a" not in s.to_retire  # 2 of 6 counted
    s.on_drafts_kept(plan.decode_ids, [5], speculative_step=2)
    assert s.requests["a"].generated == 6 and "a" in s.to_retire
