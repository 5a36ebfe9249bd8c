"""Continuous-batching scheduler: admission, chunked prefill, dense decode slots, compaction, buckets.

Plain Python, no torch: every decision is unit-tested on the CPU.

Resources
- KV pages: admission reserves a request's whole lifetime (prompt + max_tokens) of pages, so a running request
  never waits for memory; a request that could never fit is rejected when it is added. With prefix caching
  (`runtime.prefix_cache`) the pages of a cached prompt prefix are shared, its recurrent state is restored from a
  snapshot, and only the rest of the prompt is prefilled. A request that ends while decoding leaves its generated
  pages keyed and a snapshot of its state after the last token it was fed, so a prompt resending the conversation
  (prompt, answer, more) resumes after the answer.
- Prefill slots (state slots `max_batch ..`): the GDN state of a request while its prompt is prefilled.
- Decode slots 0..n-1, dense: a request whose prompt is done takes slot n (`slot_for_new_request`); when one
  retires, the last slot moves into its hole (`compaction_after_retire`).
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from dataclasses import dataclass, field

from .prefix_cache import ROOT_KEY, PrefixCache, chain_key
from .step_budget import StepBudget


class CapacityError(ValueError):
    """A request that can never fit this engine (too long for the context, or for the KV pages)."""


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class SchedRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    phase: Phase = Phase.WAITING
    prefilled: int = 0  # prompt tokens already run (or skipped: cached)
    generated: int = 0  # tokens sampled so far
    pages: list[int] = field(default_factory=list)
    prefill_slot: int = -1  # state slot while prefilling
    decode_slot: int = -1
    # Prefix caching (`cacheable`: the cache is on and the prompt's ids are known): the keys of its full pages, how
    # many of its pages are keyed (shared or registered), the prompt tokens it skipped, and a page boundary to
    # snapshot at (a branch point).
    prompt_ids: list[int] | None = None
    cacheable: bool = False
    keys: list[bytes] = field(default_factory=list)
    keyed_pages: int = 0
    cached: int = 0
    branch: int = 0
    # The engine's list of the tokens drawn for it, appended as they reach the host (None: not tracked). Each but
    # the last drawn is fed back as the next step's input: what a snapshot at its end holds.
    drawn: list[int] | None = None
    kept: int = 0  # the tokens its last speculative step kept (0: its last step decoded one token)
    # The number of its last step while that step is speculative and its tokens are not back: `generated` and
    # `kept` count one token of it until `on_drafts_kept` (0: none such).
    kept_pending: int = 0

    @property
    def lifetime_tokens(self) -> int:
        return self.prompt_len + self.max_tokens


@dataclass
class Compaction:
    """Retire decode slot `hole`; if `moved_from` is set, that (last) slot's request moves into the hole."""

    hole: int
    moved_from: int | None


@dataclass
class Promotion:
    request_id: str
    from_slot: int  # the prefill state slot
    to_slot: int  # the decode slot it takes
    pages: list[int]


@dataclass
class PrefillWork:
    request_id: str
    start: int  # first prompt position of the chunk
    length: int
    slot: int  # state slot (a prefill slot)
    pages: list[int]
    last: bool  # the chunk ends the prompt: its last token's logits are sampled
    first: bool = True  # the request's first chunk (it starts at 0, or where its cached prefix ends)


@dataclass
class SnapshotCopy:
    """A recurrent-state copy between a state slot and a snapshot slot (restore: snapshot -> slot)."""

    slot: int
    snapshot: int
    keep: int = 0  # a finishing request's speculative step: roll the slot back to this many tokens first (0: none)


@dataclass
class StepPlan:
    compactions: list[Compaction]
    released_prefill_slots: list[int]  # requests that ended before reaching decode
    promotions: list[Promotion]
    decode_ids: list[str]  # request in decode slot i is decode_ids[i]
    bucket: int  # decode rows padded to this size (0 when there are none)
    prefill: list[PrefillWork]
    # Prefix caching, in the order the ranks run them: restores and page copies (src, dst) before the step's
    # forward, snapshots of the chunks' ends after it.
    restores: list[SnapshotCopy] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[SnapshotCopy] = field(default_factory=list)
    # Decode slots of requests ending here into snapshots, before anything else (the compactions move slots).
    finish_snapshots: list[SnapshotCopy] = field(default_factory=list)
    speculate: bool = False  # the engine's choice: the decode rows draft and verify (`runtime.speculation`)
    prompt_budget: int = 0  # the prompt tokens this step could carry (`StepBudget`)

    @property
    def empty(self) -> bool:
        return not (self.decode_ids or self.prefill or self.compactions or self.released_prefill_slots
                    or self.restores or self.finish_snapshots)


def default_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + (16 if sizes[-1] < 128 else 64))
    return sorted({min(s, max_batch) for s in sizes})


class Scheduler:
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_batch: int,
        max_prefill_slots: int,
        prefill_token_budget: int,
        max_model_len: int,
        buckets: list[int] | None = None,
        step_budget: StepBudget | None = None,
        prefix_cache: PrefixCache | None = None,
        lookahead: int = 0,
        prefill_graph_sizes: list[int] | None = None,
        mixed_graph_sizes: list[int] | None = None,
    ) -> None:
        """lookahead: KV positions a request writes past its last token (a speculative step's k drafts);
        prefill_graph_sizes: the prompt-token counts that prefill steps replay captured graphs at (a step pads its
        tokens up to the next one); mixed_graph_sizes: the same for steps with decode rows (fused mixed steps)."""
        if min(num_pages, page_size, max_batch, max_prefill_slots, prefill_token_budget, max_model_len) < 1:
            raise ValueError("scheduler sizes must all be positive")
        self.page_size, self.max_batch, self.max_model_len = page_size, max_batch, max_model_len
        self.prefill_token_budget = prefill_token_budget  # the most prompt tokens of any step
        # The prompt tokens of a step beside decode rows; without one, every step carries up to the most.
        self.step_budget = step_budget
        self.prefill_graph_sizes = sorted(prefill_graph_sizes or [])
        self.mixed_graph_sizes = sorted(mixed_graph_sizes or [])
        self.num_pages = num_pages
        self.lookahead = lookahead
        self.cache = prefix_cache or PrefixCache(num_pages, page_size, 0, enabled=False)
        if self.cache.pages.num_pages != num_pages or self.cache.page_size != page_size:
            raise ValueError("the prefix cache's pages are not the scheduler's")
        self.pages = self.cache.pages
        self.free_prefill_slots: list[int] = list(range(max_batch + max_prefill_slots - 1, max_batch - 1, -1))
        self.max_prefill_slots = max_prefill_slots
        self.buckets = sorted(buckets or default_buckets(max_batch))
        if self.buckets[-1] < max_batch:
            raise ValueError(f"largest bucket {self.buckets[-1]} is below max_batch {max_batch}")
        self.requests: dict[str, SchedRequest] = {}
        self.waiting: deque[str] = deque()
        self.prefilling: list[str] = []  # admission order (FCFS)
        self.decode_slots: list[str] = []  # dense: request in slot i
        self.ready_for_decode: list[str] = []  # prompt done and first token sampled: promote next step
        self.to_retire: list[str] = []
        self._restores: list[SnapshotCopy] = []  # made by this plan's admissions
        self._page_copies: list[tuple[int, int]] = []

    # Queries --------------------------------------------------------------------------------------------------------
    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decode_slots) + len(self.ready_for_decode)

    @property
    def held_pages(self) -> int:
        """Pages requests or snapshots hold (cached pages nobody holds can be taken: they do not count)."""
        return self.num_pages - self.pages.available

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decode_slots or self.ready_for_decode or self.to_retire)

    def bucket_for(self, rows: int) -> int:
        if rows == 0:
            return 0
        for b in self.buckets:
            if b >= rows:
                return b
        raise AssertionError(f"{rows} decode rows exceed the largest bucket")

    # Requests -------------------------------------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """CapacityError unless a request of this size could ever run here."""
        if prompt_len < 1:
            raise CapacityError("the prompt is empty")
        if max_tokens < 1:
            raise CapacityError("max_tokens must be at least 1")
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise CapacityError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context "
                f"length {self.max_model_len}"
            )
        if self.pages_for(total + self.lookahead) > self.num_pages:
            raise CapacityError(
                f"prompt + max_tokens = {total} tokens needs {self.pages_for(total + self.lookahead)} KV pages; "
                f"this engine has {self.num_pages}"
            )

    def prefix_keys(self, prompt_ids: list[int]) -> list | None:
        """The prompt's page keys in the prefix cache (None with the cache off): made once for a prompt's choices."""
        return self.cache.keys(prompt_ids) if self.cache.enabled else None

    def add(self, request_id: str, prompt_len: int, max_tokens: int,
            prompt_ids: list[int] | None = None, drawn: list[int] | None = None, keys: list | None = None
            ) -> SchedRequest:
        """Queue a new record of a request; with its `prompt_ids`, it may share a cached prefix and leaves its own
        cached, and with `drawn` (the caller's list of its tokens, which the caller appends to) its answer too."""
        return self.enqueue(SchedRequest(request_id, prompt_len, max_tokens, prompt_ids=prompt_ids, drawn=drawn),
                            keys)

    def enqueue(self, req: SchedRequest, keys: list | None = None) -> SchedRequest:
        """Queue `req` (the engine's `outputs.Request` is one: the scheduler keeps the caller's record). `keys`:
        the prompt's `prefix_keys`, where the caller has them (several choices of one prompt share them)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.check_fits(req.prompt_len, req.max_tokens)
        if req.prompt_ids is not None and len(req.prompt_ids) != req.prompt_len:
            raise ValueError(f"prompt_ids has {len(req.prompt_ids)} tokens, prompt_len says {req.prompt_len}")
        req.cacheable = req.prompt_ids is not None and self.cache.enabled
        if req.cacheable:
            req.keys = keys if keys is not None else self.cache.keys(req.prompt_ids)
        self.requests[req.request_id] = req
        self.waiting.append(req.request_id)
        return req

    def finish(self, request_id: str) -> None:
        """The request is done (stopped, cancelled, or failed): free what it holds at the next plan."""
        req = self.requests.get(request_id)
        if req is None or req.phase is Phase.FINISHED or request_id in self.to_retire:
            return
        if req.phase is Phase.WAITING:
            self.waiting.remove(request_id)
            req.phase = Phase.FINISHED
            del self.requests[request_id]
            return
        self.to_retire.append(request_id)

    def on_prefill_done(self, work: list[PrefillWork]) -> None:
        """The chunks ran (or, with overlap, are on their way: the counts do not need the tokens)."""
        for w in work:
            req = self.requests[w.request_id]
            req.prefilled = w.start + w.length
            # Its full prompt pages below here are written (by this step, or one before it on every rank): a
            # later request's step, after this one, may read them.
            full = min(req.prefilled // self.page_size, len(req.keys))
            for i in range(req.keyed_pages, full):
                self.pages.register(req.pages[i], req.keys[i])
            req.keyed_pages = max(req.keyed_pages, full)
            if w.last:
                req.generated += 1  # the first token comes from the prefill's logits
                self._finish_at_max_tokens(req)
                if w.request_id not in self.to_retire:
                    self.prefilling.remove(w.request_id)
                    self.ready_for_decode.append(w.request_id)

    def on_decode_done(self, decode_ids: list[str], speculative_step: int = 0) -> None:
        """The step is handed over (with overlap, its tokens are on their way): each decode row draws one token,
        or, in a speculative step (`speculative_step`: its number), at least one; `on_drafts_kept` adds the rest
        once they are back. Until then the request may be planned further (its next step takes the count on the
        device) and runs one step past max_tokens at most."""
        for rid in decode_ids:
            req = self.requests[rid]
            req.generated += 1
            req.kept = 1 if speculative_step else 0  # what a snapshot rolls back to while the count is unknown
            req.kept_pending = speculative_step
            self._finish_at_max_tokens(req)

    def on_drafts_kept(self, decode_ids: list[str], counts: list[int], speculative_step: int) -> None:
        """The speculative step `speculative_step` is back: row i kept `counts[i]` tokens (its drafts kept and the
        token after them), one of which `on_decode_done` counted."""
        for rid, count in zip(decode_ids, counts):
            req = self.requests.get(rid)
            if req is None:  # retired meanwhile
                continue
            req.generated += count - 1
            if req.kept_pending == speculative_step:  # no step of it handed over since
                req.kept, req.kept_pending = count, 0
            self._finish_at_max_tokens(req)

    def _finish_at_max_tokens(self, req: SchedRequest) -> None:
        # Its last token is drawn: no step after this one needs a row for it, whatever the token turns out to be.
        if req.generated >= req.max_tokens:
            self.finish(req.request_id)

    # Planning -------------------------------------------------------------------------------------------------------
    def _retire(self) -> tuple[list[Compaction], list[int], list[SnapshotCopy]]:
        # Snapshots first: they name the decode slots as they are before this step's compactions move them.
        snapshots = [copy for rid in self.to_retire if (copy := self._finish_snapshot(self.requests[rid]))]
        compactions, released = [], []
        for rid in self.to_retire:
            req = self.requests.pop(rid)
            for page in reversed(req.pages):  # the free ones are handed out low pages first again
                self.pages.drop(page)
            req.pages = []
            if req.phase is Phase.DECODE:
                hole, last = req.decode_slot, len(self.decode_slots) - 1
                moved = self.decode_slots[last]
                if hole != last:
                    self.decode_slots[hole] = moved
                    self.requests[moved].decode_slot = hole
                self.decode_slots.pop()
                compactions.append(Compaction(hole, last if hole != last else None))
            else:  # prefill or awaiting promotion: it still holds its prefill slot
                if rid in self.prefilling:
                    self.prefilling.remove(rid)
                if rid in self.ready_for_decode:
                    self.ready_for_decode.remove(rid)
                self.free_prefill_slots.append(req.prefill_slot)
                released.append(req.prefill_slot)
            req.phase = Phase.FINISHED
        self.to_retire.clear()
        return compactions, released, snapshots

    def _finish_snapshot(self, req: SchedRequest) -> SnapshotCopy | None:
        """A decoding request that ends here: its generated full pages keyed and a snapshot of its decode slot,
        whose state holds the prompt and every drawn token but the last (the last step fed them; after a
        speculative step, once rolled back to the tokens it kept)."""
        fed = req.generated - 1
        if (req.phase is not Phase.DECODE or not req.cacheable or req.drawn is None or fed < 1 or len(req.drawn) < fed
                or self.cache.snapshots.capacity == 0):
            return None
        tokens = req.prompt_ids + req.drawn[:fed]
        ps, full = self.page_size, len(tokens) // self.page_size
        for i in range(len(req.keys), full):
            req.keys.append(chain_key(req.keys[i - 1] if i else ROOT_KEY, tokens[i * ps : (i + 1) * ps]))
        for i in range(req.keyed_pages, full):
            self.pages.register(req.pages[i], req.keys[i])
        req.keyed_pages = max(req.keyed_pages, full)
        snap = self._snapshot(req, len(tokens), tokens)
        return None if snap is None else SnapshotCopy(req.decode_slot, snap, req.kept)

    def _promote(self) -> list[Promotion]:
        promotions = []
        for rid in self.ready_for_decode:
            req = self.requests[rid]
            slot = len(self.decode_slots)  # slot_for_new_request: the next dense slot
            assert slot < self.max_batch, "admission keeps running requests within max_batch"
            self.decode_slots.append(rid)
            promotions.append(Promotion(rid, req.prefill_slot, slot, list(req.pages)))
            self.free_prefill_slots.append(req.prefill_slot)
            req.prefill_slot, req.decode_slot, req.phase = -1, slot, Phase.DECODE
        self.ready_for_decode.clear()
        return promotions

    def _admit(self) -> None:
        # FCFS and blocking: when the oldest waiting request does not fit, nobody behind it is admitted.
        while self.waiting:
            req = self.requests[self.waiting[0]]
            if not self.free_prefill_slots or self.num_running >= self.max_batch:
                return
            match = self.cache.match(req.prompt_ids, req.keys) if req.cacheable and req.prompt_ids else None
            if match is not None and self._waits_for_a_shared_prefix(req, match.position):
                return
            shared = match.pages if match else []
            need = self.pages_for(req.lifetime_tokens + self.lookahead) - len(shared)
            # Holding a cached page nobody holds takes it out of what the fresh pages may come from.
            if need > self.pages.available - sum(1 for p in shared if self.pages.refs[p] == 0):
                return
            self.waiting.popleft()
            for page in shared:
                self.pages.hold(page)
            req.pages = shared + self.pages.take(need)
            req.keyed_pages = len(shared)
            req.prefill_slot = self.free_prefill_slots.pop()
            req.phase = Phase.PREFILL
            self.prefilling.append(req.request_id)
            if match is not None and match.snapshot is not None:
                snap = match.snapshot
                self.cache.snapshots.touch(snap)
                self._restores.append(SnapshotCopy(req.prefill_slot, snap.index))
                if snap.tail_page is not None:  # the tail's KV, into the request's own page
                    self._page_copies.append((snap.tail_page, req.pages[len(shared)]))
                req.prefilled = req.cached = match.position
            if match is not None:
                req.branch = match.branch

    def _waits_for_a_shared_prefix(self, req: SchedRequest, position: int) -> bool:
        """Whether `req` waits for a prompt now being prefilled that shares more of its full pages than the cache
        holds: that prompt gets a branch point where they part, and `req` resumes from its snapshot there instead of
        computing the same tokens beside it (prompts arriving together with one system prompt), or, the same
        prompt, from its end. The wait costs little: the older prompt takes the step's prefill budget first
        anyway."""
        if self.cache.snapshots.capacity == 0:
            return False
        ps, usable = self.page_size, (req.prompt_len - 1) // self.page_size
        for rid in self.prefilling:
            other = self.requests[rid]
            # The same prompt (n choices share its list): resume after all of it.
            if other.cacheable and (other.prompt_ids is req.prompt_ids or other.prompt_ids == req.prompt_ids):
                return True
            n, limit = 0, min(usable, len(other.keys))
            while n < limit and other.keys[n] == req.keys[n]:
                n += 1
            boundary = n * ps
            if boundary > position and other.prefilled < boundary:
                if not other.prefilled < other.branch < boundary:  # an earlier branch point stays first
                    other.branch = boundary
                return True
        return False

    def prompt_budget(self, bucket: int, rows: int = 0) -> int:
        """The prompt tokens a step beside `bucket` decode rows (`rows` live) may carry: rounded down to a captured
        size (of mixed steps with decode rows, else of prefill steps) where one is at most the budget (a step
        between two computes the padding up to the next)."""
        # Requests yet to decode that the batch has room for: their first tokens weigh against the rows' stall.
        waiting = min(len(self.prefilling) + len(self.waiting), max(self.max_batch - rows, 0))
        budget = self.step_budget.tokens(bucket, rows, waiting) if self.step_budget else self.prefill_token_budget
        budget = min(budget, self.prefill_token_budget)
        sizes = self.mixed_graph_sizes if bucket and self.mixed_graph_sizes else self.prefill_graph_sizes
        if sizes and sizes[0] <= budget <= sizes[-1]:
            budget = sizes[bisect.bisect_right(sizes, budget) - 1]
        return budget

    def _prefill_chunks(self, budget: int) -> tuple[list[PrefillWork], list[SnapshotCopy]]:
        # The oldest prompt first: prompts arriving together finish in order, not all at the end.
        work, snapshots = [], []
        ps = self.page_size
        for rid in self.prefilling:
            req = self.requests[rid]
            if budget == 0 and req.prefilled < req.prompt_len:
                continue  # a prompt cached whole still takes its (token-free) turn
            start = req.prefilled
            end = min(req.prompt_len, start + budget)
            if req.cacheable:  # chunk ends where a snapshot is worth taking
                if start < req.branch < end:
                    end = req.branch  # exactly at the branch point
                elif end < req.prompt_len and end // ps * ps > start:
                    end = end // ps * ps  # page-aligned, so a later prompt sharing this much can resume here
                if end == req.prompt_len or end % ps == 0:
                    snap = self._snapshot(req, end, logits=True)
                    if snap is not None:
                        snapshots.append(SnapshotCopy(req.prefill_slot, snap))
            budget -= end - start
            work.append(PrefillWork(rid, start, end - start, req.prefill_slot, req.pages, end == req.prompt_len,
                                    first=start == req.cached))
        return work, snapshots

    def _snapshot(self, req: SchedRequest, position: int, tokens: list[int] | None = None,
                  logits: bool = False) -> int | None:
        """A snapshot slot for the request's state after `position` of its `tokens` (default: its prompt), or
        None. logits: a prefill chunk ends there, so the state's slot holds that token's hidden state too."""
        full = position // self.page_size
        anchor = req.keys[full - 1] if full else ROOT_KEY
        tail = tuple((tokens or req.prompt_ids)[full * self.page_size : position])
        snap = self.cache.snapshots.add(anchor, tail, position, req.pages[full] if tail else None, logits)
        if snap is not None and self.cache.resumable is not None:
            self.cache.resumable.snapshot_taken(snap, req.keys[:full], tokens or req.prompt_ids)
        return None if snap is None else snap.index

    def schedule(self) -> StepPlan:
        compactions, released, finished = self._retire()
        promotions = self._promote()
        self._admit()
        decode_ids = list(self.decode_slots)
        bucket = self.bucket_for(len(decode_ids))
        budget = self.prompt_budget(bucket, len(decode_ids)) if self.prefilling else 0
        prefill, snapshots = self._prefill_chunks(budget)
        plan = StepPlan(compactions, released, promotions, decode_ids, bucket, prefill, self._restores,
                        self._page_copies, snapshots, finished, prompt_budget=budget)
        self._restores, self._page_copies = [], []
        return plan

    # Invariants (tests and debugging) ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.cache.check()
        holders = [0] * self.num_pages
        for r in self.requests.values():
            assert len(r.pages) == len(set(r.pages)), "a request holds a page twice"
            for p in r.pages:
                holders[p] += 1
        for snap in self.cache.snapshots.lru.values():
            if snap.tail_page is not None:
                holders[snap.tail_page] += 1
        assert holders == self.pages.refs, "a page's holders and its count disagree"
        for i, rid in enumerate(self.decode_slots):
            assert self.requests[rid].decode_slot == i, "decode slots are not dense"
        held = [r.prefill_slot for r in self.requests.values() if r.prefill_slot >= 0]
        assert len(held) == len(set(held)) and not set(held) & set(self.free_prefill_slots)
        assert len(held) + len(self.free_prefill_slots) == self.max_prefill_slots, "a prefill slot leaked"
        assert self.num_running <= self.max_batch
