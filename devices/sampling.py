"""Rank 0's sampling: each state slot's settings, penalty counts and last token, min-tokens masking, and the draw.

Settings, counts and the last token drawn are kept per state slot, so they move with the slot's request (a
promotion into a decode slot, a compaction) and are released with it. `draw` queues a step's draw on the device
and never waits for it: the tokens also stay on the device (`last_tokens`), where the next step's inputs can take
them before they reach the host (overlap scheduling); `collect` reads them. The Triton sampler flags the rare row it
cannot draw exactly (its candidates overflow), for the reference to draw again: `settle` does that once the flags
are on the host, and must run before anything reads a flagged row's token on the device (the next step's inputs,
its penalty counts). Only draws with a row the sampler could flag (sampled, with top-k or top-p) need it. Rows of
a constrained request draw under their grammar's mask (`devices.grammar`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltaserve.kernels.sampling import SamplingTensors, apply_token_mask, draw_tokens, sample_reference
from deltaserve.kernels.triton_sampling import compile_for_batches, top_p_alone
from deltaserve.model.batch import upload

from .commands import RowSampling, SampledToken, SlotProtocolError
from .grammar import SlotGrammars

log = logging.getLogger(__name__)


@dataclass
class Draw:
    """One step's draw for some rows, queued on the device. `host` holds what comes back (tokens, chosen logprobs,
    top ids, top logprobs, flags; pinned on CUDA), complete once `event` has passed."""

    rows: list[RowSampling]
    slots: list[int]  # each row's state slot now: a later step's slot moves update it (-1 once released)
    logits: torch.Tensor
    tokens: torch.Tensor  # on the device
    params: SamplingTensors
    num_logprobs: int
    host: list
    event: torch.cuda.Event | None
    settled: bool
    # Called once `settle` drew flagged rows again (their tokens corrected on the device too): what was computed on
    # the device from the draw's tokens is computed again (a speculative step's kept drafts).
    on_redrawn: Callable[["Draw"], None] | None = None
    # A constrained request's first row, and the rows of its later positions (a speculative step's): what its
    # grammar takes once the tokens are back (the first token, then as many as `kept` counts)
    grammar_rows: dict[int, list[int]] | None = None
    kept: object = None  # a speculative step's `KeptDrafts` (its per-row kept counts)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def may_be_flagged(r: RowSampling) -> bool:
    """The host's twin of the Triton sampler's `_filtered`: only these rows can come back flagged."""
    return r.temperature > 0 and (r.top_k > 0 or r.top_p < 1)


class SlotSampling:
    def __init__(self, num_slots: int, vocab: int, device: torch.device, pdl: bool = True,
                 last_tokens: torch.Tensor | None = None) -> None:
        """last_tokens: where the token drawn last for each slot goes ([num_slots] long; default: a new tensor)."""
        self.settings: list[RowSampling | None] = [None] * num_slots
        self.vocab, self.device, self.pdl = vocab, device, pdl
        self.last_tokens = torch.zeros(num_slots, dtype=torch.long, device=device) if last_tokens is None \
            else last_tokens
        self._unsettled: list[Draw] = []
        self.grammars = SlotGrammars(num_slots, vocab, device)
        self._unmatched: list[Draw] = []  # draws whose tokens the grammars have not taken yet
        # [slots, V]: allocated when the first request asks for a penalty.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    def compile_kernels(self, max_rows: int, dtype: torch.dtype) -> None:
        """On CUDA, compile the sampler for every batch size up to `max_rows` now, not while serving."""
        if self.device.type == "cuda":
            classes = compile_for_batches(max_rows, self.vocab, dtype, self.device, self.pdl)
            log.info("sampler compiled for %d batch size classes up to %d rows", classes, max_rows)

    # Slots ----------------------------------------------------------------------------------------------------------
    def start(self, slot: int, setup: RowSampling | None, prompt_ids: list[int]) -> None:
        """A prompt chunk enters `slot`: the request's setup arrives with its first chunk (None later). Counts are
        kept only for requests with a penalty: the others never read them."""
        if setup is not None:
            self.settings[slot] = setup
            if setup.grammar is not None:
                self.grammars.start(slot, setup.grammar)
            else:
                self.grammars.release(slot)
            if setup.needs_counts:
                if self.output_counts is None:
                    n = len(self.settings)
                    self.output_counts = torch.zeros(n, self.vocab, dtype=torch.int32, device=self.device)
                    self.prompt_mask = torch.zeros(n, self.vocab, dtype=torch.bool, device=self.device)
                self.output_counts[slot] = 0
                self.prompt_mask[slot] = False
        current = self.settings[slot]
        if current is not None and current.needs_counts:
            self.prompt_mask[slot].index_fill_(0, upload({"ids": prompt_ids}, torch.long, self.device)["ids"], True)

    def move(self, src: int, dst: int) -> None:
        self.settings[dst], self.settings[src] = self.settings[src], None
        self.last_tokens[dst] = self.last_tokens[src]
        if self.settings[dst] is not None and self.settings[dst].needs_counts:
            self.output_counts[dst].copy_(self.output_counts[src])
            self.prompt_mask[dst].copy_(self.prompt_mask[src])
        self.grammars.move(src, dst)
        self._follow(src, dst)

    def release(self, slot: int) -> None:
        self.settings[slot] = None
        self.grammars.release(slot)
        self._follow(slot, -1)

    def _follow(self, src: int, dst: int) -> None:
        for d in {id(d): d for d in self._unsettled + self._unmatched}.values():
            d.slots = [dst if s == src else s for s in d.slots]

    # Sampling -------------------------------------------------------------------------------------------------------
    def prepare(self, slots: list[int], token_index: list[int], step_seed: int,
                index_offsets: torch.Tensor | None = None):
        """What `sample` needs for these rows. The parameters go up in two non-blocking copies, so this runs while
        the forward runs on the GPU, and the sampler's kernels queue behind it (a blocking copy per field would wait
        for the whole step first). index_offsets: per decode slot, on the device, what to add to the rows'
        `token_index` (the tokens a speculative step in flight kept beyond one: overlap scheduling)."""
        rows = [self.settings[s] for s in slots]
        if None in rows:
            raise SlotProtocolError(f"slot {slots[rows.index(None)]} has no sampling setup")
        seeds = [r.seed if r.seed is not None else (step_seed * 1_000_003 + s) & (2**63 - 1)
                 for r, s in zip(rows, slots)]
        # One row per field, so each field is a contiguous [N] tensor on the device (the sampler's kernels
        # index them by row); rows padded to 16 entries, so every field starts 16-byte aligned whatever N is
        # (Triton compiles again for a pointer that is not).
        n, width = len(rows), -(-len(rows) // 16) * 16
        floats = torch.zeros(6, width, dtype=torch.float32)
        floats[:, :n] = torch.tensor([[getattr(r, f) for r in rows] for f in ("temperature", "top_p", "min_p",
                                      "presence_penalty", "frequency_penalty", "repetition_penalty")])
        ints = torch.zeros(4, width, dtype=torch.long)
        ints[:, :n] = torch.tensor([[r.top_k for r in rows], seeds, token_index, slots], dtype=torch.long)
        if self.device.type == "cuda":
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats = floats.to(self.device, non_blocking=True)[:, :n]
        ints = ints.to(self.device, non_blocking=True)[:, :n]
        params = SamplingTensors(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], presence_penalty=floats[3],
            frequency_penalty=floats[4], repetition_penalty=floats[5], top_k=ints[0], seeds=ints[1],
            steps=ints[2] if index_offsets is None else ints[2] + index_offsets[ints[3]],
        )
        if any(r.needs_counts for r in rows):  # penalties cost a pass over [N, V] and a scatter: only when asked
            params.output_counts = self.output_counts[ints[3]]
            params.prompt_mask = self.prompt_mask[ints[3]]
        return rows, params, token_index, ints[3], list(slots)

    def draw(self, logits: torch.Tensor, prepared, drafts: dict[int, list[int]] | None = None) -> Draw:
        """Queue the draw for `prepare`'s rows on the device; nothing here waits for it, but a constrained row's
        earlier draws (its grammar's mask needs their tokens). drafts: a speculative step's drafts of its
        constrained slots, whose later positions (the slot's rows after its first) draw under the masks the drafts
        lead to."""
        rows, params, token_index, slot_index, slots = prepared
        grammar_rows: dict[int, list[int]] = {}  # a constrained slot's first row: its later rows
        first: dict[int, int] = {}
        for i, s in enumerate(slots):
            if self.grammars.matchers[s] is not None:
                if s in first:
                    grammar_rows[first[s]].append(i)
                else:
                    first[s], grammar_rows[i] = i, []
        if grammar_rows:
            self._match_earlier_draws(set(first))
        biased = [(i, t, b) for i, r in enumerate(rows) for t, b in r.logit_bias]
        if biased:
            at = upload({"rows": [i for i, _, _ in biased], "ids": [t for _, t, _ in biased]}, torch.long,
                        logits.device)
            values = upload({"values": [b for _, _, b in biased]}, torch.float32, logits.device)["values"]
            logits.index_put_((at["rows"], at["ids"]), values.to(logits.dtype), accumulate=True)
        # min_tokens: no stop token yet, unless the row's grammar is complete (it may allow nothing else)
        barred = [(i, t) for i, (r, step) in enumerate(zip(rows, token_index)) if step < r.min_tokens
                  and not self.grammars.completed(slots[i]) for t in r.stop_token_ids]
        if barred:
            at = upload({"rows": [i for i, _ in barred], "ids": [t for _, t in barred]}, torch.long, logits.device)
            logits.index_put_((at["rows"], at["ids"]), logits.new_full((), float("-inf")))
        live = [s for s in first if self.grammars.matchers[s] is not None]  # a matcher that erred is dropped
        if live:
            walked = {s: drafts[s] for s in live if drafts and s in drafts}
            if any(len(walked.get(s, ())) != len(grammar_rows[first[s]]) for s in live):
                raise SlotProtocolError("a constrained row's later positions and its drafts differ in number")
            mask = self.grammars.masks(live, walked)
            at = upload({"rows": [r for s in live for r in [first[s]] + grammar_rows[first[s]]]}, torch.long,
                        logits.device)["rows"]
            apply_token_mask(logits, at, mask.to(logits.device, non_blocking=True))
        k = max(r.logprobs for r in rows)
        top_ks = [r.top_k for r in rows if r.temperature > 0]
        tokens, chosen, top_ids, top_lp, done = draw_tokens(
            logits, params, k,
            all_greedy=not top_ks,
            max_top_k=max(top_ks) if top_ks and min(top_ks) > 0 else 0,
            top_p_alone=any(top_p_alone(r.temperature, r.top_p, r.top_k, self.vocab) for r in rows),
            pdl=self.pdl,
        )
        self.last_tokens[slot_index] = tokens
        if params.output_counts is not None:
            self._count(slot_index, tokens, 1)
        out, event = to_host([tokens, chosen, top_ids, top_lp, done])  # the copies queue behind the draw
        flaggable = done is not None and any(may_be_flagged(r) for r in rows)
        d = Draw(rows, slots, logits, tokens, params, k, out, event, settled=not flaggable,
                 grammar_rows=grammar_rows or None)
        if flaggable:
            self._unsettled.append(d)
        if grammar_rows:
            self._unmatched.append(d)
        return d

    def _match_earlier_draws(self, slots: set[int]) -> None:
        """Give these slots' grammars the tokens of their earlier draws (waiting for them: they were queued ahead
        of the forward this draw follows, so the device finished them long before it ends)."""
        later = []
        for d in self._unmatched:
            if not any(d.slots[i] in slots for i in d.grammar_rows):
                later.append(d)
                continue
            if not d.settled:
                self.settle(until=d)
            d.wait()
            tokens = d.host[0]
            counts = d.kept.counts() if d.kept is not None else None
            for i, more in d.grammar_rows.items():
                if d.slots[i] >= 0:  # the first token, then the later positions the step kept
                    for r in [i] + more[: counts[i] - 1 if counts is not None else 0]:
                        self.grammars.accept(d.slots[i], int(tokens[r]))
        self._unmatched = later

    def settle(self, until: Draw | None = None) -> None:
        """Wait for the unsettled draws (in order, up to `until`; all by default) and have the reference draw again
        the rows the sampler flagged, on the device too (the last token, the penalty counts) wherever the row's
        request is now."""
        while self._unsettled:
            d = self._unsettled.pop(0)
            d.wait()
            tokens, chosen, _, _, done = d.host
            flagged = [i for i, f in enumerate(done.tolist()) if not f]
            if flagged:
                index = torch.tensor(flagged, device=d.logits.device)
                redrawn, logprob, _, _ = sample_reference(d.logits[index], d.params.rows(index))
                for i, token, lp in zip(flagged, redrawn.tolist(), logprob.tolist()):
                    slot = d.slots[i]
                    if slot >= 0:
                        self.last_tokens[slot] = token
                        if d.params.output_counts is not None:
                            self.output_counts[slot, int(tokens[i])] -= 1
                            self.output_counts[slot, token] += 1
                    tokens[i], chosen[i] = token, lp
                d.tokens[index] = redrawn
                if d.on_redrawn is not None:
                    d.on_redrawn(d)
            d.settled = True
            if d is until:
                return

    def collect(self, d: Draw) -> list[SampledToken]:
        """The draw's tokens on the host (waiting for them)."""
        if not d.settled:
            self.settle(until=d)
        d.wait()
        tokens, chosen, top_ids, top_lp, _ = d.host
        tokens, chosen = tokens.tolist(), chosen.tolist()
        if d.num_logprobs:
            top_ids, top_lp = top_ids.tolist(), top_lp.tolist()
        out = []
        for i, r in enumerate(d.rows):
            top = list(zip(top_ids[i][: r.logprobs], top_lp[i][: r.logprobs])) if r.logprobs else None
            out.append(SampledToken(tokens[i], chosen[i], top))
        return out

    def sample(self, logits: torch.Tensor, prepared) -> list[SampledToken]:
        return self.collect(self.draw(logits, prepared))

    def _count(self, slot_index: torch.Tensor, tokens: torch.Tensor, delta: int) -> None:
        self.output_counts.index_put_((slot_index, tokens), torch.full_like(tokens, delta, dtype=torch.int32),
                                      accumulate=True)


def to_host(tensors: list[torch.Tensor | None]) -> tuple[list, torch.cuda.Event | None]:
    """The tensors (None kept) copied to pinned host memory behind the work queued so far, and the event that says
    when the copies are there; on the CPU the tensors themselves and no event."""
    if not tensors[0].is_cuda:
        return tensors, None
    host = []
    for t in tensors:
        if t is not None:
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            t = pinned
        host.append(t)
    event = torch.cuda.Event()
    event.record()
    return host, event
