"""What one rank does with a step: slot bookkeeping, the batched decode and prefill forwards, sampling (rank 0).

Slots: state slots 0..max_batch-1 are the dense decode slots, max_batch.. the prefill slots, then the prefix
cache's snapshot slots and the trash slot. The decode page table, positions and token inputs live in fixed-address
buffers sized for the largest bucket, so a captured CUDA graph reads each step's inputs from the same addresses;
so do a one-chunk prefill's, padded to a bucket of tokens (`PrefillInputs`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from deltaserve.model.batch import DecodeBatch, PrefillBatch, PrefillChunk, PrefillInputs
from deltaserve.model.forward import Qwen35Shard
from deltaserve.model.state import ModelState

from .backend import GraphProgram, StepGraphs
from .commands import UNKNOWN_TOKEN, SampledToken, SlotProtocolError, StepCommand, StepResult
from .sampling import SlotSampling

log = logging.getLogger(__name__)


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

    def batch(self, bucket: int) -> DecodeBatch:
        return DecodeBatch(
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
    ) -> None:
        self.model, self.state, self.rank, self.max_batch, self.tp = model, state, rank, max_batch, tp
        self.device = device
        self.inputs = DecodeInputs(max_batch, max_pages_per_seq, state.trash_page, state.page_size, device)
        self.occupied = [False] * max_batch
        self.graphs: StepGraphs | None = None  # captured decode buckets (CUDA); the others run eagerly
        # One-chunk prefills padded to a bucket of tokens, replayed from captured graphs (CUDA): a prefill of a few
        # hundred tokens costs its ~450 launches on the host otherwise, more than its time on the GPU.
        self.prefill_inputs: PrefillInputs | None = None
        self.prefill_graphs: StepGraphs | None = None
        # Rank 0 only: what each state slot's request samples with.
        self.vocab = model.cfg.vocab_size
        kernels = model.ops.config
        self.sampling = SlotSampling(state.num_slots + 1, self.vocab, device, pdl=kernels is None or kernels.pdl) \
            if rank == 0 else None
        # The token rank 0 drew last per state slot, on the device (overlap scheduling); the other ranks receive
        # rank 0's whole vector before a step that needs it.
        self.last_tokens = self.sampling.last_tokens if self.sampling else \
            torch.zeros(state.num_slots + 1, dtype=torch.long, device=device)

    def prefill_programs(self, buckets: list[int]) -> dict[int, GraphProgram]:
        """For each bucket of tokens, a one-chunk prefill over the fixed inputs and the state, padded to the
        bucket: what a prefill graph captures. A program reads what a fill for its bucket wrote
        (`prefill_inputs.fill`, or `fill_inert` before a capture)."""
        state = self.state
        self.prefill_inputs = PrefillInputs(max(buckets), self.inputs.width, state.trash_slot, state.trash_page,
                                            state.page_size, self.device)
        model = self.model
        return {b: (lambda batch=self.prefill_inputs.batch(b): model.prefill(state, batch)) for b in buckets}

    def _prefill_bucket(self, chunks: list[PrefillChunk]) -> int:
        """The smallest captured bucket a step's prefill fits (one chunk), or 0."""
        if self.prefill_graphs is None or len(chunks) != 1:
            return 0
        return next((b for b in self.prefill_graphs.buckets if self.prefill_inputs.fits(chunks[0], b)), 0)

    def decode_programs(self, buckets: list[int]) -> dict[int, GraphProgram]:
        """For each bucket, its decode step over the fixed inputs and the state: what a graph captures. The inputs
        are set to inert padding first (every row reads and writes only the trash slot and page)."""
        self.inputs.fill([], [], max(buckets))
        model, state = self.model, self.state
        return {b: (lambda batch=self.inputs.batch(b): model.decode(state, batch)) for b in buckets}

    # Slots ----------------------------------------------------------------------------------------------------------
    def _move_slot_within(self, src: int, dst: int) -> None:
        """Move a decode slot's request into a free decode slot: state, page-table row, sampling setup."""
        if not self.occupied[src] or self.occupied[dst]:
            raise SlotProtocolError(
                f"rank {self.rank}: move {src} -> {dst} needs an occupied source and a free target "
                f"(occupied: {self.occupied[src]}, {self.occupied[dst]})"
            )
        self.state.copy_slot(src, dst)
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
        """Run one step; `on_launched()` once the decode graph is queued on the GPU (at the start, when this step
        has no graph to launch: on the CPU, eager, prefill only)."""
        launched = self.launch(cmd, on_launched)
        return None if launched is None else launched.finish()

    @torch.inference_mode()
    def launch(self, cmd: StepCommand, on_launched: Callable[[], None] = lambda: None) -> "LaunchedStep | None":
        """Queue one step on the device without waiting for it: rank 0 returns what `finish` reads its tokens
        from, the other ranks None. Overlap scheduling launches step k+1 before finishing step k; step k+1's
        UNKNOWN_TOKEN rows then take step k's tokens on the device."""
        replay = self.graphs is not None and self.graphs.captured(cmd.bucket)
        if not (replay and cmd.decode_tokens):
            on_launched()
        self._apply_slot_changes(cmd)
        if self.sampling:
            for p in cmd.prefill:
                self.sampling.start(p.slot, p.sampling, p.prefix_ids + p.token_ids if p.prefix_ids else p.token_ids)

        decode_draw = prefill_draw = None
        n = len(cmd.decode_tokens)
        if n:
            self.inputs.fill(cmd.decode_tokens, cmd.decode_positions, cmd.bucket)
            if self.sampling:
                # Before this step reads them: a row the step before drew may have been flagged (the logits it is
                # drawn again from are also the graph's, which this step overwrites).
                self.sampling.settle()
            if UNKNOWN_TOKEN in cmd.decode_tokens:
                if self.tp > 1:  # rank 0's tokens to every rank, on the device: a sum with zeros from the others
                    self.model.all_reduce(self.last_tokens if self.rank == 0 else self.last_tokens.zero_())
                self.inputs.take_unknown(self.last_tokens, cmd.bucket)
            batch = self.inputs.batch(cmd.bucket)
            if replay:
                decode_logits = self.graphs(cmd.bucket)
                on_launched()
            else:
                decode_logits = self.model.decode(self.state, batch)
            if self.sampling:  # queued behind the forward
                setup = self.sampling.prepare(list(range(n)), cmd.decode_token_index, cmd.step_seed)
                decode_draw = self.sampling.draw(decode_logits[:n], setup)

        # A prompt resuming after a cached prefix: its state and the KV of its partial page, before its chunk.
        for snapshot, slot in cmd.restore_snapshots:
            self._check_request_slot(slot)
            self.state.copy_slot(self.state.snapshot_slot(snapshot), slot)
        for src, dst in cmd.copy_pages:
            if not (0 <= src < self.state.num_pages and 0 <= dst < self.state.num_pages):
                raise SlotProtocolError(f"rank {self.rank}: page copy {src} -> {dst} is outside the pages")
            self.state.copy_page(src, dst)
        if cmd.prefill:
            chunks = [PrefillChunk(p.token_ids, p.start, p.slot, p.pages) for p in cmd.prefill]
            bucket = self._prefill_bucket(chunks)
            if bucket:
                if chunks[0].start == 0:
                    self.state.reset_slot(chunks[0].slot)
                self.prefill_inputs.fill(chunks[0], bucket)
                prefill_logits = self.prefill_graphs(bucket)  # row 0 is the chunk's, row 1 the padding's
            else:
                batch = PrefillBatch.build(chunks, self.state.page_size, self.state.trash_page, self.device)
                prefill_logits = self.model.prefill(self.state, batch)
            for slot, snapshot in cmd.save_snapshots:
                self._check_request_slot(slot)
                self.state.copy_slot(slot, self.state.snapshot_slot(snapshot))
            last = [i for i, p in enumerate(cmd.prefill) if p.last]
            if self.sampling and last:
                # A prompt's last chunk draws the request's first token (token index 0).
                setup = self.sampling.prepare([cmd.prefill[i].slot for i in last], [0] * len(last), cmd.step_seed)
                prefill_draw = self.sampling.draw(prefill_logits[last], setup)
        if not self.sampling:
            return None
        return LaunchedStep(self, cmd, decode_draw, prefill_draw)

    def finish(self, step: "LaunchedStep") -> StepResult:
        """Rank 0: the launched step's tokens, once they are on the host."""
        sampling, cmd = self.sampling, step.cmd
        decode = sampling.collect(step.decode) if step.decode else []
        prefill: list[SampledToken | None] = [None] * len(cmd.prefill)
        if step.prefill:
            last = [i for i, p in enumerate(cmd.prefill) if p.last]
            for i, s in zip(last, sampling.collect(step.prefill)):
                prefill[i] = s
        return StepResult(decode, prefill)


class LaunchedStep:
    """Rank 0's step, queued on the device; `finish()` waits for its tokens (the worker's deferred result)."""

    def __init__(self, runtime: RankRuntime, cmd: StepCommand, decode, prefill) -> None:
        self.runtime, self.cmd, self.decode, self.prefill = runtime, cmd, decode, prefill

    def ready(self) -> bool:
        return all(d is None or d.ready() for d in (self.decode, self.prefill))

    @torch.inference_mode()
    def finish(self) -> StepResult:
        return self.runtime.finish(self)
