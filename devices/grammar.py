"""Rank 0's grammar matchers: one per state slot whose request is constrained (`runtime.grammar` compiles the
constraint; the request's own llguidance matcher arrives with its sampling setup), moved and released with the
slot.

A row's mask for its next token needs every token its request drew before. Under overlap scheduling the step
before is still in flight when this one launches, so `SlotSampling.draw` asks for the masks only after the
forward is queued: it waits for the earlier draws' tokens (queued ahead of this forward, so they are back long
before it ends), feeds them to the matchers, fills the masks on the host and queues their upload and application
ahead of the draw, all while the GPU runs the forward. Rows without a grammar take no part.
"""

from __future__ import annotations

import logging

import torch

from deltaserve.kernels.sampling import mask_words

log = logging.getLogger(__name__)


class SlotGrammars:
    def __init__(self, num_slots: int, vocab: int, device: torch.device) -> None:
        self.matchers: list = [None] * num_slots
        self.vocab, self.device = vocab, device
        self._executor = None  # llguidance's threads: many rows' masks filled at once, without the GIL

    def start(self, slot: int, matcher) -> None:
        """A request constrained by `matcher` (its own, fresh) takes `slot`."""
        self.matchers[slot] = matcher

    def move(self, src: int, dst: int) -> None:
        self.matchers[dst], self.matchers[src] = self.matchers[src], None

    def release(self, slot: int) -> None:
        self.matchers[slot] = None

    def completed(self, slot: int) -> bool:
        """Whether the slot's request may end here (its grammar accepts a stop token now)."""
        m = self.matchers[slot]
        return m is not None and m.is_accepting()

    def accept(self, slot: int, token: int) -> None:
        m = self.matchers[slot]
        if m is None:
            return
        # A complete grammar allows only the stop ids, again and again (the token drawn after a request's stop)
        if not m.consume_token(token):
            # Only a draw that skipped the mask could get here: the request goes on unconstrained, said once.
            log.error("slot %d drew token %d, which its grammar does not allow (%s); its output is unconstrained "
                      "from here", slot, token, m.get_error()[:200])
            self.matchers[slot] = None

    def masks(self, slots: list[int], drafts: dict[int, list[int]] | None = None) -> torch.Tensor:
        """The slots' masks for their next token, on the host (pinned on CUDA): [rows, mask_words(vocab)] int32,
        bit j of word w set where token 32 w + j is allowed. A slot in `drafts` (a speculative step's k drafts for
        it) takes k + 1 rows: its next token's mask, then each position's after the drafts before it, the matcher
        advanced through them (on a copy); past a draft the grammar refuses every token is allowed, as no draft
        there can be kept."""
        import llguidance
        import llguidance.torch

        drafts = drafts or {}
        mask = torch.empty(sum(1 + len(drafts.get(s, ())) for s in slots), mask_words(self.vocab),
                           dtype=torch.int32, pin_memory=self.device.type == "cuda")
        fill = llguidance.torch.fill_next_token_bitmask
        plain, row = [], 0
        for s in slots:
            m = self.matchers[s]
            if s not in drafts:
                plain.append((m, row))
                row += 1
                continue
            fill(m, mask, row)
            walk, cut = m.deep_copy(), False  # a copy walks the drafts: nothing to roll back
            for d in drafts[s]:
                row += 1
                if not cut and not walk.is_stopped():  # a complete grammar allows its stop ids on and on
                    cut = walk.validate_tokens([d]) != 1 or not walk.consume_token(d)
                if cut:
                    mask[row] = -1
                else:
                    fill(walk, mask, row)
            row += 1
        if len(plain) == 1:
            fill(plain[0][0], mask, plain[0][1])
        elif plain:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.torch.fill_next_token_bitmask_par(self._executor, plain, mask)
        return mask
