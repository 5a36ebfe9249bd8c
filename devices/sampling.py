"""Rank 0's sampling: each state slot's settings and penalty counts, min-tokens masking, and the draw.

Settings and counts are kept per state slot, so they move with the slot's request (a promotion into a decode
slot, a compaction) and are released with it; `sample` reads them for the step's rows and draws through
`kernels.sampling.sample`, which picks the sampler of the logits' device.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.sampling import SamplingTensors, sample
from deltaserve.kernels.triton_sampling import top_p_alone

from .commands import RowSampling, SampledToken, SlotProtocolError


class SlotSampling:
    def __init__(self, num_slots: int, vocab: int, device: torch.device, pdl: bool = True) -> None:
        self.settings: list[RowSampling | None] = [None] * num_slots
        self.vocab, self.device, self.pdl = vocab, device, pdl
        # [slots, V]: allocated when the first request asks for a penalty.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    # Slots ----------------------------------------------------------------------------------------------------------
    def start(self, slot: int, setup: RowSampling | None, prompt_ids: list[int]) -> None:
        """A prompt chunk enters `slot`: the request's setup arrives with its first chunk (None later). Counts are
        kept only for requests with a penalty: the others never read them."""
        if setup is not None:
            self.settings[slot] = setup
            if setup.needs_counts:
                if self.output_counts is None:
                    n = len(self.settings)
                    self.output_counts = torch.zeros(n, self.vocab, dtype=torch.int32, device=self.device)
                    self.prompt_mask = torch.zeros(n, self.vocab, dtype=torch.bool, device=self.device)
                self.output_counts[slot] = 0
                self.prompt_mask[slot] = False
        current = self.settings[slot]
        if current is not None and current.needs_counts:
            self.prompt_mask[slot, torch.tensor(prompt_ids, device=self.device)] = True

    def move(self, src: int, dst: int) -> None:
        self.settings[dst], self.settings[src] = self.settings[src], None
        if self.settings[dst] is not None and self.settings[dst].needs_counts:
            self.output_counts[dst].copy_(self.output_counts[src])
            self.prompt_mask[dst].copy_(self.prompt_mask[src])

    def release(self, slot: int) -> None:
        self.settings[slot] = None

    # Sampling -------------------------------------------------------------------------------------------------------
    def prepare(self, slots: list[int], token_index: list[int], step_seed: int):
        """What `sample` needs for these rows. The parameters go up in two non-blocking copies, so this runs while
        the forward runs on the GPU, and the sampler's kernels queue behind it (a blocking copy per field would wait
        for the whole step first)."""
        rows = [self.settings[s] for s in slots]
        if None in rows:
            raise SlotProtocolError(f"slot {slots[rows.index(None)]} has no sampling setup")
        seeds = [r.seed if r.seed is not None else (step_seed * 1_000_003 + s) & (2**63 - 1)
                 for r, s in zip(rows, slots)]
        # One row per field, so each field is a contiguous [N] tensor on the device (the sampler's kernels
        # index them by row).
        floats = torch.tensor([[getattr(r, f) for r in rows] for f in ("temperature", "top_p", "min_p",
                               "presence_penalty", "frequency_penalty", "repetition_penalty")], dtype=torch.float32)
        ints = torch.tensor([[r.top_k for r in rows], seeds, token_index, slots], dtype=torch.long)
        if self.device.type == "cuda":
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats = floats.to(self.device, non_blocking=True)
        ints = ints.to(self.device, non_blocking=True)
        params = SamplingTensors(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], presence_penalty=floats[3],
            frequency_penalty=floats[4], repetition_penalty=floats[5], top_k=ints[0], seeds=ints[1], steps=ints[2],
        )
        if any(r.needs_counts for r in rows):  # penalties cost a pass over [N, V] and a scatter: only when asked
            params.output_counts = self.output_counts[ints[3]]
            params.prompt_mask = self.prompt_mask[ints[3]]
        return rows, params, token_index, ints[3]

    def sample(self, logits: torch.Tensor, prepared) -> list[SampledToken]:
        rows, params, token_index, slot_index = prepared
        for i, (r, step) in enumerate(zip(rows, token_index)):
            if step < r.min_tokens and r.stop_token_ids:
                logits[i, list(r.stop_token_ids)] = float("-inf")  # min_tokens: no stop token yet
        k = max(r.logprobs for r in rows)
        top_ks = [r.top_k for r in rows if r.temperature > 0]
        tokens, chosen, top_ids, top_lp = sample(
            logits, params, k,
            all_greedy=not top_ks,
            max_top_k=max(top_ks) if top_ks and min(top_ks) > 0 else 0,
            top_p_alone=any(top_p_alone(r.temperature, r.top_p, r.top_k, self.vocab) for r in rows),
            pdl=self.pdl,
        )
        if params.output_counts is not None:
            self.output_counts.index_put_((slot_index, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                          accumulate=True)
        tokens, chosen = tokens.tolist(), chosen.tolist()
        if k:
            top_ids, top_lp = top_ids.tolist(), top_lp.tolist()
        out = []
        for i, r in enumerate(rows):
            top = list(zip(top_ids[i][: r.logprobs], top_lp[i][: r.logprobs])) if r.logprobs else None
            out.append(SampledToken(tokens[i], chosen[i], top))
        return out
