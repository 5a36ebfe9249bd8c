"""The asyncio engine: requests in, scheduler ticks, step commands to the device ranks, tokens and text out.

    async with AsyncEngine(EngineArgs(model=DIR)) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text)

One task (the step loop) owns the scheduler; `generate` only enqueues a request and reads its output queue.
Breaking out of the `async for`, or cancelling the consuming task, aborts the request and frees its slot and
pages at the next step.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import itertools
import logging
import os
import random
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from deltaserve.devices.commands import (KEPT_ON_DEVICE, UNKNOWN_TOKEN, PrefillCommand, PromoteSlot, RetireSlot,
                                         RowSampling, StepCommand, StepResult, positions_past_end)
from deltaserve.devices.replica import Replica, ReplicaSpec
from deltaserve.devices.worker import ReplicaPoisoned
from deltaserve.model.config import load_model_config
from deltaserve.model.synthetic import demo_checkpoint
from deltaserve.model.weights import check_checkpoint
from deltaserve.progress import progress as show_progress

from deltaserve.args import EngineArgs
from .metrics import EngineMetrics
from .params import SamplingParams, all_ints
from .prefix_cache import PrefixCache
from .scheduler import CapacityError, Scheduler, default_buckets
from .speculation import SpeculationOverride, SpeculationPolicy
from .step_budget import StepBudget
from .outputs import Request, RequestOutput
from .text import IncrementalDetokenizer, PromptTooLong, StopMatcher, TextTokenizer

log = logging.getLogger(__name__)
# One line per step at DEBUG (`deltaserve serve --log-steps`): what it carried, its time, how long rank 0's host took
# to launch it and the devices waited for the host to hand it over, for reading an ITL tail or a host-bound loop.
steps_log = logging.getLogger("deltaserve.steps")

# Streams few enough that the loop lets them write a step's tokens before the next hand-off (about 50 us each).
FEW_STREAMS = 8
_INLINE_TOKENIZE_CHARS = 16_384  # shorter texts tokenise in well under a millisecond: not worth a thread hop


class _StartupObjects:
    """The objects alive once an engine is ready (modules, weights, graphs, imports: a few hundred thousand) last as
    long as it does, yet every full garbage collection walks them all, ~200 ms on two slow cores, on whatever thread
    triggered it: the event loop stalls for that long mid-stream. Freezing them (`gc.freeze`) leaves the collector
    only the objects made since. The last engine to close thaws them, so an embedding process that closes its
    engines gets its later garbage collected as before."""

    engines = 0

    @classmethod
    def freeze(cls) -> None:
        # No full collection first: it costs as much as the pauses this saves, once per engine. The little cyclic
        # garbage frozen with the rest (the CUDA backend collects before it plans memory) waits for the thaw.
        gc.freeze()
        cls.engines += 1
        log.debug("froze %d objects out of the garbage collector's full collections", gc.get_freeze_count())

    @classmethod
    def thaw(cls) -> None:
        cls.engines -= 1
        if cls.engines == 0:
            gc.unfreeze()


class EngineDeadError(RuntimeError):
    """The engine was poisoned by a device failure, or is shut down."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; try again later."""


class AsyncEngine:
    def __init__(self, args: EngineArgs, *, speculation_override: SpeculationOverride | None = None) -> None:
        """`speculation_override`: tests' and benchmarks' drafts or acceptance (`SpeculationOverride`)."""
        self.args = args
        self.override = speculation_override or SpeculationOverride()
        self.metrics = EngineMetrics()
        self.replica: Replica | None = None
        self.scheduler: Scheduler | None = None
        self.requests: dict[str, Request] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._closing = False
        self._draining = False
        self._dead: str | None = None
        self.died = asyncio.Event()  # set when the replica is poisoned (the cause is logged once, by `_poison`)
        self._stats_task: asyncio.Task | None = None
        self._frozen = False  # whether this engine counts in `_StartupObjects`
        self._ids = itertools.count()
        self._steps = itertools.count(1)
        self._rng = random.Random(args.seed)
        self._text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="deltaserve-text")

    # Lifecycle ------------------------------------------------------------------------------------------------------
    async def __aenter__(self) -> "AsyncEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        started = time.perf_counter()
        if self.args.model is None:
            self.args = self.args.replace(model=demo_checkpoint())
        args = self.args
        self.cfg = load_model_config(args.model)
        self.tokenizer = TextTokenizer(args.model)
        if args.load_format == "safetensors":
            check_checkpoint(args.model)  # a bad file named here, not from inside a rank
        if self.tokenizer.vocab_size > self.cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} ids but the model only {self.cfg.vocab_size}"
            )
        if args.max_model_len is not None and args.max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the checkpoint's max_position_embeddings "
                             f"({self.cfg.max_position_embeddings})")
        self.max_model_len = args.max_model_len or min(self.cfg.max_position_embeddings, 32768)
        self.model_name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        buckets = sorted(args.buckets) if args.buckets else default_buckets(args.max_batch)
        self.speculative_tokens = args.speculative_tokens
        self.override.check(args.speculative_tokens)
        self.speculation = SpeculationPolicy(args.speculative_tokens, args.speculative_max_batch,
                                             args.speculative_adaptive)
        if self.speculative_tokens:
            if self.cfg.mtp_num_hidden_layers != 1:
                raise ValueError(f"speculative_tokens needs the checkpoint's one-layer MTP head (Qwen3.5's); its "
                                 f"config has mtp_num_hidden_layers {self.cfg.mtp_num_hidden_layers}")
            if args.speculative_draft_vocab > self.cfg.vocab_size:
                raise ValueError(f"speculative_draft_vocab {args.speculative_draft_vocab} exceeds the vocabulary "
                                 f"({self.cfg.vocab_size} tokens)")
            log.info("speculative decoding: %d tokens drafted a step by the MTP head (%s)", self.speculative_tokens,
                     "where it is measured to pay" if args.speculative_adaptive else "every step")
        elif args.speculative_draft_vocab:
            log.warning("speculative_draft_vocab is set without speculative_tokens: it does nothing")
        fused = args.fused_mixed_steps
        if fused is None:  # where its steps are graphed
            fused = args.device == "cuda" and args.cuda_graph and args.prefill_graph_tokens > 0
        spec = ReplicaSpec(args, self.cfg, max_model_len=self.max_model_len, buckets=buckets,
                           fused_mixed_steps=fused, speculative_acceptance=self.override.acceptance)
        self.replica = Replica(spec)
        try:
            await self.replica.start()
        except BaseException:
            await self.replica.close()
            raise
        plan = self.replica.plan
        self.scheduler = Scheduler(
            num_pages=plan.num_pages, page_size=plan.page_size, max_batch=plan.max_batch,
            max_prefill_slots=plan.prefill_slots, prefill_token_budget=self.replica.prefill_token_budget,
            max_model_len=self.max_model_len, buckets=self.replica.buckets,
            step_budget=self._step_budget(),
            prefix_cache=PrefixCache(plan.num_pages, plan.page_size, plan.snapshots, args.enable_prefix_caching),
            lookahead=positions_past_end(self.speculative_tokens), prefill_graph_sizes=self.replica.prefill_buckets,
            mixed_graph_sizes=self.replica.mixed_token_buckets,
        )
        self._loop_task = asyncio.get_running_loop().create_task(self._step_loop(), name="deltaserve-step-loop")
        if args.warmup if args.warmup is not None else args.device == "cuda":
            await self._warm_up()
            self.speculation.reset()
        if args.stats_interval_s > 0:
            self._stats_task = asyncio.get_running_loop().create_task(self._log_stats(args.stats_interval_s))
        _StartupObjects.freeze()
        self._frozen = True
        log.info("engine ready in %.1f s: model %s on %s (tp=%d, %s), max_batch %d, max_model_len %d",
                 time.perf_counter() - started, self.model_name, args.device, args.tp, args.dtype, plan.max_batch,
                 self.max_model_len)

    def _step_budget(self) -> StepBudget:
        return StepBudget(self.replica.prefill_token_budget, self.args.step_latency_ratio)

    async def _warm_up(self) -> None:
        """Serve requests that reach every shape class and sampler path the server will meet, so each Triton
        kernel is compiled (or loaded from the cache, `devices.backend.kernel_cache_dir`) before the first
        client waits on it. Token counts: 1, a multiple of 16, others (Triton specialises on both), prompts of
        doubling lengths (the row-wise kernels' rows a program, `kernels.launch.rows_per_program`, double with
        them), prompts packed into one step, a prompt chunked across steps; decode at several batch sizes; greedy,
        top-k, top-p alone, penalties, min_tokens, log-probs; then the whole batch decoding, for the decode steps'
        times."""
        started = time.perf_counter()
        longest = self.max_model_len - 4
        chunked = min(self.replica.prefill_token_budget + 19, longest)
        sampled = SamplingParams(temperature=1.0, top_k=20, top_p=0.8, max_tokens=3, ignore_eos=True)
        nucleus = SamplingParams(temperature=0.7, top_k=0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                                 repetition_penalty=1.1, min_tokens=2, logprobs=5, max_tokens=3, ignore_eos=True)
        greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        longer = SamplingParams(temperature=0.0, max_tokens=max(1, min(24, self.max_model_len - 2)), ignore_eos=True)
        waves = [
            [([1], greedy)], [([1] * 16, sampled)], [([1] * 37, nucleus)], [([1] * chunked, greedy)],
            *[[([1] * n, greedy)] for n in (64, 128, 256, 512, 1024) if n < chunked],
            [([1] * n, greedy) for n in (5, 16, 29, 64)],  # prompts packed into one prefill step
            [([1] * 3, sampled if i % 2 else nucleus) for i in range(min(8, self.replica.plan.max_batch))],
            # The whole batch decoding: the step budget's decode times up to the largest bucket (`seeded`).
            [([1] * 2, longer) for _ in range(self.replica.plan.max_batch)],
        ]
        bar = show_progress(total=sum(map(len, waves)), desc="warm-up requests", unit="req")

        async def one(ids, params):
            async for _ in self.generate(ids, params):
                pass
            bar.update(1)

        for wave in waves:
            await asyncio.gather(*[one(ids, params) for ids, params in wave if len(ids) <= longest])
        bar.close()
        if self._dead is not None:
            raise RuntimeError(f"the warm-up requests failed: {self._dead}")
        self.metrics = EngineMetrics()  # what /metrics reports starts with the first real request
        self.scheduler.step_budget = self.scheduler.step_budget.seeded()  # its chunks' times include compiles
        self.scheduler.cache.clear()  # and its prompts are nobody's
        log.info("warm-up: %d requests in %.1f s (Triton kernels compiled or loaded from the cache)",
                 sum(map(len, waves)), time.perf_counter() - started)

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting requests (new ones get EngineDeadError), let the live ones run for up to `timeout_s`, then
        abort the rest: each stream's last output has finish_reason "abort"."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self.requests and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if self.requests:
            log.info("aborting %d requests still running after %.1f s", len(self.requests), timeout_s)
        for req in list(self.requests.values()):
            self._finish(req, "abort")

    async def close(self) -> None:
        self._closing = True
        self._wakeup.set()
        if self._stats_task is not None:
            self._stats_task.cancel()
            self._stats_task = None
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task], timeout=self.args.step_timeout_s)
            self._loop_task = None
        for req in list(self.requests.values()):
            self._finish(req, "abort", error="the engine shut down")
        if self.replica is not None:
            await self.replica.close()
            self.replica = None
        self._text_pool.shutdown(wait=False, cancel_futures=True)
        if self._frozen:
            self._frozen = False
            _StartupObjects.thaw()

    @property
    def shutting_down(self) -> bool:
        return self._closing or self._draining

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._loop_task is not None and not self.shutting_down

    # Requests -------------------------------------------------------------------------------------------------------
    def resolve_params(self, prompt_len: int, params: SamplingParams | None) -> SamplingParams:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # again: its fields may have been set after it was made
        params.check_model(self.cfg.vocab_size)
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt is {prompt_len} tokens; the context length is {self.max_model_len}")
        params = params.with_defaults(self.cfg.generation, self.max_model_len - prompt_len)
        if params.top_k >= self.cfg.vocab_size:  # keeps every token: the same as off, and bounded on the ranks
            params = replace(params, top_k=0)
        return params

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, checked against the vocabulary and the context (PromptTooLong: a ValueError)."""
        limit = self.max_model_len - 1  # at least one token must be left to generate
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, limit)
        elif isinstance(prompt, list) and all_ints(prompt):
            ids = list(prompt)
            if ids and not (min(ids) >= 0 and max(ids) < self.cfg.vocab_size):
                bad = next(t for t in ids if not 0 <= t < self.cfg.vocab_size)
                raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.cfg.vocab_size})")
            if len(ids) > limit:
                raise PromptTooLong(len(ids), limit)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        """`encode_prompt` without stalling the event loop: long texts are tokenised on a worker thread."""
        if isinstance(prompt, str) and len(prompt) > _INLINE_TOKENIZE_CHARS:
            return await self.run_text_work(self.encode_prompt, prompt)
        return self.encode_prompt(prompt)

    async def run_text_work(self, fn, *args):
        """`fn(*args)` on the engine's text threads: work on large inputs (parsing, templates, tokenising) that
        would stall the event loop. Two threads: more would only contend for the GIL with the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn, *args)

    def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> "RequestStream":
        """Enqueue one request and return its output stream (an async iterator; the last output has
        finished=True). Bad input raises ValueError here, before anything is queued."""
        return self.generate_choices(prompt, params, 1, request_id)[0]

    def generate_choices(self, prompt: str | list[int], params: SamplingParams | None, n: int,
                         request_id: str | None = None) -> list["RequestStream"]:
        """`generate` for n choices of one prompt (OpenAI's `n`), each a request of its own: the prompt and the
        parameters are checked once for all of them, and a seeded request's choice j samples with seed + j, so
        the choices differ and each is reproducible. With the prefix cache on, the prompt is prefilled once.
        n above `max_waiting` can never be queued: a ValueError, where a full queue is a QueueFullError."""
        if self._dead is not None or self.shutting_down or self.scheduler is None:
            raise EngineDeadError(self._dead or ("the engine is shutting down" if self.shutting_down
                                                 else "the engine is not running"))
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.args.max_waiting:
            raise ValueError(f"n must be an integer from 1 to max_waiting ({self.args.max_waiting}), got {n!r}")
        prompt_ids = self.encode_prompt(prompt)
        params = self.resolve_params(len(prompt_ids), params)
        if len(self.scheduler.waiting) + n > self.args.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are already waiting")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.cfg.generation.eos_token_ids)
        stop_ids = frozenset(stop_ids)
        sampling = RowSampling(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, seed=params.seed, logprobs=params.logprobs or 0,
            min_tokens=params.min_tokens, stop_token_ids=tuple(sorted(stop_ids)), max_tokens=params.max_tokens,
        )
        # CapacityError if it can never fit: checked once, as every choice needs the same.
        self.scheduler.check_fits(len(prompt_ids), params.max_tokens)
        keys = self.scheduler.prefix_keys(prompt_ids)
        streams = []
        for j in range(n):
            choice_params, choice_sampling = params, sampling
            if j and params.seed is not None:
                seed = (params.seed + j) % 2**63
                choice_params, choice_sampling = copy.copy(params), replace(sampling, seed=seed)
                choice_params.seed = seed  # a copy, not `replace`: its fields were validated once above
            rid = request_id if n == 1 and request_id else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
            streams.append(RequestStream(self, self._add(rid, prompt_ids, keys, choice_params, choice_sampling,
                                                          stop_ids)))
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self._wakeup.set()
        return streams

    def chat(
        self, messages: list[dict], params: SamplingParams | None = None, chat_template_kwargs: dict | None = None,
        request_id: str | None = None,
    ) -> "RequestStream":
        """`generate` on the checkpoint's chat template rendered with a generation prompt."""
        return self.generate(self.render_chat(messages, chat_template_kwargs), params, request_id)

    def render_chat(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            if not isinstance(m.get("content", ""), (str, type(None))):
                raise ValueError(f"messages[{i}].content must be a string")
        kwargs = dict(chat_template_kwargs or {})
        if "messages" in kwargs:
            raise ValueError("chat_template_kwargs must not set 'messages' (the request's own)")
        add = kwargs.pop("add_generation_prompt", True)  # vLLM's field, which a client may pass here too
        if not isinstance(add, bool):
            raise ValueError(f"chat_template_kwargs.add_generation_prompt must be a boolean, got {add!r}")
        return self.tokenizer.render_chat(messages, add_generation_prompt=add, **kwargs)

    def _add(self, request_id: str, prompt_ids: list[int], keys: list | None, params: SamplingParams,
             sampling: RowSampling, stop_ids: frozenset[int]) -> Request:
        drawn: list[int] = []  # the request's tokens, shared with the scheduler
        self.scheduler.add(request_id, len(prompt_ids), params.max_tokens, prompt_ids=prompt_ids, drawn=drawn,
                           keys=keys)
        req = Request(
            request_id, prompt_ids, params, sampling, stop_ids,
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            StopMatcher(params.stop, params.include_stop_str_in_output),
            logprobs=[] if params.logprobs is not None else None, drawn_ids=drawn,
        )
        self.requests[request_id] = req
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._finish(req, "abort")

    def _finish(self, req: Request, reason: str, delta_ids=(), delta_text: str = "", error: str | None = None):
        req.finished = True
        self.requests.pop(req.request_id, None)
        if self.scheduler is not None:
            self.scheduler.finish(req.request_id)  # pages and slots are freed at the next plan
        tail = req.flush_text()
        self.metrics.finished.labels(reason).inc()
        self.metrics.e2e.observe(time.perf_counter() - req.arrival)
        req.queue.put_nowait(req.output(delta_ids, delta_text + tail, reason, error))
        self._wakeup.set()

    # The step loop --------------------------------------------------------------------------------------------------
    async def _step_loop(self) -> None:
        """The steps until close. Whatever ends them early (a rank's failure, a host-side bug while planning or
        applying a step, a cancellation) poisons the replica and ends every live request with an error: no
        request is left waiting on a loop that is gone."""
        try:
            await self._run_steps()
        except ReplicaPoisoned as exc:
            self._poison(str(exc))
        except asyncio.CancelledError:  # the ranks may be anywhere in a step
            self.replica.group.poison(RuntimeError("the engine's step loop was cancelled"))
            self._poison("the engine's step loop was cancelled")
            raise
        except Exception as exc:
            self.replica.group.poison(exc)  # logs it, with its traceback
            self._poison(f"step failed: {exc!r}")

    async def _run_steps(self) -> None:
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
        ahead = 1 if self.args.async_scheduling else 0  # steps handed over beyond the one whose tokens are awaited
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
            self._observe_step(plan, now - started, result, idle=idle)
            last_done = now
            self._count_kept(plan, cmd, result)
            later.extend(self._apply(plan, result))
            if ahead:  # the next step is with the ranks already: the outputs go out at once
                self._emit(later)
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

    def _needs_tokens_first(self, before) -> bool:
        """Whether the next plan waits for the tokens of the step `before` it (in flight), and is made after them.
        Where that step speculated: for a row still short of its min_tokens (its draw bars the stop ids by its
        token's index, which the host must then know); and, among few rows, for one that step may take to its
        max_tokens (else the next step runs for it in vain, and a request arriving meanwhile waits for that step;
        H100, 4B c1 with k 4: TTFT 15.4 ms against 12.1 plain, before this wait)."""
        if not before.speculate:
            return False
        counts, few = self.scheduler.requests, len(before.decode_ids) <= FEW_STREAMS
        for rid in before.decode_ids:
            req = self.requests.get(rid)
            if req is not None and (req.params.min_tokens > counts[rid].generated or
                                    few and req.params.max_tokens - counts[rid].generated
                                    < self.speculative_tokens + 1):
                return True
        return False

    def _observe_step(self, plan, seconds: float, result: StepResult | None = None, idle: float | None = None) -> None:
        """idle: how long the devices had nothing to run before this step was handed over (None: no step before)."""
        prompt_tokens = sum(w.length for w in plan.prefill)
        # The budget learns from the device's time: with overlap, the host sees the steps' ends in bursts.
        device = result.device_seconds if result is not None and result.device_seconds > 0 else seconds
        self.metrics.step_seconds.observe(seconds)
        self.scheduler.step_budget.observe(plan.bucket, prompt_tokens, device)
        if steps_log.isEnabledFor(logging.DEBUG):
            launch = result.launch_seconds if result is not None else 0.0
            steps_log.debug("%d decode rows (bucket %d%s), %d prompt tokens in %d chunks (budget %d): %.2f ms on "
                            "the device, %.2f ms seen by the host, launched in %.2f ms%s", len(plan.decode_ids),
                            plan.bucket, ", speculative" if plan.speculate else "", prompt_tokens, len(plan.prefill),
                            plan.prompt_budget, device * 1e3, seconds * 1e3, launch * 1e3,
                            "" if idle is None else f", devices idle {idle * 1e3:.2f} ms before it")
        if self.speculative_tokens and plan.decode_ids and not plan.prefill and result is not None:
            # What the step cost the devices' timeline: its own time and the host's wait before it, which only a
            # speculative step (never overlapped) exposes; the host's view of an overlapped step is bursty.
            rows = len(plan.decode_ids)
            self.speculation.observe(plan.bucket, plan.speculate, device + (idle or 0.0),
                                     (rows + sum(map(len, result.decode_more))) / rows)

    def _command(self, plan) -> StepCommand:
        reqs = self.requests
        cmd = StepCommand(
            compactions=[RetireSlot(c.hole, c.moved_from) for c in plan.compactions],
            released_prefill_slots=plan.released_prefill_slots,
            promotions=[PromoteSlot(p.from_slot, p.to_slot, p.pages) for p in plan.promotions],
            bucket=plan.bucket, step_seed=self._rng.getrandbits(62), seq=next(self._steps),
            restore_snapshots=[(c.snapshot, c.slot) for c in plan.restores], copy_pages=list(plan.page_copies),
            save_snapshots=[(c.slot, c.snapshot) for c in plan.snapshots],
            finish_snapshots=[(c.slot, c.snapshot, c.keep) for c in plan.finish_snapshots],
        )
        # Requests that finished before this plan were retired by it, so every row here is live. The scheduler
        # counts a step's tokens when the step is handed over (one a row for a speculative step, until its counts
        # are back); with overlap the last of them may still be on their way, and the ranks fill them in.
        counts = self.scheduler.requests
        for rid in plan.decode_ids:
            req, n = reqs[rid], counts[rid].generated
            cmd.decode_tokens.append(req.output_ids[-1] if len(req.output_ids) == n else UNKNOWN_TOKEN)
            cmd.decode_positions.append(len(req.prompt_ids) + n - 1)
            cmd.decode_token_index.append(n)
        if self.speculative_tokens and plan.decode_ids:
            cmd.speculate = plan.speculate
            cmd.verify_accepted = [KEPT_ON_DEVICE if counts[rid].kept_pending else counts[rid].kept
                                   for rid in plan.decode_ids]
            if self.override.propose is not None:
                cmd.draft_tokens = [self._host_drafts(reqs[rid], counts[rid]) for rid in plan.decode_ids]
        for w in plan.prefill:
            req = reqs[w.request_id]
            end = w.start + w.length
            cmd.prefill.append(PrefillCommand(
                req.prompt_ids[w.start : end], w.start, w.slot, w.pages, w.last,
                sampling=req.sampling if w.first else None,
                prefix_ids=req.prompt_ids[: w.start] if w.first and req.sampling.needs_counts else [],
                next_token=req.prompt_ids[end] if end < len(req.prompt_ids) else 0,
            ))
            if w.first:
                req.cached_tokens = w.start
                self.metrics.count_prefix(len(req.prompt_ids), w.start)
                req.prefill_start = time.perf_counter()
                self.metrics.queue_time.observe(req.prefill_start - req.arrival)
        return cmd

    def _host_drafts(self, req: Request, counted) -> list[list[int]]:
        """The test drafter's drafts for a row (`StepCommand.draft_tokens`). Tokens still on their way stand in
        its output as UNKNOWN_TOKEN; a row whose speculative step is in flight gets drafts for each count the step
        may have kept (1 .. k + 1)."""
        k, drafter = self.speculative_tokens, self.override.propose
        unseen = counted.generated - len(req.output_ids)
        counts = range(1, k + 2) if counted.kept_pending else [1]
        return [list(drafter(req.prompt_ids, req.output_ids + [UNKNOWN_TOKEN] * (unseen + kept - 1), k))
                for kept in counts]

    def _decide(self, plan) -> None:
        """Whether the plan's decode rows speculate (`runtime.speculation`), before its command is made. A step
        carrying prompt chunks does not where it fuses them with its decode rows: one forward that reads the
        weights once (a speculative step does not)."""
        plan.speculate = bool(self.speculative_tokens and plan.decode_ids) and not (
            plan.prefill and self.replica.spec.fused_mixed_steps) and self.speculation.decide(plan.bucket)

    def _count(self, plan, cmd: StepCommand) -> None:
        """The scheduler's bookkeeping of a step handed over: what the next plan depends on, none of it the tokens
        (overlap scheduling counts before they are back); a speculative step's rows count one token each until
        `_count_kept`."""
        self.scheduler.on_prefill_done(plan.prefill)
        self.scheduler.on_decode_done(plan.decode_ids, cmd.seq if plan.speculate else 0)
        self.metrics.count_tokens(sum(w.length for w in plan.prefill),
                                  (0 if plan.speculate else len(plan.decode_ids)) + sum(w.last for w in plan.prefill))

    def _count_kept(self, plan, cmd: StepCommand, result: StepResult) -> None:
        """A speculative step's tokens are back: how many each row kept."""
        if not plan.speculate:
            return
        counts = [1 + len(more) for more in result.decode_more]
        self.scheduler.on_drafts_kept(plan.decode_ids, counts, cmd.seq)
        # The metrics count live requests' rows: not the step a request that ended before it ran in vain.
        self.metrics.count_kept([c for rid, c in zip(plan.decode_ids, counts) if rid in self.requests],
                                self.speculative_tokens)

    def _apply(self, plan, result: StepResult) -> list:
        """Each token appended, and every request that ends here finished (stop token, stop string, length).
        Returns (request, token, seconds since its last token or None) for the tokens whose outputs `_emit` makes
        later. A token for a request that has gone (it stopped a step earlier, with overlap) is dropped."""
        now = time.perf_counter()
        later = []
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
            self._finish(req, reason)
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
            self._finish(req, reason, [token], delta)
        else:
            req.queue.put_nowait(req.output([token], delta))

    def _poison(self, message: str) -> None:
        self._dead = message
        self.metrics.healthy.set(0)
        log.error("the engine stopped serving (the cause is logged above); failing %d live requests",
                  len(self.requests))
        for req in list(self.requests.values()):
            self._finish(req, "error", error=message)
        self.died.set()

    async def _log_stats(self, interval_s: float) -> None:
        """vLLM's periodic line: throughput since the last line, queue depth, KV and slot usage (while busy)."""
        m = self.metrics
        last = (time.monotonic(), m.prompt_token_count, m.generation_token_count)
        while True:
            await asyncio.sleep(interval_s)
            now, prompt, generated = time.monotonic(), m.prompt_token_count, m.generation_token_count
            seconds = now - last[0]
            busy = prompt > last[1] or generated > last[2] or self.requests
            if busy and self.scheduler is not None:
                s = self.scheduler
                log.info("prompt %.1f tok/s, generation %.1f tok/s; running %d, waiting %d; KV pages %.1f%%, "
                         "decode slots %.1f%%", (prompt - last[1]) / seconds, (generated - last[2]) / seconds,
                         s.num_running, len(s.waiting), 100 * s.held_pages / s.num_pages,
                         100 * len(s.decode_slots) / s.max_batch)
            last = (now, prompt, generated)

    # Introspection (tests, /metrics) ----------------------------------------------------------------------------
    def resources_free(self) -> bool:
        """True when no page, prefill slot or decode slot is held (all requests gone): the only pages held are
        the tails of prefix-cache snapshots."""
        s = self.scheduler
        return (s.held_pages == s.cache.snapshots.held_pages and not s.decode_slots
                and len(s.free_prefill_slots) == s.max_prefill_slots and not s.requests)


class RequestStream:
    """The outputs of one request. Leaving the `async for` early, cancelling the consuming task, `aclose()`,
    or dropping the stream unread all abort the request."""

    def __init__(self, engine: AsyncEngine, req: Request) -> None:
        self._engine, self._req = engine, req
        self.request_id = req.request_id
        self._loop = asyncio.get_running_loop()
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._req.queue.get()
        except BaseException:  # cancelled while waiting: the request goes too
            self._done = True
            self._engine.abort(self.request_id)
            raise
        self._done = out.finished
        return out

    async def aclose(self) -> None:
        self._done = True
        self._engine.abort(self.request_id)

    def __del__(self) -> None:
        # Dropped with the request still running (an early `break`): abort it from the loop's thread.
        if not self._req.finished and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._engine.abort, self.request_id)


__all__ = ["AsyncEngine", "EngineArgs", "SamplingParams", "RequestOutput", "RequestStream", "CapacityError", "EngineDeadError",
           "QueueFullError"]
