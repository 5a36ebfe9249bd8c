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

    def masks(self, slots: list[int]) -> torch.Tensor:
        """The slots' masks for their next token, on the host (pinned on CUDA): [len(slots), mask_words(vocab)]
        int32, bit j of word w set where token 32 w + j is allowed."""
        import llguidance
        import llguidance.torch

        mask = torch.empty(len(slots), mask_words(self.vocab), dtype=torch.int32,
                           pin_memory=self.device.type == "cuda")
        if len(slots) == 1:
            llguidance.torch.fill_next_token_bitmask(self.matchers[slots[0]], mask, 0)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.torch.fill_next_token_bitmask_par(self._executor,
                                                         [(self.matchers[s], i) for i, s in enumerate(slots)], mask)
        return mask
