"""The step loop: the live requests, and the one task that plans each step (the scheduler), hands it to the ranks
(`Replica.start_step`), and routes its tokens back into the requests' outputs (`outputs.Request`), with an overlap
depth of 0 or 1. `AsyncEngine` makes requests and reads their streams; everything a step does on the host is here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from deltaserve.devices.commands import (KEPT_ON_DEVICE, UNKNOWN_TOKEN, PrefillCommand, PromoteSlot, RetireSlot,
                                         StepCommand, StepResult)
from deltaserve.devices.replica import Replica
from deltaserve.devices.worker import ReplicaPoisoned

from .metrics import EngineMetrics
from .outputs import Request, TokenLogprob
from .scheduler import Scheduler, StepPlan
from .speculation import SpeculationOverride, SpeculationPolicy

log = logging.getLogger(__name__)
# One line per step at DEBUG (`deltaserve serve --log-steps`): what it carried, its time, how long rank 0's host took
# to launch it and the devices waited for the host to hand it over, for reading an ITL tail or a host-bound loop.
steps_log = logging.getLogger("deltaserve.steps")

# Streams few enough that the loop lets them write a step's tokens before the next hand-off (about 50 us each).
FEW_STREAMS = 8


@dataclass(frozen=True)
class StepRecord:
    """One step as the loop saw it, given to each of `StepLoop.observers` once its tokens are routed."""

    plan: StepPlan
    seconds: float  # from its hand-over (or the end of the step before, if later) to its tokens on the host
    device_seconds: float  # its time on the devices where the ranks measured it, else `seconds`
    idle: float | None  # how long the devices had nothing to run before it (None: no step ran just before)
    result: StepResult


class StepLoop:
    """The live requests (`requests`, `add`, `finish`) and the task that serves them (`start`, `close`). A
    request that a token, a stop string or its length ends is finished here; `observers` see every step."""

    def __init__(self, replica: Replica, scheduler: Scheduler, metrics: EngineMetrics, speculation: SpeculationPolicy,
                 override: SpeculationOverride, overlap: bool, seed: int | None) -> None:
        self.replica, self.scheduler, self.metrics = replica, scheduler, metrics
        self.speculation, self.override = speculation, override
        self.speculative_tokens = speculation.k
        self.overlap = overlap
        self.requests: dict[str, Request] = {}
        self.observers: list[Callable[[StepRecord], None]] = []
        self.task: asyncio.Task | None = None
        self.dead: str | None = None  # why the loop stopped serving, once it has
        self.died = asyncio.Event()
        self._wakeup = asyncio.Event()
        self._closing = False
        self._seq = itertools.count(1)
        self._rng = random.Random(seed)
        # Each plan's KV events (the prefix cache's resumable prefixes) go here: a router's feed; None: not kept
        self.publish_events: Callable[[list], None] | None = None

    # Requests -------------------------------------------------------------------------------------------------------
    def add(self, req: Request, keys: list | None) -> None:
        """Queue a request (its prompt already checked); `keys`: its prompt's prefix keys, where made already."""
        self.scheduler.enqueue(req, keys)
        if req.prompt_logprobs is not None:  # every prompt token is computed: no cached prefix stands in for one
            req.cacheable = False
        self.requests[req.request_id] = req

    def add_when_compiled(self, req: Request, keys: list | None, compiling: asyncio.Future,
                          matcher: Callable[[], object]) -> None:
        """`add` once the request's constraint is compiled (off the loop), with its own `matcher()`: live meanwhile,
        so an abort ends it; a constraint that does not compile ends it with the error."""
        self.requests[req.request_id] = req

        def compiled(f: asyncio.Future) -> None:
            if req.finished:
                return
            error = None if f.cancelled() else f.exception()
            if f.cancelled() or error is not None:
                self.finish(req, "error", error=str(error) if error else "the constraint's compile was cancelled")
                return
            req.sampling = replace(req.sampling, grammar=matcher())
            try:
                self.add(req, keys)
            except ValueError as exc:  # what `generate` checks but could not yet (a request id taken meanwhile)
                self.finish(req, "error", error=str(exc))
                return
            self.wake()

        compiling.add_done_callback(compiled)

    def wake(self) -> None:
        """New work: the loop plans a step if it was idle."""
        self._wakeup.set()

    def finish(self, req: Request, reason: str, delta_ids=(), delta_text: str = "", error: str | None = None):
        """The request's last output; its slot and pages are freed at the next plan."""
        req.finished = True
        self.requests.pop(req.request_id, None)
        self.scheduler.finish(req.request_id)
        tail = req.flush_text()
        self.metrics.finished.labels(reason).inc()
        self.metrics.e2e.observe(time.perf_counter() - req.arrival)
        req.queue.put_nowait(req.output(delta_ids, delta_text + tail, reason, error))
        self._wakeup.set()

    def finish_all(self, reason: str, error: str | None = None) -> None:
        for req in list(self.requests.values()):
            self.finish(req, reason, error=error)

    # Lifecycle ------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._serve(), name="deltaserve-step-loop")

    async def close(self, timeout_s: float) -> None:
        """The steps in flight end (their tokens reach their streams), then the loop; every live request is left
        for the caller to end."""
        self._closing = True
        self._wakeup.set()
        if self.task is not None:
            await asyncio.wait([self.task], timeout=timeout_s)
            self.task = None

    async def _serve(self) -> None:
        """The steps until close. Whatever ends them early (a rank's failure, a host-side bug while planning or
        applying a step, a cancellation) poisons the replica and ends every live request with an error: no
        request is left waiting on a loop that is gone."""
        try:
            await self._run()
        except ReplicaPoisoned as exc:
            self._poison(str(exc))
        except asyncio.CancelledError:  # the ranks may be anywhere in a step
            self.replica.group.poison(RuntimeError("the engine's step loop was cancelled"))
            self._poison("the engine's step loop was cancelled")
            raise
        except Exception as exc:
            self.replica.group.poison(exc)  # logs it, with its traceback
            self._poison(f"step failed: {exc!r}")

    def _poison(self, message: str) -> None:
        self.dead = message
        self.metrics.healthy.set(0)
        log.error("the engine stopped serving (the cause is logged above); failing %d live requests",
                  len(self.requests))
        self.finish_all("error", error=message)
        self.died.set()

    # The loop -------------------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        """Plan a step, hand it to the ranks, route its tokens, until close. With overlap scheduling
        (`async_scheduling`, the default) the loop runs one step ahead: step k+1 is planned and handed over as soon
        as step k is, before k's tokens reach the host (rank 0 takes them on the device, and launches k+1 before
        it reads k's), so the devices wait neither for the loop's routing, stop checks and outputs nor for the
        tokens' trip to the host. A request that a token or stop string ends at step k then has a row in step k+1
        too: its tokens are drawn and dropped. max_tokens needs no tokens: the scheduler retires at it (after a
        speculative step, once it knows the count: one step late at most). A speculative step k's kept counts stay
        on the device too, where step k+1's rows take their positions, roll-backs and token indices from them
        (`StepCommand.verify_accepted`). Without overlap each step's tokens are routed before the next is planned,
        and their outputs made (stream consumers and HTTP handlers woken) while that next step runs."""
        ahead = 1 if self.overlap else 0  # steps handed over beyond the one whose tokens are awaited
        sched = self.scheduler
        in_flight: deque = deque()  # (plan, command, step, handed over at), oldest first
        later: list = []  # tokens routed whose outputs are made once the next step is handed over (no overlap)
        last_done = None  # when the last step ended (None: the devices were idle, no step ran just before)

        async def finish() -> None:
            """The oldest step's tokens: awaited, observed, counted and routed."""
            nonlocal last_done
            plan, cmd, step, handed = in_flight.popleft()
            result = await step
            now = time.perf_counter()
            started = handed if last_done is None else max(handed, last_done)  # a step handed early starts later
            idle = None if last_done is None else max(handed - last_done, 0.0)
            device = result.device_seconds if result.device_seconds > 0 else now - started
            record = StepRecord(plan, now - started, device, idle, result)
            self._observe(record)
            last_done = now
            self._count_kept(plan, cmd, result)
            later.extend(self._apply(plan, result))
            if ahead:  # the next step is with the ranks already: the outputs go out at once
                self._emit(later)
            for observer in self.observers:
                observer(record)
            if ahead:
                firsts = sum(work.last for work in plan.prefill)
                if in_flight and 0 < firsts and firsts + len(plan.decode_ids) <= FEW_STREAMS:
                    # A first token: its stream writes it now, while the step handed over runs, instead of after
                    # the next hand-over (rank 0's launch of it holds the loop for up to a millisecond). Only for
                    # a few streams: many streams' writes first would delay the hand-over past that step's end.
                    await asyncio.sleep(0)

        try:
            while not self._closing:
                if in_flight and self._needs_tokens_first(in_flight[-1][0]):  # before the plan is made
                    await finish()
                plan = sched.schedule() if sched.has_work else None
                if plan is not None:
                    self._decide(plan)
                    if self.publish_events is not None:
                        self.publish_events(sched.cache.resumable.take())
                self.metrics.show(self.scheduler)
                handing_over = plan is not None and not plan.empty
                if not handing_over and not in_flight:
                    self._emit(later)
                    last_done = None
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                if handing_over:
                    cmd = self._command(plan)
                    handed = time.perf_counter()
                    # The ranks get the command before anything else runs.
                    in_flight.append((plan, cmd, self.replica.start_step(cmd, overlapped=ahead > 0), handed))
                    self._count(plan, cmd)
                self._emit(later)  # the step before's outputs, while this one runs
                while in_flight and (len(in_flight) > ahead or not handing_over):
                    await finish()
            while in_flight:  # closing: the last steps' tokens come before `close` ends the requests
                await finish()
            self._emit(later)
        except BaseException:
            self._emit(later)  # the tokens drawn before the failure still reach their streams
            raise
        finally:  # after a failure, a step handed over may never be awaited (closing a finished one does nothing)
            for _, _, step, _ in in_flight:
                step.close()

    def _needs_tokens_first(self, before: StepPlan) -> bool:
        """Whether the next plan waits for the tokens of the step `before` it (in flight), and is made after them.
        Where that step speculated: for a row still short of its min_tokens (its draw bars the stop ids by its
        token's index, which the host must then know); and, among few rows, for one that step may take to its
        max_tokens (else the next step runs for it in vain, and a request arriving meanwhile waits for that step;
        H100, 4B c1 with k 4: TTFT 15.4 ms against 12.1 plain, before this wait)."""
        if not before.speculate:
            return False
        few = len(before.decode_ids) <= FEW_STREAMS
        for rid in before.decode_ids:
            req = self.requests.get(rid)
            if req is not None and (req.params.min_tokens > req.generated or
                                    few and req.max_tokens - req.generated < self.speculative_tokens + 1):
                return True
        return False

    def _observe(self, step: StepRecord) -> None:
        """What the loop learns from a step: the metrics, the step budget's times and the speculation policy's."""
        plan, result = step.plan, step.result
        prompt_tokens = sum(w.length for w in plan.prefill)
        self.metrics.step_seconds.observe(step.seconds)
        # The budget learns from the device's time: with overlap, the host sees the steps' ends in bursts.
        self.scheduler.step_budget.observe(plan.bucket, prompt_tokens, step.device_seconds)
        if steps_log.isEnabledFor(logging.DEBUG):
            steps_log.debug("%d decode rows (bucket %d%s), %d prompt tokens in %d chunks (budget %d): %.2f ms on "
                            "the device, %.2f ms seen by the host, launched in %.2f ms%s", len(plan.decode_ids),
                            plan.bucket, ", speculative" if plan.speculate else "", prompt_tokens, len(plan.prefill),
                            plan.prompt_budget, step.device_seconds * 1e3, step.seconds * 1e3,
                            result.launch_seconds * 1e3,
                            "" if step.idle is None else f", devices idle {step.idle * 1e3:.2f} ms before it")
        if self.speculative_tokens and plan.decode_ids and not plan.prefill:
            # What the step cost the devices' timeline: its own time and the host's wait before it, which only a
            # speculative step (never overlapped) exposes; the host's view of an overlapped step is bursty.
            rows = len(plan.decode_ids)
            self.speculation.observe(plan.bucket, plan.speculate, step.device_seconds + (step.idle or 0.0),
                                     (rows + sum(map(len, result.decode_more))) / rows)

    def _decide(self, plan: StepPlan) -> None:
        """Whether the plan's decode rows speculate (`runtime.speculation`), before its command is made. A step
        carrying prompt chunks does not where it fuses them with its decode rows: one forward that reads the
        weights once (a speculative step does not)."""
        plan.speculate = bool(self.speculative_tokens and plan.decode_ids) and not (
            plan.prefill and self.replica.spec.fused_mixed_steps) and self.speculation.decide(plan.bucket)

    def _command(self, plan: StepPlan) -> StepCommand:
        reqs = self.requests
        cmd = StepCommand(
            compactions=[RetireSlot(c.hole, c.moved_from) for c in plan.compactions],
            released_prefill_slots=plan.released_prefill_slots,
            promotions=[PromoteSlot(p.from_slot, p.to_slot, p.pages) for p in plan.promotions],
            bucket=plan.bucket, step_seed=self._rng.getrandbits(62), seq=next(self._seq),
            restore_snapshots=[(c.snapshot, c.slot) for c in plan.restores], copy_pages=list(plan.page_copies),
            save_snapshots=[(c.slot, c.snapshot) for c in plan.snapshots],
            finish_snapshots=[(c.slot, c.snapshot, c.keep) for c in plan.finish_snapshots],
        )
        # Requests that finished before this plan were retired by it, so every row here is live. The scheduler
        # counts a step's tokens when the step is handed over (one a row for a speculative step, until its counts
        # are back); with overlap the last of them may still be on their way, and the ranks fill them in.
        for rid in plan.decode_ids:
            req = reqs[rid]
            n = req.generated
            cmd.decode_tokens.append(req.output_ids[-1] if len(req.output_ids) == n else UNKNOWN_TOKEN)
            cmd.decode_positions.append(len(req.prompt_ids) + n - 1)
            cmd.decode_token_index.append(n)
        if self.speculative_tokens and plan.decode_ids:
            cmd.speculate = plan.speculate
            cmd.verify_accepted = [KEPT_ON_DEVICE if reqs[rid].kept_pending else reqs[rid].kept
                                   for rid in plan.decode_ids]
            if self.override.propose is not None:
                cmd.draft_tokens = [self._host_drafts(reqs[rid]) for rid in plan.decode_ids]
        for w in plan.prefill:
            req = reqs[w.request_id]
            end = w.start + w.length
            cmd.prefill.append(PrefillCommand(
                req.prompt_ids[w.start : end], w.start, w.slot, w.pages, w.last,
                sampling=req.sampling if w.first else None,
                prefix_ids=req.prompt_ids[: w.start] if w.first and req.sampling.needs_counts else [],
                next_token=req.prompt_ids[end] if end < len(req.prompt_ids) else 0,
                prompt_logprobs=req.params.prompt_logprobs,
                scored_ids=req.prompt_ids[w.start + 1 : end + 1] if req.prompt_logprobs is not None else [],
            ))
            if w.first:
                self.metrics.count_prefix(len(req.prompt_ids), w.start)
                req.prefill_start = time.perf_counter()
                self.metrics.queue_time.observe(req.prefill_start - req.arrival)
        return cmd

    def _host_drafts(self, req: Request) -> list[list[int]]:
        """The test drafter's drafts for a row (`StepCommand.draft_tokens`). Tokens still on their way stand in
        its output as UNKNOWN_TOKEN; a row whose speculative step is in flight gets drafts for each count the step
        may have kept (1 .. k + 1)."""
        k, drafter = self.speculative_tokens, self.override.propose
        unseen = req.generated - len(req.output_ids)
        counts = range(1, k + 2) if req.kept_pending else [1]
        return [list(drafter(req.prompt_ids, req.output_ids + [UNKNOWN_TOKEN] * (unseen + kept - 1), k))
                for kept in counts]

    def _count(self, plan: StepPlan, cmd: StepCommand) -> None:
        """The scheduler's bookkeeping of a step handed over: what the next plan depends on, none of it the tokens
        (overlap scheduling counts before they are back); a speculative step's rows count one token each until
        `_count_kept`."""
        self.scheduler.on_prefill_done(plan.prefill)
        self.scheduler.on_decode_done(plan.decode_ids, cmd.seq if plan.speculate else 0)
        self.metrics.count_tokens(sum(w.length for w in plan.prefill),
                                  (0 if plan.speculate else len(plan.decode_ids)) + sum(w.last for w in plan.prefill))

    def _count_kept(self, plan: StepPlan, cmd: StepCommand, result: StepResult) -> None:
        """A speculative step's tokens are back: how many each row kept."""
        if not plan.speculate:
            return
        counts = [1 + len(more) for more in result.decode_more]
        self.scheduler.on_drafts_kept(plan.decode_ids, counts, cmd.seq)
        # The metrics count live requests' rows: not the step a request that ended before it ran in vain.
        self.metrics.count_kept([c for rid, c in zip(plan.decode_ids, counts) if rid in self.requests],
                                self.speculative_tokens)

    # Tokens into outputs --------------------------------------------------------------------------------------------
    def _apply(self, plan: StepPlan, result: StepResult) -> list:
        """Each token appended, and every request that ends here finished (stop token, stop string, length).
        Returns (request, token, seconds since its last token or None) for the tokens whose outputs `_emit` makes
        later. A token for a request that has gone (it stopped a step earlier, with overlap) is dropped."""
        now = time.perf_counter()
        later = []
        for w, scored in zip(plan.prefill, result.prompt_logprobs):
            req = self.requests.get(w.request_id)
            if scored and req is not None:
                req.prompt_logprobs += [TokenLogprob(s.token, s.logprob, s.top) for s in scored]
        for w, sampled in zip(plan.prefill, result.prefill):
            if sampled is not None and w.request_id in self.requests:
                self._on_token(self.requests[w.request_id], sampled, now, later)
        more = result.decode_more or [[]] * len(result.decode)
        for rid, sampled, extra in zip(plan.decode_ids, result.decode, more):
            req = self.requests.get(rid)
            if req is None:
                continue
            if not extra:
                self._on_token(req, sampled, now, later)
                continue
            # A speculative row's kept tokens: each one's output is made now, in order, until one ends the request,
            # so the final output comes after every token before it (deferring some would queue them behind it).
            for token in [sampled, *extra]:
                if req.finished:
                    break
                self._on_token(req, token, now, None)
        return later

    def _on_token(self, req: Request, sampled, now: float, later: list | None) -> None:
        """One token appended; its output is made now when it may end the request or `later` is None, else left
        in `later` for `_emit`."""
        since_last = None if req.last_token_time is None else now - req.last_token_time
        req.last_token_time = now
        reason = req.take(sampled)
        if reason is not None:
            self.metrics.observe_token(req.arrival, req.prefill_start, since_last, now)
            self.finish(req, reason)
        elif later is None or req.text_decides:
            self.metrics.observe_token(req.arrival, req.prefill_start, since_last, now)
            self._detokenize(req, sampled.token)
        else:
            later.append((req, sampled.token, since_last))

    def _emit(self, later: list) -> None:
        """The outputs `_apply` left for later: detokenised, latency recorded, queued to their streams; `later` is
        emptied."""
        for req, token, since_last in later:
            if req.finished:  # aborted since: its stream has had its last output
                continue
            self.metrics.observe_token(req.arrival, req.prefill_start, since_last, req.last_token_time)
            self._detokenize(req, token)
        later.clear()

    def _detokenize(self, req: Request, token: int) -> None:
        """The token's text, then the request's output: a stop string or the length ends the request."""
        delta, reason = req.detokenize(token)
        if reason is not None:
            self.finish(req, reason, [token], delta)
        else:
            req.queue.put_nowait(req.output([token], delta))
