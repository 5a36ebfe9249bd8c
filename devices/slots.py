"""A rank's decode slots: the fixed-address decode inputs, which slots are occupied, and the state copies a step's
slot changes make (promotions, compactions, the prefix cache's snapshots and page copies), each checked against
the rank's own view: a mismatch is a protocol error that poisons the replica, never fixed silently.

State slots 0..max_batch-1 are the dense decode slots (row i of a step is slot i), max_batch.. the prefill slots,
then the prefix cache's snapshot slots and the trash slot. The decode page table, positions and token inputs live
in fixed-address buffers sized for the largest bucket, so a captured CUDA graph reads each step's inputs from the
same addresses.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from deltaserve.model.batch import TokenRows
from deltaserve.model.state import ModelState

from .commands import UNKNOWN_TOKEN, SlotProtocolError, StepCommand
from .sampling import SlotSampling


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


class DecodeSlots:
    """Which decode slots hold a request, and the slot changes each step makes before its forward, in the order
    the scheduler planned them."""

    def __init__(self, state: ModelState, inputs: DecodeInputs, carried: torch.Tensor, rank: int,
                 sampling: SlotSampling | None) -> None:
        """carried: the rank's per-slot (last token, kept count) on the device, which moves with a slot; sampling:
        rank 0's per-slot sampling setup (None elsewhere)."""
        self.state, self.inputs, self.carried, self.rank, self.sampling = state, inputs, carried, rank, sampling
        self.max_batch = inputs.rows
        self.occupied = [False] * self.max_batch

    def before_step(self, cmd: StepCommand, roll_back: Callable[[int, int], None] | None) -> None:
        """Snapshots of finished requests (after rolling a speculative row back to what it kept: `roll_back(slot,
        kept)`), then the prefill slots released, the compactions and the promotions; checks that the step's rows
        are exactly the occupied slots."""
        state = self.state
        for slot, snapshot, kept in cmd.finish_snapshots:  # before the compactions reuse the slots
            if not (0 <= slot < self.max_batch and self.occupied[slot]):
                raise SlotProtocolError(f"rank {self.rank}: snapshot of decode slot {slot}, which is free")
            if kept:
                if roll_back is None:
                    raise SlotProtocolError(f"rank {self.rank}: a roll-back without speculation")
                roll_back(slot, kept)
            state.copy_slot(slot, state.snapshot_slot(snapshot))
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
                self._move(c.moved_from, c.hole)
        for p in cmd.promotions:
            if self.occupied[p.to_slot] or p.to_slot >= self.max_batch:
                raise SlotProtocolError(f"rank {self.rank}: promotion into decode slot {p.to_slot}, which is taken")
            if len(p.pages) > self.inputs.width:
                raise SlotProtocolError(f"rank {self.rank}: {len(p.pages)} pages exceed the table width")
            state.copy_slot(p.from_slot, p.to_slot)
            state.move_verify_slot(p.from_slot, p.to_slot)
            row = self.inputs.table_host[p.to_slot]
            row[:] = state.trash_page
            row[: len(p.pages)] = p.pages
            if self.sampling:
                self.sampling.move(p.from_slot, p.to_slot)
            self.occupied[p.to_slot] = True
        if sum(self.occupied) != len(cmd.decode_tokens) or not all(self.occupied[: len(cmd.decode_tokens)]):
            raise SlotProtocolError(
                f"rank {self.rank}: {len(cmd.decode_tokens)} decode rows but slots occupied are "
                f"{[i for i, o in enumerate(self.occupied) if o]}"
            )

    def before_prompts(self, cmd: StepCommand) -> None:
        """A prompt resuming after a cached prefix: its state and the KV of its partial page, before its chunk."""
        state = self.state
        for snapshot, slot in cmd.restore_snapshots:
            self._check_request_slot(slot)
            state.copy_slot(state.snapshot_slot(snapshot), slot)
        for src, dst in cmd.copy_pages:
            if not (0 <= src < state.num_pages and 0 <= dst < state.num_pages):
                raise SlotProtocolError(f"rank {self.rank}: page copy {src} -> {dst} is outside the pages")
            state.copy_page(src, dst)

    def after_prompts(self, cmd: StepCommand) -> None:
        """The prefix cache's snapshots of prompt slots, taken after the step's forward."""
        for slot, snapshot in cmd.save_snapshots:
            self._check_request_slot(slot)
            self.state.copy_slot(slot, self.state.snapshot_slot(snapshot))

    def _move(self, src: int, dst: int) -> None:
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

    def _check_request_slot(self, slot: int) -> None:
        if not self.max_batch <= slot < self.state.num_slots:
            raise SlotProtocolError(f"rank {self.rank}: slot {slot} is not a prefill slot")
