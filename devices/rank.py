"""What one rank does with a step: slot bookkeeping, the batched decode and prefill forwards, sampling (rank 0).

Slots: state slots 0..max_batch-1 are the dense decode slots, max_batch.. the prefill slots, then the trash
slot. The decode page table, positions and token inputs live in fixed-address buffers sized for the largest
bucket, so a captured CUDA graph reads each step's inputs from the same addresses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from deltaserve.kernels.sampling import SamplingTensors, sample
from deltaserve.kernels.triton_sampling import sample_on_gpu, top_p_alone
from deltaserve.model.batch import DecodeBatch, PrefillBatch, PrefillChunk
from deltaserve.model.forward import Qwen35Shard
from deltaserve.model.state import ModelState

from .commands import RowSampling, SampledToken, SlotProtocolError, StepCommand, StepResult

log = logging.getLogger(__name__)

TOP_K_FAST_PATH = 1024  # rows that all use top_k up to this sample among top-k candidates, without a full sort


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
        """Write this step's rows (and inert padding up to `bucket`) into the fixed buffers."""
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
        decode_runner: Callable[[int, DecodeBatch], torch.Tensor] | None = None,
    ) -> None:
        self.model, self.state, self.rank, self.max_batch = model, state, rank, max_batch
        self.device = device
        self.inputs = DecodeInputs(max_batch, max_pages_per_seq, state.trash_page, state.page_size, device)
        self.occupied = [False] * max_batch
        self.decode_runner = decode_runner  # (bucket, batch) -> logits; None: eager
        # Rank 0 only: sampling setup per state slot, and penalty counts when a request asks for them.
        self.slot_sampling: list[RowSampling | None] = [None] * (state.num_slots + 1)
        self.vocab = model.cfg.vocab_size
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

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
        self._move_sampling(src, dst)
        self.occupied[src], self.occupied[dst] = False, True

    def _move_sampling(self, src: int, dst: int) -> None:
        self.slot_sampling[dst], self.slot_sampling[src] = self.slot_sampling[src], None
        if self.output_counts is not None:
            self.output_counts[dst].copy_(self.output_counts[src])
            self.prompt_mask[dst].copy_(self.prompt_mask[src])

    def _apply_slot_changes(self, cmd: StepCommand) -> None:
        for slot in cmd.released_prefill_slots:
            self.slot_sampling[slot] = None
        for c in cmd.compactions:
            if not self.occupied[c.hole]:
                raise SlotProtocolError(f"rank {self.rank}: retiring decode slot {c.hole}, which is free")
            self.occupied[c.hole] = False
            self.slot_sampling[c.hole] = None
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
            self._move_sampling(p.from_slot, p.to_slot)
            self.occupied[p.to_slot] = True
        live = sum(self.occupied)
        if live != len(cmd.decode_tokens) or not all(self.occupied[: len(cmd.decode_tokens)]):
            raise SlotProtocolError(
                f"rank {self.rank}: {len(cmd.decode_tokens)} decode rows but slots occupied are "
                f"{[i for i, o in enumerate(self.occupied) if o]}"
            )

    # Sampling (rank 0) ----------------------------------------------------------------------------------------------
    def _ensure_counts(self) -> None:
        if self.output_counts is None:
            n = self.state.num_slots + 1
            self.output_counts = torch.zeros(n, self.vocab, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(n, self.vocab, dtype=torch.bool, device=self.device)

    def _sampling_setup(self, slots: list[int], token_index: list[int], step_seed: int):
        """(rows' setups, their SamplingTensors, token indices, slots on the device) for `_sample`. The parameters
        go up in two non-blocking copies, so this runs while the forward runs on the GPU, and the sampler's
        kernels are queued behind it (one blocking copy per field used to wait for the whole step first)."""
        rows = [self.slot_sampling[s] for s in slots]
        if None in rows:
            raise SlotProtocolError(f"rank {self.rank}: slot {slots[rows.index(None)]} has no sampling setup")
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
        if self.output_counts is not None:
            params.output_counts = self.output_counts[ints[3]]
            params.prompt_mask = self.prompt_mask[ints[3]]
        return rows, params, token_index, ints[3]

    def _sample(self, logits: torch.Tensor, setup) -> list[SampledToken]:
        rows, params, token_index, slot_index = setup
        for i, (r, step) in enumerate(zip(rows, token_index)):
            if step < r.min_tokens and r.stop_token_ids:
                logits[i, list(r.stop_token_ids)] = float("-inf")  # min_tokens: no stop token yet
        k = max(r.logprobs for r in rows)
        if logits.is_cuda:
            rounds = any(top_p_alone(r.temperature, r.top_p, r.top_k, self.vocab) for r in rows)
            tokens, chosen, top_ids, top_lp = sample_on_gpu(logits, params, k, top_p_alone=rounds)
        else:
            all_greedy = all(r.temperature <= 0 for r in rows)
            top_ks = [r.top_k for r in rows if r.temperature > 0]
            max_top_k = max(top_ks) if top_ks and 0 < min(top_ks) and max(top_ks) <= TOP_K_FAST_PATH else 0
            tokens, chosen, top_ids, top_lp = sample(logits, params, k, all_greedy, max_top_k)
        if self.output_counts is not None:
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

    # The step -------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, cmd: StepCommand, on_launched: Callable[[], None] = lambda: None) -> StepResult | None:
        """Run one step; `on_launched()` once the decode graph is queued on the GPU (at the start, when this step
        has no graph to launch: on the CPU, eager, prefill only)."""
        if self.decode_runner is None or not cmd.decode_tokens:
            on_launched()
        self._apply_slot_changes(cmd)
        for p in cmd.prefill:
            if p.sampling is not None:
                self.slot_sampling[p.slot] = p.sampling
                if p.sampling.needs_counts:
                    self._ensure_counts()
                if self.output_counts is not None:
                    self.output_counts[p.slot] = 0
                    self.prompt_mask[p.slot] = False
            if self.output_counts is not None:
                self.prompt_mask[p.slot, torch.tensor(p.token_ids, device=self.device)] = True

        decode_logits = decode_setup = None
        n = len(cmd.decode_tokens)
        if n:
            self.inputs.fill(cmd.decode_tokens, cmd.decode_positions, cmd.bucket)
            batch = self.inputs.batch(cmd.bucket)
            if self.decode_runner is not None:
                decode_logits = self.decode_runner(cmd.bucket, batch)
                on_launched()
            else:
                decode_logits = self.model.decode(self.state, batch)
            decode_logits = decode_logits[:n]
            if self.rank == 0:  # while the step runs on the GPU
                decode_setup = self._sampling_setup(list(range(n)), cmd.decode_token_index, cmd.step_seed)

        prefill_logits = None
        if cmd.prefill:
            chunks = [PrefillChunk(p.token_ids, p.start, p.slot, p.pages) for p in cmd.prefill]
            batch = PrefillBatch.build(chunks, self.state.page_size, self.state.trash_page, self.device)
            prefill_logits = self.model.prefill(self.state, batch)

        if self.rank != 0:
            return None
        decode = self._sample(decode_logits, decode_setup) if n else []
        prefill: list[SampledToken | None] = [None] * len(cmd.prefill)
        last = [i for i, p in enumerate(cmd.prefill) if p.last]
        if last:
            # A prompt's last chunk draws the request's first token (token index 0).
            setup = self._sampling_setup([cmd.prefill[i].slot for i in last], [0] * len(last), cmd.step_seed)
            sampled = self._sample(prefill_logits[last], setup)
            for i, s in zip(last, sampled):
                prefill[i] = s
        return StepResult(decode, prefill)
