"""A rank's runner: a step's slot changes (`devices.slots`), its inputs, its shape, the replay of a graph captured
for that shape or the forward eagerly, and rank 0's draws; the speculative parts are `devices.speculation`'s.

Every forward a rank runs is `RankRuntime._forward` over fixed-address inputs (the decode slots', and a prompt
step's chunks padded to a bucket of tokens in `PrefillInputs`), so a captured CUDA graph reads each step's inputs
from the same addresses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.model.batch import PrefillChunk, PrefillInputs, PromptChunks, StepBatch, select_rows, upload
from deltaserve.model.forward import Qwen35Shard
from deltaserve.model.state import ModelState

from .backend import ForwardOutputs, GraphProgram, StepGraphs, StepShape
from .commands import KEPT_ON_DEVICE, UNKNOWN_TOKEN, SampledToken, SlotProtocolError, StepCommand, StepResult
from .sampling import SlotSampling
from .slots import DecodeInputs, DecodeSlots
from .speculation import KeptDrafts, Speculator

log = logging.getLogger(__name__)

# Prompt positions scored at a time (`RankRuntime._score_prompts`): their fp32 log-probs over a 248k vocabulary take
# 127 MB.
SCORED_POSITIONS = 128


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
        """With speculation (state.speculative_tokens > 0): decode steps of at most `speculate_up_to` rows (None: any)
        may draft and verify (`StepCommand.speculate`); acceptance: benchmarks' emulated draft acceptance
        (`runtime.speculation.SpeculationOverride.acceptance`); draft_head: what the drafts read in place of lm_head
        (`draft_head()`; None: lm_head). fuse_mixed_steps: a step's decode rows and prompt chunks run as one
        forward (a captured shape's replay where one fits), not the rows' forward then the chunks'; with
        speculation, only steps whose rows do not draft."""
        self.model, self.state, self.rank, self.max_batch, self.tp = model, state, rank, max_batch, tp
        self.fuse_mixed_steps = fuse_mixed_steps
        self.speculate_up_to = max_batch if speculate_up_to is None else speculate_up_to
        self.device = device
        self.inputs = DecodeInputs(max_batch, max_pages_per_seq, state.trash_page, state.page_size, device)
        # Captured forwards by shape (CUDA); a shape without one runs eagerly. Prompt chunks replay padded to a
        # bucket of tokens in `prefill_inputs`: a prefill of a few hundred tokens costs its ~450 launches on the
        # host otherwise, more than its time on the GPU.
        self.graphs: StepGraphs | None = None
        self.prefill_inputs: PrefillInputs | None = None
        self.vocab = model.cfg.vocab_size
        kernels = model.ops.config
        # Per state slot, on the device, what the next step's inputs take before the host has it (overlap
        # scheduling): the token rank 0 drew (or a speculative step kept) last, and how many tokens that step kept.
        # The other ranks receive rank 0's before a step that needs them.
        self.carried = torch.zeros(2, state.num_slots + 1, dtype=torch.long, device=device)
        # Rank 0 only: what each state slot's request samples with.
        self.sampling = SlotSampling(state.num_slots + 1, self.vocab, device, pdl=kernels is None or kernels.pdl,
                                     last_tokens=self.carried[0]) if rank == 0 else None
        self.slots = DecodeSlots(state, self.inputs, self.carried, rank, self.sampling)
        self.speculation = Speculator(model, state, self.inputs, self.carried, draft_head, acceptance) \
            if state.speculative_tokens else None

    # Forwards ---------------------------------------------------------------------------------------------------------
    def programs(self, shapes: list[StepShape], prompt_requests: int = 1) -> dict[StepShape, GraphProgram]:
        """Each shape's forward over the fixed inputs (`program`): what a graph captures. Makes the fixed prompt
        inputs first, for up to `prompt_requests` chunks and the shapes' largest prompt-token bucket."""
        tokens = max((s.prompt_tokens for s in shapes), default=0)
        if tokens:
            state = self.state
            head = state.num_slots if state.speculative_tokens else None  # the verify pools' trash row
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

    def _forward(self, rows: int, T: int, chunks: PromptChunks | None, head,
                 keep_prompt_hidden: bool = False) -> "ForwardOutputs":
        """One forward of a step: the fixed decode inputs' first `rows` rows, T tokens each (T > 1: drafts and
        their verification, `Speculator.forward`), and the prompt chunks. In a speculative engine a one-token row
        may come from a verify step: its state rolls back first, and the MTP head runs over that step's positions
        as a speculative step's would (its KV there, which later drafts attend to); each row's hidden state is kept
        for a later draft (the engine then sends it as promoted: verify_accepted 0); and the head runs over the
        chunks (`head`: its inputs, see `Speculator.head_over_prompts`). keep_prompt_hidden: every chunk token's
        hidden state comes back too (prompt log-probs)."""
        if T > 1:
            if chunks is not None:
                raise ValueError("a speculative step's rows run apart from prompt chunks")
            return self.speculation.forward(rows)
        model, spec = self.model, self.speculation
        row_batch = self.inputs.batch(rows) if rows else None
        if spec and rows:
            spec.before_rows(row_batch.slots, rows)
        batch = StepBatch.of(row_batch, chunks)
        hidden = model.forward(self.state, batch)
        n = batch.row_tokens
        if spec and rows:
            spec.after_rows(row_batch.slots, hidden[:n])
        if chunks is None:
            return ForwardOutputs(model.logits(hidden))
        last = spec.head_over_prompts(hidden[n:], chunks, *head) if spec else hidden[batch.chunk_ends()]
        kept = hidden[n:] if keep_prompt_hidden else None
        if not n:
            return ForwardOutputs(None, model.logits(last), prompt_hidden=kept)
        logits = model.logits(torch.cat([hidden[:n], last]))
        return ForwardOutputs(logits[:n], logits[n:], prompt_hidden=kept)

    def _run(self, rows: int, T: int, chunks: list[PrefillChunk], computed: list, bucket: int,
             keep_prompt_hidden: bool = False) -> "ForwardOutputs":
        """The forward of `rows` fixed-input rows of T tokens and these chunks (of `computed`, their commands): the
        replay of a captured shape where one fits (`bucket`: the chunks' prompt-token bucket beside those rows,
        `_prompt_bucket`; 0: none), the chunks padded into the fixed prompt inputs, else eager."""
        shape = StepShape(rows, T, bucket)
        if (bucket or not chunks) and self.graphs is not None and self.graphs.captured(shape):
            if chunks:  # a graph's prefill starts each fresh prompt from a zeroed state; the eager one resets them
                for c in chunks:
                    if c.start == 0:
                        self.state.reset_slot(c.slot)
                self.prefill_inputs.fill(chunks, bucket, *(self.speculation.head_inputs(computed)
                                                           if self.speculation else ()))
            return self.graphs(shape)
        prompts = None
        if chunks:
            prompts = PromptChunks.build(chunks, self.state.page_size, self.state.trash_page, self.device)
        head = self.speculation.head_tensors(computed) if prompts is not None and self.speculation else None
        return self._forward(rows, T, prompts, head, keep_prompt_hidden)

    def _prompt_bucket(self, rows: int, chunks: list[PrefillChunk]) -> int:
        """The smallest captured prompt-token bucket that the chunks fit beside `rows` rows, or 0."""
        if self.graphs is None or self.prefill_inputs is None:
            return 0
        return next((s.prompt_tokens for s in self.graphs.shapes if s.rows == rows and s.tokens_per_row == 1
                     and s.prompt_tokens and self.prefill_inputs.fits(chunks, s.prompt_tokens)), 0)

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
        self.slots.before_step(cmd, self.speculation.roll_back if self.speculation else None)
        if self.sampling:
            for p in cmd.prefill:
                self.sampling.start(p.slot, p.sampling, p.prefix_ids + p.token_ids if p.prefix_ids else p.token_ids)

        decode_draw = prefill_draw = speculation = prompt_scores = None
        n = len(cmd.decode_tokens)
        index_offsets = None
        if n:
            self.inputs.fill(cmd.decode_tokens, cmd.decode_positions, cmd.bucket)
            if self.speculation:
                self.speculation.fill(cmd)
            if self.sampling:
                # Before this step reads them: a row the step before drew may have been flagged (the logits it is
                # drawn again from are also the graph's, which this step overwrites).
                self.sampling.settle()
            index_offsets = self._carry_in(cmd)
        # A prompt a snapshot holds whole (`PrefixCache.match`) has no tokens to compute: its first token's logits
        # come from the hidden state restored with the snapshot.
        computed = [p for p in cmd.prefill if p.token_ids]
        chunks = [PrefillChunk(p.token_ids, p.start, p.slot, p.pages) for p in computed]
        # A chunk whose prompt's log-probs are asked for runs eagerly (a graph keeps each chunk's last logits only).
        scored = any(p.prompt_logprobs is not None for p in computed)
        # One forward for the rows and the chunks where the step can (never with drafts; on a device with graphs,
        # only where a captured shape fits: eager, its launches would cost more than the second weight pass it
        # saves); else the rows' forward, then the chunks'.
        fusable = self.fuse_mixed_steps and bool(n and chunks) and not cmd.speculate and not scored
        bucket = self._prompt_bucket(cmd.bucket, chunks) if fusable else 0
        fused = fusable and (self.graphs is None or bucket > 0)
        if n and not fused:
            out = self._run(cmd.bucket, self.speculation.k + 1 if cmd.speculate else 1, [], [], 0)
            if cmd.speculate:
                decode_draw, speculation = self.speculation.draw(cmd, out, self.sampling, index_offsets)
            else:
                decode_draw = self._draw_decode(cmd, out.row_logits, index_offsets)

        self.slots.before_prompts(cmd)
        if cmd.prefill:
            prefill_logits = None  # at each computed chunk's last token
            if chunks:
                rows = cmd.bucket if fused else 0
                bucket = 0 if scored else bucket if fused else self._prompt_bucket(rows, chunks)
                out = self._run(rows, 1, chunks, computed, bucket, keep_prompt_hidden=scored)
                prefill_logits = out.chunk_logits  # row i is chunk i's (a padded step's padding after)
                if scored and self.sampling:
                    prompt_scores = self._score_prompts(cmd, out.prompt_hidden)
                if fused:
                    decode_draw = self._draw_decode(cmd, out.row_logits, index_offsets)
            self.slots.after_prompts(cmd)
            resumed = [p.slot for p in cmd.prefill if not p.token_ids]
            if resumed and self.speculation:
                self.speculation.start_from_restored(resumed)
            last = [i for i, p in enumerate(cmd.prefill) if p.last]
            if self.sampling and last:
                # A prompt's last chunk draws the request's first token (token index 0).
                setup = self.sampling.prepare([cmd.prefill[i].slot for i in last], [0] * len(last), cmd.step_seed)
                prefill_draw = self.sampling.draw(self._first_token_logits(cmd, last, prefill_logits), setup)
        if clock is not None:
            clock.stop()
        if queued:
            on_launched()
        return LaunchedStep(self, cmd, decode_draw, prefill_draw, speculation, clock, prompt_scores) \
            if self.sampling else None

    def _score_prompts(self, cmd: StepCommand, hidden: torch.Tensor) -> list:
        """Per prefill command: None, or (the log-probs of its scored prompt tokens [S], (their top log-probs [S, k],
        the ids of those) or None), on the device. `hidden`: every computed chunk's tokens, in command order."""
        scores, offset = [], 0
        for p in cmd.prefill:
            if p.prompt_logprobs is None or not p.scored_ids:
                scores.append(None)
            else:
                ids = upload({"ids": p.scored_ids}, torch.long, self.device)["ids"]
                chosen, top_lp, top_ids = [], [], []
                # A slice of positions at a time: a whole chunk's fp32 log-probs over the vocabulary would take
                # gigabytes (2048 tokens x 248k).
                for a in range(0, len(p.scored_ids), SCORED_POSITIONS):
                    b = min(a + SCORED_POSITIONS, len(p.scored_ids))
                    logprobs = torch.log_softmax(self.model.logits(hidden[offset + a : offset + b]).float(), dim=-1)
                    chosen.append(logprobs.gather(1, ids[a:b, None])[:, 0])
                    if p.prompt_logprobs:
                        top = logprobs.topk(p.prompt_logprobs, dim=-1)
                        top_lp.append(top.values)
                        top_ids.append(top.indices)
                top = (torch.cat(top_lp), torch.cat(top_ids)) if p.prompt_logprobs else None
                scores.append((torch.cat(chosen), top))
            offset += len(p.token_ids)
        return scores

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
        more = Speculator.kept_tokens(decode, drawn, step.speculation) if step.speculation else []
        clock = step.clock
        scored = [None] * len(cmd.prefill)
        for i, (p, score) in enumerate(zip(cmd.prefill, step.prompt_scores or ())):
            if score is not None:
                chosen, top = score
                tops = [list(zip(ids, lps)) for lps, ids in zip(top[0].tolist(), top[1].tolist())] \
                    if top is not None else [None] * len(p.scored_ids)
                scored[i] = [SampledToken(t, lp, top_r)
                             for t, lp, top_r in zip(p.scored_ids, chosen.tolist(), tops)]
        return StepResult(decode, prefill, more, clock.seconds() if clock else 0.0,
                          clock.launch_seconds if clock else 0.0, scored)


class LaunchedStep:
    """Rank 0's step, queued on the device; `finish()` waits for its tokens (the worker's deferred result)."""

    def __init__(self, runtime: RankRuntime, cmd: StepCommand, decode, prefill, speculation=None,
                 clock: "StepClock | None" = None, prompt_scores: list | None = None) -> None:
        self.runtime, self.cmd, self.decode, self.prefill = runtime, cmd, decode, prefill
        self.speculation: KeptDrafts | None = speculation
        self.clock = clock
        self.prompt_scores = prompt_scores  # `RankRuntime._score_prompts`: read by `finish`

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
