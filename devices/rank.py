"""What one rank does with a step: slot bookkeeping, the batched decode and prefill forwards, sampling (rank 0).

Slots: state slots 0..max_batch-1 are the dense decode slots, max_batch.. the prefill slots, then the prefix
cache's snapshot slots and the trash slot. The decode page table, positions and token inputs live in fixed-address
buffers sized for the largest bucket, so a captured CUDA graph reads each step's inputs from the same addresses;
so do a prefill step's chunks, padded to a bucket of tokens (`PrefillInputs`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.kernels.sampling import counter_uniform
from deltaserve.model.batch import (PrefillChunk, PrefillInputs, PromptChunks, StepBatch, TokenRows, select_rows,
                                    upload)
from deltaserve.model.forward import Qwen35Shard
from deltaserve.model.state import ModelState
from deltaserve.model.weights import fp8_copy

from .backend import GraphProgram, StepGraphs, StepShape
from .commands import KEPT_ON_DEVICE, UNKNOWN_TOKEN, SampledToken, SlotProtocolError, StepCommand, StepResult
from .sampling import Draw, SlotSampling, to_host

log = logging.getLogger(__name__)


class ForwardOutputs(NamedTuple):
    """What one forward of a step gives its draws (a graph keeps them, and each replay overwrites them)."""

    row_logits: torch.Tensor | None  # [rows, V]: each row's (first) position
    chunk_logits: torch.Tensor | None = None  # [R, V]: each chunk's last token (then a padded step's padding)
    draft_logits: torch.Tensor | None = None  # [rows, k, V]: a speculative row's k positions after its first
    drafts: torch.Tensor | None = None  # [rows, k]: the drafts those positions verify


class DecodeInputs:
    """Fixed-address decode inputs for `rows` rows (the largest bucket); padding rows point at trash."""

    def __init__(self, rows: int, width: int, trash_page: int, page_size: int, device) -> None:
        self.rows, self.width, self.page_size, self.trash_page = rows, width, page_size, trash_page
        self.table_host = np.full((rows, width), trash_page, dtype=np.int32)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.page_table = torch.full((rows, width), trash_page, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), trash_page * page_size, dtype=torch.long, device=device)

    def batch(self, bucket: int) -> TokenRows:
        return TokenRows(
            self.input_ids[:bucket], self.positions[:bucket], self.slots[:bucket], self.page_table[:bucket],
            self.seq_lens[:bucket], self.slot_mapping[:bucket],
        )

    def fill(self, tokens: list[int], positions: list[int], bucket: int) -> None:
        """Write this step's rows (and inert padding up to `bucket`) into the fixed buffers; UNKNOWN_TOKEN rows are
        left for `take_unknown`."""
        n = len(tokens)
        pos = np.zeros(bucket, dtype=np.int64)
        pos[:n] = positions
        rows = np.arange(bucket)
        pages = self.table_host[rows, np.minimum(pos // self.page_size, self.width - 1)]
        live = rows < n
        slots = np.where(live, rows, -1)
        mapping = np.where(live, pages.astype(np.int64) * self.page_size + pos % self.page_size,
                           self.trash_page * self.page_size)
        ids = np.zeros(bucket, dtype=np.int64)
        ids[:n] = tokens
        host = torch.from_numpy(np.stack([ids, pos, slots, pos + 1, mapping]))
        table = self.table_host[:bucket].copy()
        table[n:] = self.trash_page
        table = torch.from_numpy(table)
        if self.input_ids.is_cuda:  # non-blocking copies: the step's launch does not wait for them on the host
            host, table = host.pin_memory(), table.pin_memory()
        dev = host.to(self.input_ids.device, non_blocking=True)
        self.input_ids[:bucket].copy_(dev[0])
        self.positions[:bucket].copy_(dev[1])
        self.slots[:bucket].copy_(dev[2])
        self.seq_lens[:bucket].copy_(dev[3])
        self.slot_mapping[:bucket].copy_(dev[4])
        self.page_table[:bucket].copy_(table, non_blocking=True)

    def take_unknown(self, last_tokens: torch.Tensor, bucket: int) -> None:
        """UNKNOWN_TOKEN rows take their slot's entry of `last_tokens` (row i is decode slot i), on the device: the
        step before may still be drawing them."""
        ids = self.input_ids[:bucket]
        ids.copy_(torch.where(ids == UNKNOWN_TOKEN, last_tokens[:bucket], ids))

    def advance(self, offsets: torch.Tensor, bucket: int, positions_only: bool = False) -> None:
        """Move each row's position on by `offsets` [bucket] (on the device), with its sequence length and KV slot
        unless `positions_only` (a speculative step computes those from the positions itself)."""
        positions = self.positions[:bucket]
        positions.add_(offsets)
        if positions_only:
            return
        self.seq_lens[:bucket].copy_(positions + 1)
        page = (positions // self.page_size).clamp(max=self.width - 1)
        pages = self.page_table[:bucket].gather(1, page[:, None]).squeeze(1).long()
        self.slot_mapping[:bucket].copy_(pages * self.page_size + positions % self.page_size)


class SpeculationInputs:
    """Fixed-address inputs of a speculative step beside `DecodeInputs`' (tokens, positions, slots, page table):
    per row, the tokens its last verify step kept (`accepted`, 1 for a row promoted this step, which drafts from
    its prompt's last position), how many of them its state keeps (`keep`: k + 1 for a promoted row, nothing to roll
    back), and host drafts that replace the head's (`override` where `use_override`). A row whose last step is
    still in flight (KEPT_ON_DEVICE, `pending`) takes its kept count from the device (`take_kept`), and its drafts
    from `alternatives` (one list a possible count)."""

    def __init__(self, rows: int, k: int, device) -> None:
        self.k = k
        self.accepted = torch.ones(rows, dtype=torch.long, device=device)
        self.keep = torch.full((rows,), k + 1, dtype=torch.long, device=device)
        self.override = torch.zeros(rows, k, dtype=torch.long, device=device)
        self.alternatives = torch.zeros(rows, k + 1, k, dtype=torch.long, device=device)
        self.use_override = torch.zeros(rows, dtype=torch.bool, device=device)
        self.pending = torch.zeros(rows, dtype=torch.bool, device=device)
        self.steps = torch.arange(k + 1, device=device)

    def fill_inert(self) -> None:
        self.accepted.fill_(1)
        self.keep.fill_(self.k + 1)
        self.use_override.fill_(False)
        self.pending.fill_(False)

    def fill(self, cmd: StepCommand, T: int) -> None:
        n, bucket, k = len(cmd.decode_tokens), cmd.bucket, self.k
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


class RankRuntime:
    def __init__(
        self,
        model: Qwen35Shard,
        state: ModelState,
        *,
        rank: int,
        max_batch: int,
        max_pages_per_seq: int,
        device: torch.device,
        tp: int = 1,
        acceptance: tuple[float, ...] | None = None,
        speculate_up_to: int | None = None,
        draft_head: "torch.Tensor | Fp8Weight | None" = None,
        fuse_mixed_steps: bool = False,
    ) -> None:
        """With speculation (state.verify_steps > 0): decode steps of at most `speculate_up_to` rows (None: any)
        may draft and verify (`StepCommand.speculate`); acceptance: benchmarks' emulated draft acceptance
        (`runtime.speculation.SpeculationOverride.acceptance`); draft_head: what the drafts read in place of lm_head
        (`draft_head()`; None: lm_head). fuse_mixed_steps: a step's decode rows and prompt chunks run as one
        forward (a captured shape's replay where one fits), not the rows' forward then the chunks'; with
        speculation, only steps whose rows do not draft."""
        self.model, self.state, self.rank, self.max_batch, self.tp = model, state, rank, max_batch, tp
        self.fuse_mixed_steps = fuse_mixed_steps
        self.acceptance = acceptance
        self.speculate_up_to = max_batch if speculate_up_to is None else speculate_up_to
        self.device = device
        self.inputs = DecodeInputs(max_batch, max_pages_per_seq, state.trash_page, state.page_size, device)
        self.occupied = [False] * max_batch
        # Captured forwards by shape (CUDA); a shape without one runs eagerly. Prompt chunks replay padded to a
        # bucket of tokens in `prefill_inputs`: a prefill of a few hundred tokens costs its ~450 launches on the
        # host otherwise, more than its time on the GPU.
        self.graphs: StepGraphs | None = None
        self.prefill_inputs: PrefillInputs | None = None
        # Rank 0 only: what each state slot's request samples with.
        self.vocab = model.cfg.vocab_size
        kernels = model.ops.config
        # Per state slot, on the device, what the next step's inputs take before the host has it (overlap
        # scheduling): the token rank 0 drew (or a speculative step kept) last, and how many tokens that step kept.
        # The other ranks receive rank 0's before a step that needs them.
        self.carried = torch.zeros(2, state.num_slots + 1, dtype=torch.long, device=device)
        self.sampling = SlotSampling(state.num_slots + 1, self.vocab, device, pdl=kernels is None or kernels.pdl,
                                     last_tokens=self.carried[0]) if rank == 0 else None
        self.speculation = SpeculationInputs(max_batch, state.verify_steps, device) if state.verify_steps else None
        self.draft_head = draft_head
        # Emulated acceptance: draft j is kept, after draft j - 1 was, with the ratio of their rates.
        self._keep_ratio = None if not acceptance else torch.tensor(
            [b / a if a > 0 else 0.0 for a, b in zip((1.0, *acceptance), acceptance)], device=device)

    # Forwards ---------------------------------------------------------------------------------------------------------
    def programs(self, shapes: list[StepShape], prompt_requests: int = 1) -> dict[StepShape, GraphProgram]:
        """Each shape's forward over the fixed inputs (`program`): what a graph captures. Makes the fixed prompt
        inputs first, for up to `prompt_requests` chunks and the shapes' largest prompt-token bucket."""
        tokens = max((s.prompt_tokens for s in shapes), default=0)
        if tokens:
            state = self.state
            head = state.num_slots if state.verify_steps else None  # the verify pools' trash row
            self.prefill_inputs = PrefillInputs(tokens, self.inputs.width, state.trash_slot, state.trash_page,
                                                state.page_size, self.device, requests=prompt_requests,
                                                head_trash=head)
        return {s: self.program(s) for s in shapes}

    def program(self, shape: StepShape) -> GraphProgram:
        """The forward of `shape` over the fixed inputs, as the step's fill (or `prepare(shape)`) left them: its
        outputs (`ForwardOutputs`)."""
        if shape.tokens_per_row > 1 and not self.can_speculate(shape.rows):
            raise ValueError(f"rank {self.rank} does not speculate in steps of {shape.rows} rows")
        prompts, b = self.prefill_inputs, shape.prompt_tokens
        if b and (prompts is None or b > prompts.tokens):
            raise ValueError(f"no fixed prompt inputs of {b} tokens (`programs` makes them)")

        def run() -> ForwardOutputs:
            chunks = prompts.batch(b) if b else None
            head = prompts.head_inputs(b) if b and self.speculation else None
            return self._forward(shape.rows, shape.tokens_per_row, chunks, head)

        return run

    def prepare(self, shape: StepShape) -> None:
        """Inert fixed inputs for `shape` (every row and chunk reads and writes only the trash slot and page): what
        its program runs on before and while it is captured."""
        if shape.rows:
            self.inputs.fill([], [], shape.rows)
        if self.speculation:
            self.speculation.fill_inert()
        if shape.prompt_tokens:
            self.prefill_inputs.fill_inert(shape.prompt_tokens)

    def can_speculate(self, bucket: int) -> bool:
        """Whether a decode step of `bucket` rows may draft and verify (`speculate_up_to`); the engine decides
        per step (`StepCommand.speculate`)."""
        return self.speculation is not None and bucket <= self.speculate_up_to

    def _forward(self, rows: int, T: int, chunks: PromptChunks | None, head) -> "ForwardOutputs":
        """One forward of a step: the fixed decode inputs' first `rows` rows, T tokens each (T > 1: drafts and
        their verification, `_speculative_forward`), and the prompt chunks. In a speculative engine a one-token row
        may come from a verify step: its state rolls back first, and the MTP head runs over that step's positions
        as a speculative step's would (its KV there, which later drafts attend to); each row's hidden state is kept
        for a later draft (the engine then sends it as promoted: verify_accepted 0); and the head runs over the
        chunks (`head`: its inputs, see `_head_over_prompts`)."""
        if T > 1:
            if chunks is not None:
                raise ValueError("a speculative step's rows run apart from prompt chunks")
            return self._speculative_forward(rows)
        model, state, spec = self.model, self.state, self.speculation is not None
        row_batch = self.inputs.batch(rows) if rows else None
        if spec and rows:
            state.commit_verified(row_batch.slots, self.speculation.keep[:rows], model.ops.roll_back_pool)
            self._head_over_last_step(rows)
        batch = StepBatch.of(row_batch, chunks)
        hidden = model.forward(state, batch)
        n = batch.row_tokens
        if spec and rows:
            state.verify_hidden[state.verify_rows(row_batch.slots), 0] = hidden[:n]
        if chunks is None:
            return ForwardOutputs(model.logits(hidden))
        last = self._head_over_prompts(hidden[n:], chunks, *head) if spec else hidden[batch.chunk_ends()]
        if not n:
            return ForwardOutputs(None, model.logits(last))
        logits = model.logits(torch.cat([hidden[:n], last]))
        return ForwardOutputs(logits[:n], logits[n:])

    def _run(self, rows: int, T: int, chunks: list[PrefillChunk], computed: list) -> "ForwardOutputs":
        """The forward of `rows` fixed-input rows of T tokens and these chunks (of `computed`, their commands): the
        replay of a captured shape where one fits (the chunks padded into the fixed prompt inputs), else eager."""
        bucket = self._prompt_bucket(rows, chunks) if chunks else 0
        shape = StepShape(rows, T, bucket)
        if (bucket or not chunks) and self.graphs is not None and self.graphs.captured(shape):
            if chunks:  # a graph's prefill starts each fresh prompt from a zeroed state; the eager one resets them
                for c in chunks:
                    if c.start == 0:
                        self.state.reset_slot(c.slot)
                self.prefill_inputs.fill(chunks, bucket, *self._head_inputs(computed))
            return self.graphs(shape)
        prompts = None
        if chunks:
            prompts = PromptChunks.build(chunks, self.state.page_size, self.state.trash_page, self.device)
        head = self._head_tensors(computed) if prompts is not None and self.speculation else None
        return self._forward(rows, T, prompts, head)

    def _prompt_bucket(self, rows: int, chunks: list[PrefillChunk]) -> int:
        """The smallest captured prompt-token bucket that the chunks fit beside `rows` rows, or 0."""
        if self.graphs is None or self.prefill_inputs is None:
            return 0
        return next((s.prompt_tokens for s in self.graphs.shapes if s.rows == rows and s.tokens_per_row == 1
                     and s.prompt_tokens and self.prefill_inputs.fits(chunks, s.prompt_tokens)), 0)

    # Slots ----------------------------------------------------------------------------------------------------------
    def _move_slot_within(self, src: int, dst: int) -> None:
        """Move a decode slot's request into a free decode slot: state, page-table row, sampling setup."""
        if not self.occupied[src] or self.occupied[dst]:
            raise SlotProtocolError(
                f"rank {self.rank}: move {src} -> {dst} needs an occupied source and a free target "
                f"(occupied: {self.occupied[src]}, {self.occupied[dst]})"
            )
        self.state.copy_slot(src, dst)
        self.state.move_verify_slot(src, dst)
        self.carried[1, dst] = self.carried[1, src]  # the tokens (row 0) move with the sampling setup
        self.inputs.table_host[dst] = self.inputs.table_host[src]
        if self.sampling:
            self.sampling.move(src, dst)
        self.occupied[src], self.occupied[dst] = False, True

    def _apply_slot_changes(self, cmd: StepCommand) -> None:
        for slot in cmd.released_prefill_slots:
            if self.sampling:
                self.sampling.release(slot)
        for c in cmd.compactions:
            if not self.occupied[c.hole]:
                raise SlotProtocolError(f"rank {self.rank}: retiring decode slot {c.hole}, which is free")
            self.occupied[c.hole] = False
            if self.sampling:
                self.sampling.release(c.hole)
            if c.moved_from is not None:
                self._move_slot_within(c.moved_from, c.hole)
        for p in cmd.promotions:
            if self.occupied[p.to_slot] or p.to_slot >= self.max_batch:
                raise SlotProtocolError(f"rank {self.rank}: promotion into decode slot {p.to_slot}, which is taken")
            if len(p.pages) > self.inputs.width:
                raise SlotProtocolError(f"rank {self.rank}: {len(p.pages)} pages exceed the table width")
            self.state.copy_slot(p.from_slot, p.to_slot)
            self.state.move_verify_slot(p.from_slot, p.to_slot)
            row = self.inputs.table_host[p.to_slot]
            row[:] = self.state.trash_page
            row[: len(p.pages)] = p.pages
            if self.sampling:
                self.sampling.move(p.from_slot, p.to_slot)
            self.occupied[p.to_slot] = True
        live = sum(self.occupied)
        if live != len(cmd.decode_tokens) or not all(self.occupied[: len(cmd.decode_tokens)]):
            raise SlotProtocolError(
                f"rank {self.rank}: {len(cmd.decode_tokens)} decode rows but slots occupied are "
                f"{[i for i, o in enumerate(self.occupied) if o]}"
            )

    def _check_request_slot(self, slot: int) -> None:
        if not self.max_batch <= slot < self.state.num_slots:
            raise SlotProtocolError(f"rank {self.rank}: slot {slot} is not a prefill slot")

    # The step -------------------------------------------------------------------------------------------------------
    def execute(self, cmd: StepCommand, on_launched: Callable[[], None] = lambda: None) -> StepResult | None:
        """Run one step; `on_launched()` as `launch` calls it."""
        launched = self.launch(cmd, on_launched)
        return None if launched is None else launched.finish()

    @torch.inference_mode()
    def launch(self, cmd: StepCommand, on_launched: Callable[[], None] = lambda: None) -> "LaunchedStep | None":
        """Queue one step on the device without waiting for it: rank 0 returns what `finish` reads its tokens
        from, the other ranks None. Overlap scheduling launches step k+1 before finishing step k; step k+1's
        UNKNOWN_TOKEN rows then take step k's tokens on the device, its KEPT_ON_DEVICE rows step k's kept counts.
        `on_launched()` once the whole step is queued on a GPU (its caller keeps other Python off the GIL until
        then: every torch call here gives the GIL up and waits to get it back), at the start on the CPU, where
        launching computes the step."""
        if cmd.speculate and not (cmd.decode_tokens and self.can_speculate(cmd.bucket)):
            raise SlotProtocolError(f"rank {self.rank}: a speculative step of bucket {cmd.bucket} "
                                    f"({len(cmd.decode_tokens)} rows), which this rank does not speculate")
        clock = StepClock(self.device) if self.sampling else None  # rank 0 times its steps
        queued = self.device.type == "cuda"  # launching queues the work (on the CPU it computes it)
        if not queued:
            on_launched()
        for slot, snapshot, kept in cmd.finish_snapshots:  # before the compactions reuse the slots
            if not (0 <= slot < self.max_batch and self.occupied[slot]):
                raise SlotProtocolError(f"rank {self.rank}: snapshot of decode slot {slot}, which is free")
            if kept:  # roll back to what its last verify step kept (filled on the device: no host sync)
                if not 1 <= kept <= self.state.verify_steps + 1:
                    raise SlotProtocolError(f"rank {self.rank}: kept must be in [1, {self.state.verify_steps + 1}], "
                                            f"got {kept}")
                self.state.commit_verified(torch.full((1,), slot, device=self.device),
                                           torch.full((1,), kept, device=self.device), self.model.ops.roll_back_pool)
            self.state.copy_slot(slot, self.state.snapshot_slot(snapshot))
        self._apply_slot_changes(cmd)
        if self.sampling:
            for p in cmd.prefill:
                self.sampling.start(p.slot, p.sampling, p.prefix_ids + p.token_ids if p.prefix_ids else p.token_ids)

        decode_draw = prefill_draw = speculation = None
        n = len(cmd.decode_tokens)
        index_offsets = None
        if n:
            self.inputs.fill(cmd.decode_tokens, cmd.decode_positions, cmd.bucket)
            if self.speculation:
                self.speculation.fill(cmd, self.state.verify_steps + 1)
            if self.sampling:
                # Before this step reads them: a row the step before drew may have been flagged (the logits it is
                # drawn again from are also the graph's, which this step overwrites).
                self.sampling.settle()
            index_offsets = self._carry_in(cmd)
        # A prompt a snapshot holds whole (`PrefixCache.match`) has no tokens to compute: its first token's logits
        # come from the hidden state restored with the snapshot.
        computed = [p for p in cmd.prefill if p.token_ids]
        chunks = [PrefillChunk(p.token_ids, p.start, p.slot, p.pages) for p in computed]
        # One forward for the rows and the chunks where the step can (never with drafts; on a device with graphs,
        # only where a captured shape fits: eager, its launches would cost more than the second weight pass it
        # saves); else the rows' forward, then the chunks'.
        fused = (self.fuse_mixed_steps and bool(n and chunks) and not cmd.speculate
                 and (self.graphs is None or self._prompt_bucket(cmd.bucket, chunks) > 0))
        if n and not fused:
            out = self._run(cmd.bucket, self.state.verify_steps + 1 if cmd.speculate else 1, [], [])
            if cmd.speculate:
                decode_draw, speculation = self._speculative_decode(cmd, out, index_offsets)
            else:
                decode_draw = self._draw_decode(cmd, out.row_logits, index_offsets)

        # A prompt resuming after a cached prefix: its state and the KV of its partial page, before its chunk.
        for snapshot, slot in cmd.restore_snapshots:
            self._check_request_slot(slot)
            self.state.copy_slot(self.state.snapshot_slot(snapshot), slot)
        for src, dst in cmd.copy_pages:
            if not (0 <= src < self.state.num_pages and 0 <= dst < self.state.num_pages):
                raise SlotProtocolError(f"rank {self.rank}: page copy {src} -> {dst} is outside the pages")
            self.state.copy_page(src, dst)
        if cmd.prefill:
            prefill_logits = None  # at each computed chunk's last token
            if chunks:
                out = self._run(cmd.bucket if fused else 0, 1, chunks, computed)
                prefill_logits = out.chunk_logits  # row i is chunk i's (a padded step's padding after)
                if fused:
                    decode_draw = self._draw_decode(cmd, out.row_logits, index_offsets)
            for slot, snapshot in cmd.save_snapshots:
                self._check_request_slot(slot)
                self.state.copy_slot(slot, self.state.snapshot_slot(snapshot))
            resumed = [p.slot for p in cmd.prefill if not p.token_ids]
            if resumed and self.state.verify_steps:  # what their first drafts start from
                rows = upload({"rows": resumed}, torch.long, self.device)["rows"]
                self.state.verify_hidden[rows, 0] = self.state.last_hidden[rows]
            last = [i for i, p in enumerate(cmd.prefill) if p.last]
            if self.sampling and last:
                # A prompt's last chunk draws the request's first token (token index 0).
                setup = self.sampling.prepare([cmd.prefill[i].slot for i in last], [0] * len(last), cmd.step_seed)
                prefill_draw = self.sampling.draw(self._first_token_logits(cmd, last, prefill_logits), setup)
        if clock is not None:
            clock.stop()
        if queued:
            on_launched()
        return LaunchedStep(self, cmd, decode_draw, prefill_draw, speculation, clock) if self.sampling else None

    def _carry_in(self, cmd: StepCommand) -> torch.Tensor | None:
        """The decode rows' inputs that the step before holds on the device (overlap scheduling): an UNKNOWN_TOKEN
        row takes the token rank 0 drew or kept last for its slot; a KEPT_ON_DEVICE row also the count its
        speculative step kept, which moves its position on (and its roll-back, its drafts' base). Returns what
        that adds to each row's token index (None: nothing)."""
        pending = KEPT_ON_DEVICE in cmd.verify_accepted
        if not pending and UNKNOWN_TOKEN not in cmd.decode_tokens:
            return None
        if self.tp > 1:  # rank 0's to every rank, on the device: a sum with zeros from the others
            self.model.all_reduce(self.carried if self.rank == 0 else self.carried.zero_())
        self.inputs.take_unknown(self.carried[0], cmd.bucket)
        if not pending:
            return None
        more = self.speculation.take_kept(self.carried[1], cmd.bucket, cmd.draft_tokens is not None)
        self.inputs.advance(more, cmd.bucket, positions_only=cmd.speculate)
        return more

    def _draw_decode(self, cmd: StepCommand, logits: torch.Tensor, index_offsets: torch.Tensor | None):
        """Rank 0 queues the decode rows' draw behind the forward (None elsewhere)."""
        if not self.sampling:
            return None
        n = len(cmd.decode_tokens)
        return self.sampling.draw(logits[:n], self.sampling.prepare(list(range(n)), cmd.decode_token_index,
                                                                     cmd.step_seed, index_offsets))

    def _first_token_logits(self, cmd: StepCommand, last: list[int], computed_logits) -> torch.Tensor:
        """The logits of the prompts that end in this step (`last`: their indices in `cmd.prefill`), in that
        order: a computed chunk's row of `computed_logits`, a resumed prompt's from its restored hidden state."""
        computed = [i for i, p in enumerate(cmd.prefill) if p.token_ids]
        resumed = [i for i, p in enumerate(cmd.prefill) if not p.token_ids]  # each ends its prompt
        logits = computed_logits
        if resumed:
            slots = upload({"slots": [cmd.prefill[i].slot for i in resumed]}, torch.long, self.device)["slots"]
            logits = self.model.logits(self.state.last_hidden[slots])
            if computed_logits is not None:
                logits = torch.cat([computed_logits[: len(computed)], logits])
        row = {i: r for r, i in enumerate(computed + resumed)}
        return select_rows(logits, [row[i] for i in last])

    # Speculative decoding (k drafts a row) -----------------------------------------------------------------------
    def _head_inputs(self, chunks: list) -> tuple[list[int] | None, list[int] | None]:
        """A speculative engine's prefill of these `PrefillCommand`s: each chunk token's following token (the
        prompt's, 0 after its last), and the verify-pool row each chunk's last hidden state goes to (the trash row
        unless it ends its prompt). (None, None) without speculation."""
        if not self.state.verify_steps:
            return None, None
        following = [t for p in chunks for t in p.token_ids[1:] + [p.next_token]]
        return following, [p.slot if p.last else self.state.num_slots for p in chunks]

    def _head_tensors(self, chunks: list) -> tuple[torch.Tensor, torch.Tensor]:
        """`_head_inputs` on the device, for an eager step (a graph's fixed inputs take the lists)."""
        following, rows = self._head_inputs(chunks)
        longs = upload({"following": following, "rows": rows}, torch.long, self.device)
        return longs["following"], longs["rows"]

    def _head_over_prompts(self, hidden: torch.Tensor, chunks: PromptChunks, following: torch.Tensor,
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

    def _speculative_forward(self, bucket: int) -> "ForwardOutputs":
        """A speculative step over the fixed inputs' first `bucket` rows: draft k tokens with the MTP head from the
        hidden state before the row's input token, and verify the input token and the drafts in one forward (k + 1
        tokens a row), whose GDN layers start from the state after the tokens the row's last step kept
        (`SpeculationInputs.keep`). Its outputs: the logits of every row's first position [bucket, V] and of the k
        after it [bucket, k, V] (views of one [bucket, k + 1, V]), and the drafts [bucket, k]."""
        model, state, spec, inputs = self.model, self.state, self.speculation, self.inputs
        k, ps = state.verify_steps, state.page_size
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
        drafted = torch.where(spec.use_override[:bucket, None], spec.override[:bucket], drafted)
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
        inputs, state, spec = self.inputs, self.state, self.speculation
        T, ps = state.verify_steps + 1, state.page_size
        table = inputs.page_table[:bucket]
        where = starts[:, None] + spec.steps  # [bucket, T]
        pages = table.long().gather(1, where // ps)
        return TokenRows(input_ids=inputs.input_ids[:bucket], positions=where.flatten(), slots=inputs.slots[:bucket],
                         page_table=table.repeat_interleave(T, dim=0), seq_lens=where.flatten() + 1,
                         slot_mapping=(pages * ps + where % ps).flatten(), tokens_per_row=T, kept=spec.keep[:bucket])

    def _head_over_last_step(self, bucket: int) -> torch.Tensor:
        """The MTP head over each row's last step's positions, each with the token after it (the kept drafts,
        then the row's input token): its KV there, which later drafts attend to, and its output at the last kept
        position [bucket, H], which drafts the token after the input token."""
        model, state, spec, inputs = self.model, self.state, self.speculation, self.inputs
        T = state.verify_steps + 1
        tokens, accepted = inputs.input_ids[:bucket], spec.accepted[:bucket]
        rows = state.verify_rows(inputs.slots[:bucket])
        before = accepted - 1
        following = torch.cat([state.drafts[rows], tokens[:, None]], dim=1).scatter(1, before[:, None], tokens[:, None])
        h = model.mtp(following.flatten(), state.verify_hidden[rows].flatten(0, 1), state,
                      StepBatch.of(self._verify_rows(bucket, (inputs.positions[:bucket] - accepted).clamp(min=0))))
        return h.view(bucket, T, -1).gather(1, before.view(-1, 1, 1).expand(-1, 1, h.shape[-1])).squeeze(1)

    def _speculative_decode(self, cmd: StepCommand, out: "ForwardOutputs",
                            index_offsets: torch.Tensor | None) -> tuple:
        """Behind the speculative forward (`out`), rank 0 draws every row's first token as a plain decode step
        would, and the k positions after it for the rows without penalties (whose counts would see the drafts),
        then keeps each row's drafts on the device (`_keep_drafts`)."""
        n = len(cmd.decode_tokens)
        if not self.sampling:
            return None, None
        first_logits, extra_logits, drafted = out.row_logits, out.draft_logits, out.drafts
        k, slots = self.state.verify_steps, list(range(n))
        free = [i for i in slots if not self.sampling.settings[i].needs_counts]
        # One draw: every row's first position, then the k after it of the free rows (each its own row: the
        # sampler reads rows at a stride of V). The extra rows' tokens also land in their slots' penalty counts,
        # which only penalty rows, never among them, read.
        logits = torch.cat([first_logits[:n], select_rows(extra_logits, free).flatten(0, 1)])
        rows = slots + [i for i in free for _ in range(k)]
        token_index = cmd.decode_token_index + [cmd.decode_token_index[i] + j for i in free for j in range(1, k + 1)]
        drawn = self.sampling.draw(logits, self.sampling.prepare(rows, token_index, cmd.step_seed, index_offsets))
        ends = [(self.sampling.settings[i].max_tokens, self.sampling.settings[i].stop_token_ids) for i in slots]
        kept = KeptDrafts(free, drafted[:n].clone(), ends)
        drawn.on_redrawn = lambda d: self._keep_drafts(kept, d, list(d.slots[:n]))
        self._keep_drafts(kept, drawn, slots)
        return drawn, kept

    def _keep_drafts(self, kept: "KeptDrafts", drawn: Draw, slots: list[int]) -> None:
        """On the device, behind the draw (its rows in `_speculative_decode`'s order): each row keeps draft
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

    def _kept_tokens(self, first: list[SampledToken], drawn: list[SampledToken],
                     kept: "KeptDrafts") -> list[list[SampledToken]]:
        """Each row's tokens after its first that the step kept (`drawn`: the free rows' k positions after the
        first, in order), from the counts `_keep_drafts` computed on the device."""
        counts = kept.counts()
        k = kept.drafted.shape[1]
        more: list[list[SampledToken]] = [[] for _ in first]
        for n, i in enumerate(kept.free):
            more[i] = drawn[n * k: n * k + counts[i] - 1]
        return more

    def finish(self, step: "LaunchedStep") -> StepResult:
        """Rank 0: the launched step's tokens, once they are on the host."""
        sampling, cmd = self.sampling, step.cmd
        decode = sampling.collect(step.decode) if step.decode else []
        n = len(cmd.decode_tokens)
        decode, drawn = decode[:n], decode[n:]  # a speculative step's draw holds its drafts' positions after
        prefill: list[SampledToken | None] = [None] * len(cmd.prefill)
        if step.prefill:
            last = [i for i, p in enumerate(cmd.prefill) if p.last]
            for i, s in zip(last, sampling.collect(step.prefill)):
                prefill[i] = s
        more = self._kept_tokens(decode, drawn, step.speculation) if step.speculation else []
        clock = step.clock
        return StepResult(decode, prefill, more, clock.seconds() if clock else 0.0,
                          clock.launch_seconds if clock else 0.0)


class KeptDrafts:
    """A speculative step's drafts and what it kept of them: counted on the device behind its draw
    (`RankRuntime._keep_drafts`), read on the host once the copy is there."""

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


class LaunchedStep:
    """Rank 0's step, queued on the device; `finish()` waits for its tokens (the worker's deferred result)."""

    def __init__(self, runtime: RankRuntime, cmd: StepCommand, decode, prefill, speculation=None,
                 clock: "StepClock | None" = None) -> None:
        self.runtime, self.cmd, self.decode, self.prefill = runtime, cmd, decode, prefill
        self.speculation: KeptDrafts | None = speculation
        self.clock = clock

    def ready(self) -> bool:
        return all(d is None or d.ready() for d in (self.decode, self.prefill, self.speculation))

    @torch.inference_mode()
    def finish(self) -> StepResult:
        return self.runtime.finish(self)


class StepClock:
    """A step's time on its device: CUDA events around what it queues on the rank's stream (the step's own time,
    wherever the host is meanwhile), or the host's clock on the CPU, where launching a step computes it. Also
    how long the host took to launch it (on a GPU the device may idle for part of that)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.launched_at = time.perf_counter()
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = self.launched_at
        self.end = None
        self.launch_seconds = 0.0

    def stop(self) -> None:
        if self.cuda:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record()
        now = time.perf_counter()
        if not self.cuda:
            self.end = now
        self.launch_seconds = now - self.launched_at

    def seconds(self) -> float:
        """Once the step's tokens are on the host (its last operation is then done or nearly)."""
        if self.end is None:
            return 0.0
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.end - self.start
