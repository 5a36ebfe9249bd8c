"""A rank's side of speculative decoding (k drafts a row from Qwen3.5's multi-token-prediction head): the fixed
inputs of a speculative step, its forward (drafts, then their verification as rows of k + 1 tokens), the draws
that keep drafts, the head over every prompt and every kept position, and the roll-back of a row's GDN state to
the tokens it kept. When a step speculates is the engine's choice (`runtime.speculation`).
"""

from __future__ import annotations

import torch

from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.kernels.sampling import counter_uniform
from deltaserve.model.batch import PromptChunks, StepBatch, TokenRows, select_rows, upload
from deltaserve.model.forward import Qwen35Shard
from deltaserve.model.state import ModelState
from deltaserve.model.weights import fp8_copy

from .backend import ForwardOutputs
from .commands import KEPT_ON_DEVICE, SampledToken, SlotProtocolError, StepCommand
from .sampling import Draw, SlotSampling, to_host
from .slots import DecodeInputs


def draft_head(lm_head: torch.Tensor, vocab: int = 0, fp8: bool = False) -> "torch.Tensor | Fp8Weight | None":
    """What the MTP head's drafts read in place of lm_head: its first `vocab` rows (0: all of them), as an FP8 copy
    when `fp8` (half the bytes a draft reads: a draft needs only an argmax, and verification with the bf16 lm_head
    keeps the output exact); None where that is lm_head itself."""
    if isinstance(lm_head, Fp8Weight):  # a checkpoint that stores it in FP8 already
        return Fp8Weight(lm_head.values[:vocab], lm_head.scale[: -(-vocab // lm_head.block)], lm_head.block) \
            if vocab else None
    rows = lm_head[:vocab] if vocab else lm_head
    if fp8:
        return fp8_copy(rows)
    return rows if vocab else None  # a view: no copy


class Speculator:
    """A speculative engine's rank: the MTP head's drafts, their verification as rows of k + 1 tokens, the draws
    that keep them, the head over every prompt and every kept position, and the GDN roll-back to what a row kept.

    Its fixed-address inputs sit beside `DecodeInputs`' (tokens, positions, slots, page table):
    per row, the tokens its last verify step kept (`accepted`, 1 for a row promoted this step, which drafts from
    its prompt's last position), how many of them its state keeps (`keep`: k + 1 for a promoted row, nothing to roll
    back), and host drafts that replace the head's (`override` where `use_override`). A row whose last step is
    still in flight (KEPT_ON_DEVICE, `pending`) takes its kept count from the device (`take_kept`), and its drafts
    from `alternatives` (one list a possible count)."""

    def __init__(self, model: Qwen35Shard, state: ModelState, inputs: DecodeInputs, carried: torch.Tensor,
                 draft_head: "torch.Tensor | Fp8Weight | None" = None,
                 acceptance: tuple[float, ...] | None = None) -> None:
        """carried: the rank's per-slot (last token, kept count) the next step's inputs take (`RankRuntime`);
        draft_head: what the drafts read in place of lm_head (`draft_head()`; None: lm_head); acceptance:
        benchmarks' emulated draft acceptance (`runtime.speculation.SpeculationOverride.acceptance`)."""
        self.model, self.state, self.inputs, self.carried, self.draft_head = model, state, inputs, carried, draft_head
        rows, k, device = inputs.rows, state.speculative_tokens, inputs.input_ids.device
        self.k, self.device = k, device
        self.accepted = torch.ones(rows, dtype=torch.long, device=device)
        self.keep = torch.full((rows,), k + 1, dtype=torch.long, device=device)
        self.override = torch.zeros(rows, k, dtype=torch.long, device=device)
        self.alternatives = torch.zeros(rows, k + 1, k, dtype=torch.long, device=device)
        self.use_override = torch.zeros(rows, dtype=torch.bool, device=device)
        self.pending = torch.zeros(rows, dtype=torch.bool, device=device)
        self.steps = torch.arange(k + 1, device=device)
        # Emulated acceptance: draft j is kept, after draft j - 1 was, with the ratio of their rates.
        self._keep_ratio = None if not acceptance else torch.tensor(
            [b / a if a > 0 else 0.0 for a, b in zip((1.0, *acceptance), acceptance)], device=device)

    def fill_inert(self) -> None:
        self.accepted.fill_(1)
        self.keep.fill_(self.k + 1)
        self.use_override.fill_(False)
        self.pending.fill_(False)

    def fill(self, cmd: StepCommand) -> None:
        """The step's rows' kept counts and host drafts (padding rows inert), in one copy."""
        n, bucket, k = len(cmd.decode_tokens), cmd.bucket, self.k
        T = k + 1
        drafts = cmd.draft_tokens is not None
        host = torch.zeros(4 + k * (k + 1) * drafts, bucket, dtype=torch.long)  # padding rows: inert
        host[0], host[1] = 1, T
        host[0, :n] = torch.tensor([max(a, 0) or 1 for a in cmd.verify_accepted])
        host[1, :n] = torch.tensor([max(a, 0) or T for a in cmd.verify_accepted])
        host[3, :n] = torch.tensor([a == KEPT_ON_DEVICE for a in cmd.verify_accepted])
        if drafts:
            host[2, :n] = 1
            table = [lists + lists[-1:] * (k + 1 - len(lists)) for lists in cmd.draft_tokens]  # [n, k + 1, k]
            host[4:, :n] = torch.tensor(table, dtype=torch.long).view(n, -1).t()
        if self.accepted.is_cuda:
            host = host.pin_memory()
        dev = host.to(self.accepted.device, non_blocking=True)
        self.accepted[:bucket].copy_(dev[0])
        self.keep[:bucket].copy_(dev[1])
        self.use_override[:bucket].copy_(dev[2].bool())
        self.pending[:bucket].copy_(dev[3].bool())
        if drafts:
            self.alternatives[:bucket].copy_(dev[4:].t().view(bucket, k + 1, k))
            self.override[:bucket].copy_(self.alternatives[:bucket, 0])

    def take_kept(self, kept: torch.Tensor, bucket: int, drafts: bool) -> torch.Tensor:
        """Pending rows take their last step's kept count from `kept` (row i is decode slot i), on the device, and
        (`drafts`: host drafts were sent) the drafts meant for it; returns what it adds to each row's position and
        token index [bucket]."""
        pending, kept = self.pending[:bucket], kept[:bucket]
        for field in (self.accepted, self.keep):
            field[:bucket].copy_(torch.where(pending, kept, field[:bucket]))
        more = torch.where(pending, kept - 1, 0)
        if drafts:
            choice = more.clamp(0, self.k).view(-1, 1, 1).expand(-1, 1, self.k)
            self.override[:bucket].copy_(self.alternatives[:bucket].gather(1, choice).squeeze(1))
        return more

    def before_rows(self, slots: torch.Tensor, bucket: int) -> None:
        """Before a forward of one-token rows (`slots`, the fixed inputs' first `bucket`): their GDN state back
        to what their last verify step kept, and the head over that step's positions, as a speculative step's would
        (its KV there, which later drafts attend to)."""
        self.state.commit_verified(slots, self.keep[:bucket], self.model.ops.roll_back_pool)
        self._head_over_last_step(bucket)

    def after_rows(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        """Each one-token row's hidden state, kept for a later draft (the engine then sends the row as promoted:
        verify_accepted 0)."""
        self.state.verify_hidden[self.state.verify_rows(slots), 0] = hidden

    def roll_back(self, slot: int, kept: int) -> None:
        """A decode slot's GDN state back to what its last verify step kept (filled on the device: no host sync)."""
        if not 1 <= kept <= self.k + 1:
            raise SlotProtocolError(f"kept must be in [1, {self.k + 1}], got {kept}")
        self.state.commit_verified(torch.full((1,), slot, device=self.device),
                                   torch.full((1,), kept, device=self.device), self.model.ops.roll_back_pool)

    def start_from_restored(self, slots: list[int]) -> None:
        """Prompts resumed whole from a snapshot: their first drafts start from the restored last hidden state."""
        rows = upload({"rows": slots}, torch.long, self.device)["rows"]
        self.state.verify_hidden[rows, 0] = self.state.last_hidden[rows]

    def head_inputs(self, chunks: list) -> tuple[list[int], list[int]]:
        """The head's inputs over these `PrefillCommand`s' chunks: each chunk token's following token (the
        prompt's, 0 after its last), and the verify-pool row each chunk's last hidden state goes to (the trash row
        unless it ends its prompt)."""
        following = [t for p in chunks for t in p.token_ids[1:] + [p.next_token]]
        return following, [p.slot if p.last else self.state.num_slots for p in chunks]

    def head_tensors(self, chunks: list) -> tuple[torch.Tensor, torch.Tensor]:
        """`head_inputs` on the device, for an eager step (a graph's fixed inputs take the lists)."""
        following, rows = self.head_inputs(chunks)
        longs = upload({"following": following, "rows": rows}, torch.long, self.device)
        return longs["following"], longs["rows"]

    def head_over_prompts(self, hidden: torch.Tensor, chunks: PromptChunks, following: torch.Tensor,
                          head_rows: torch.Tensor) -> torch.Tensor:
        """The MTP head over the chunks' tokens (`hidden`: the model's at each; `following`: each token's next
        token), its KV at every prompt position (a prompt's last position, whose next token this step draws, is
        run again when the request first drafts). Keeps each chunk's last hidden state in its verify-pool row
        (`head_rows`: what a finished prompt's first draft starts from; the trash row for the others) and returns
        them [R, H]."""
        self.model.mtp(following, hidden, self.state, StepBatch.of(chunks=chunks))
        last = hidden[chunks.last_token]
        self.state.verify_hidden[head_rows, 0] = last
        return last

    def forward(self, bucket: int) -> ForwardOutputs:
        """A speculative step over the fixed inputs' first `bucket` rows: draft k tokens with the MTP head from the
        hidden state before the row's input token, and verify the input token and the drafts in one forward (k + 1
        tokens a row), whose GDN layers start from the state after the tokens the row's last step kept
        (`keep`). Its outputs: the logits of every row's first position [bucket, V] and of the k
        after it [bucket, k, V] (views of one [bucket, k + 1, V]), and the drafts [bucket, k]."""
        model, state, inputs = self.model, self.state, self.inputs
        k, ps = state.speculative_tokens, state.page_size
        T = k + 1
        tokens, positions = inputs.input_ids[:bucket], inputs.positions[:bucket]
        slots, table = inputs.slots[:bucket], inputs.page_table[:bucket]
        pool_rows = state.verify_rows(slots)
        h = self._head_over_last_step(bucket)
        drafts = [self._draft(h)]
        for j in range(1, k):  # the head's chain: its own output and its last draft
            at = positions + (j - 1)
            mapping = table.long().gather(1, (at // ps)[:, None]).squeeze(1) * ps + at % ps
            h = model.mtp(drafts[-1], h, state, StepBatch.of(TokenRows(tokens, at, slots, table, at + 1, mapping)))
            drafts.append(self._draft(h))
        drafted = torch.stack(drafts, dim=1)
        drafted = torch.where(self.use_override[:bucket, None], self.override[:bucket], drafted)
        verify = self._verify_rows(bucket, positions)
        verify.input_ids = torch.cat([tokens[:, None], drafted], dim=1).flatten()
        hidden = model.forward(state, StepBatch.of(verify)).view(bucket, T, -1)
        state.verify_hidden[pool_rows] = hidden
        state.drafts[pool_rows] = drafted
        logits = model.logits(hidden.flatten(0, 1)).view(bucket, T, -1)  # lm_head read once for all positions
        return ForwardOutputs(logits[:, 0], None, logits[:, 1:], drafted)

    def _draft(self, h: torch.Tensor) -> torch.Tensor:
        """The head's greedy token from its output `h`, from the draft head when there is one."""
        if self.draft_head is None:
            return self.model.logits(h).argmax(-1)
        return self.model.ops.linear(h, self.draft_head).argmax(-1)

    def _verify_rows(self, bucket: int, starts: torch.Tensor) -> TokenRows:
        """The fixed inputs' first `bucket` rows as k + 1 tokens a row from `starts` (the input tokens only)."""
        inputs, state = self.inputs, self.state
        T, ps = state.speculative_tokens + 1, state.page_size
        table = inputs.page_table[:bucket]
        where = starts[:, None] + self.steps  # [bucket, T]
        pages = table.long().gather(1, where // ps)
        return TokenRows(input_ids=inputs.input_ids[:bucket], positions=where.flatten(), slots=inputs.slots[:bucket],
                         page_table=table.repeat_interleave(T, dim=0), seq_lens=where.flatten() + 1,
                         slot_mapping=(pages * ps + where % ps).flatten(), tokens_per_row=T, kept=self.keep[:bucket])

    def _head_over_last_step(self, bucket: int) -> torch.Tensor:
        """The MTP head over each row's last step's positions, each with the token after it (the kept drafts,
        then the row's input token): its KV there, which later drafts attend to, and its output at the last kept
        position [bucket, H], which drafts the token after the input token."""
        model, state, inputs = self.model, self.state, self.inputs
        T = state.speculative_tokens + 1
        tokens, accepted = inputs.input_ids[:bucket], self.accepted[:bucket]
        rows = state.verify_rows(inputs.slots[:bucket])
        before = accepted - 1
        following = torch.cat([state.drafts[rows], tokens[:, None]], dim=1).scatter(1, before[:, None], tokens[:, None])
        h = model.mtp(following.flatten(), state.verify_hidden[rows].flatten(0, 1), state,
                      StepBatch.of(self._verify_rows(bucket, (inputs.positions[:bucket] - accepted).clamp(min=0))))
        return h.view(bucket, T, -1).gather(1, before.view(-1, 1, 1).expand(-1, 1, h.shape[-1])).squeeze(1)

    def draw(self, cmd: StepCommand, out: ForwardOutputs, sampling: SlotSampling | None,
             index_offsets: torch.Tensor | None) -> tuple:
        """Behind the speculative forward (`out`), rank 0 draws every row's first token as a plain decode step
        would, and the k positions after it for the rows without penalties (whose counts would see the drafts),
        then keeps each row's drafts on the device (`_keep_drafts`)."""
        n = len(cmd.decode_tokens)
        if not sampling:
            return None, None
        first_logits, extra_logits, drafted = out.row_logits, out.draft_logits, out.drafts
        k, slots = self.state.speculative_tokens, list(range(n))
        # A constrained row's later positions draw under the masks its drafts lead to: the drafts come to the host
        # first (the forward's end; only in a step with such a row). Under an emulated acceptance (kept by a coin,
        # not by equality) it keeps none.
        matchers = sampling.grammars.matchers
        free = [i for i in slots if not sampling.settings[i].needs_counts
                and (matchers[i] is None or self._keep_ratio is None)]
        checked = [i for i in free if matchers[i] is not None]
        drafts = None
        if checked:
            (host,), event = to_host([drafted[:n]])
            if event is not None:
                event.synchronize()
            drafts = {i: host[i].tolist() for i in checked}
        # One draw: every row's first position, then the k after it of the free rows (each its own row: the
        # sampler reads rows at a stride of V). The extra rows' tokens also land in their slots' penalty counts,
        # which only penalty rows, never among them, read.
        logits = torch.cat([first_logits[:n], select_rows(extra_logits, free).flatten(0, 1)])
        rows = slots + [i for i in free for _ in range(k)]
        token_index = cmd.decode_token_index + [cmd.decode_token_index[i] + j for i in free for j in range(1, k + 1)]
        drawn = sampling.draw(logits, sampling.prepare(rows, token_index, cmd.step_seed, index_offsets), drafts)
        ends = [(sampling.settings[i].max_tokens, sampling.settings[i].stop_token_ids) for i in slots]
        kept = drawn.kept = KeptDrafts(free, drafted[:n].clone(), ends)
        drawn.on_redrawn = lambda d: self._keep_drafts(kept, d, list(d.slots[:n]))
        self._keep_drafts(kept, drawn, slots)
        return drawn, kept

    def _keep_drafts(self, kept: "KeptDrafts", drawn: Draw, slots: list[int]) -> None:
        """On the device, behind the draw (its rows in `draw`'s order): each row keeps draft
        j while it equals the token drawn at the position before it, and with it the token drawn at its own
        position. A draft of one token kept or dropped on whether it equals an independent draw from the target's
        distribution is exactly that distribution's rejection sampling. With an emulated acceptance (benchmarks),
        draft j is kept, after draft j - 1 was, with the ratio of their per-position rates: so in its rate's share
        of the steps (on a coin of the row's seed and token index, as its draw: a seeded request keeps the same
        drafts however it is batched). No row keeps a token past its first stop id or its max_tokens: the request
        ends there, and its state with it (the step after, planned before this one's tokens are back, feeds its
        last token; a snapshot of that holds the whole answer). Each row's count and last kept token go to
        `carried` at its slot (`slots`; -1: released), where the next step's inputs take them, and the counts to
        the host (`kept.host`)."""
        drafted, tokens = kept.drafted, drawn.tokens
        n, k = drafted.shape
        free, is_free, most, stops = kept.inputs(self.device)
        chain = tokens[:n, None].repeat(1, k + 1)  # [n, k + 1]: the first token, then the k drawn after it
        chain[free, 1:] = tokens[n:].view(-1, k)
        if self._keep_ratio is not None:  # ids below the vocabulary's: other values than the draw's
            coin_ids = -1 - torch.arange(k, device=self.device).expand(n, k)
            ok = counter_uniform(drawn.params.seeds[:n], drawn.params.steps[:n], coin_ids) < self._keep_ratio
        else:
            ok = drafted == chain[:, :k]
        counts = 1 + (ok & is_free[:, None]).long().cumprod(1).sum(1)
        limits = most - drawn.params.steps[:n]  # the first rows' token index, on the device
        is_stop = (chain[:, :, None] == stops[:, None, :]).any(-1)  # padding -1 matches no token
        first_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, k + 1)
        counts = torch.minimum(counts, torch.minimum(limits.clamp(min=1), first_stop))
        last = chain.gather(1, (counts - 1)[:, None]).squeeze(1)
        live = [(i, s) for i, s in enumerate(slots) if s >= 0]
        if slots == list(range(n)):
            self.carried[0, :n], self.carried[1, :n] = last, counts
        elif live:
            at = upload({"rows": [i for i, _ in live], "slots": [s for _, s in live]}, torch.long, self.device)
            self.carried[:, at["slots"]] = torch.stack([last, counts])[:, at["rows"]]
        kept.copy_to_host(counts)

    @staticmethod
    def kept_tokens(first: list[SampledToken], drawn: list[SampledToken],
                    kept: "KeptDrafts") -> list[list[SampledToken]]:
        """Each row's tokens after its first that the step kept (`drawn`: the free rows' k positions after the
        first, in order), from the counts `_keep_drafts` computed on the device."""
        counts = kept.counts()
        k = kept.drafted.shape[1]
        more: list[list[SampledToken]] = [[] for _ in first]
        for n, i in enumerate(kept.free):
            more[i] = drawn[n * k: n * k + counts[i] - 1]
        return more


class KeptDrafts:
    """A speculative step's drafts and what it kept of them: counted on the device behind its draw
    (`Speculator._keep_drafts`), read on the host once the copy is there."""

    def __init__(self, free: list[int], drafted: torch.Tensor, ends: list[tuple[int | None, tuple[int, ...]]]) -> None:
        """free: the rows without penalties; drafted [n, k]; per row, its (max_tokens, stop ids)."""
        self.free, self.drafted, self._ends = free, drafted, ends
        self.host: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None

    def inputs(self, device) -> tuple[torch.Tensor, ...]:
        """On `device`, in one copy: the free rows' indices, whether each row is free [n], each row's max_tokens [n]
        and its stop ids [n, S] (padded with -1)."""
        n = len(self._ends)
        width = max((len(stops) for _, stops in self._ends), default=0)
        most = [2**62 if m is None else m for m, _ in self._ends]
        stops = [t for _, ids in self._ends for t in list(ids) + [-1] * (width - len(ids))]
        free = set(self.free)
        up = upload({"free": self.free, "is_free": [i in free for i in range(n)], "most": most, "stops": stops},
                    torch.long, device)
        return up["free"], up["is_free"].bool(), up["most"], up["stops"].view(n, width)

    def copy_to_host(self, counts: torch.Tensor) -> None:
        (self.host,), self.event = to_host([counts])

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def counts(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
