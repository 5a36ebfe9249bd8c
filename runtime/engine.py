"""The embedded API: start-up and warm-up, requests in (`generate`, `chat`), streams out, abort, drain, close.

    async with AsyncEngine(EngineArgs(model=DIR)) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text)

One task (`runtime.step_loop.StepLoop`) owns the scheduler and the live requests; `generate` only checks and
enqueues a request, and its stream reads the request's output queue.
Breaking out of the `async for`, or cancelling the consuming task, aborts the request and frees its slot and
pages at the next step.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import itertools
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from deltaserve.devices.commands import RowSampling, positions_past_end
from deltaserve.devices.replica import Replica, ReplicaSpec
from deltaserve.model.config import generation_defaults, load_model_config
from deltaserve.model.synthetic import demo_checkpoint
from deltaserve.model.weights import check_checkpoint
from deltaserve.progress import progress as show_progress

from deltaserve.args import EngineArgs
from .grammar import Grammars
from .kv_events import KvEventPublisher, KvEventsConfig
from .metrics import EngineMetrics
from .params import SamplingParams, all_ints
from .prefix_cache import PrefixCache
from .scheduler import CapacityError, Scheduler, default_buckets
from .speculation import SpeculationOverride, SpeculationPolicy
from .step_budget import StepBudget
from .step_loop import StepLoop
from .outputs import Request, RequestOutput
from .text import (IncrementalDetokenizer, PromptTooLong, StopMatcher, TextTokenizer, prompt_opens_reasoning,
                   read_chat_template)

log = logging.getLogger(__name__)

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
        self.steps: StepLoop | None = None
        self.grammars: Grammars | None = None
        self.kv_events: KvEventPublisher | None = None
        self._closing = False
        self._draining = False
        self._stats_task: asyncio.Task | None = None
        self._frozen = False  # whether this engine counts in `_StartupObjects`
        self._ids = itertools.count()
        self._text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="deltaserve-text")

    # Lifecycle ------------------------------------------------------------------------------------------------------
    async def __aenter__(self) -> "AsyncEngine":
        try:
            await self.start()
        except BaseException:  # what it had started (the ranks, their memory) goes back: `__aexit__` will not run
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        started = time.perf_counter()
        if self.args.model is None:
            self.args = self.args.replace(model=demo_checkpoint())
        args = self.args
        self.cfg = load_model_config(args.model)
        if args.generation_config != "auto":
            self.cfg = dataclasses.replace(self.cfg, generation=generation_defaults(args.generation_config,
                                                                                   self.cfg.generation))
        self.tokenizer = TextTokenizer(args.model)
        if args.chat_template is not None:
            self.tokenizer.use_chat_template(read_chat_template(args.chat_template))
        self.grammars = Grammars(self.tokenizer, self.cfg.vocab_size, self.cfg.generation.eos_token_ids)
        kv_events = KvEventsConfig.parse(args.kv_events_config) if args.kv_events_config else KvEventsConfig()
        if kv_events.publishes and not args.enable_prefix_caching:
            raise ValueError("kv_events_config publishes the prefix cache's contents: it needs prefix caching on")
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
        self.metrics.model_name = self.model_name
        buckets = sorted(args.buckets) if args.buckets else default_buckets(args.max_batch)
        self.override.check(args.speculative_tokens)
        speculation = SpeculationPolicy(args.speculative_tokens, args.speculative_max_batch, args.speculative_adaptive)
        if args.speculative_tokens:
            if self.cfg.mtp_num_hidden_layers != 1:
                raise ValueError(f"speculative_tokens needs the checkpoint's one-layer MTP head (Qwen3.5's); its "
                                 f"config has mtp_num_hidden_layers {self.cfg.mtp_num_hidden_layers}")
            if args.speculative_draft_vocab > self.cfg.vocab_size:
                raise ValueError(f"speculative_draft_vocab {args.speculative_draft_vocab} exceeds the vocabulary "
                                 f"({self.cfg.vocab_size} tokens)")
            log.info("speculative decoding: %d tokens drafted a step by the MTP head (%s)", args.speculative_tokens,
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
            prefix_cache=PrefixCache(plan.num_pages, plan.page_size, plan.snapshots, args.enable_prefix_caching,
                                     announce=kv_events.publishes),
            lookahead=positions_past_end(args.speculative_tokens), prefill_graph_sizes=self.replica.prefill_buckets,
            mixed_graph_sizes=self.replica.mixed_token_buckets,
        )
        await self.grammars.ready()
        self.steps = StepLoop(self.replica, self.scheduler, self.metrics, speculation, self.override,
                              overlap=args.async_scheduling, seed=args.seed)
        if kv_events.publishes:
            self.kv_events = KvEventPublisher(kv_events)
            self.steps.publish_events = self.kv_events.publish
        self.steps.start()
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
        if self.steps.dead is not None:
            raise RuntimeError(f"the warm-up requests failed: {self.steps.dead}")
        self.metrics.reset()  # what /metrics reports starts with the first real request
        self.scheduler.step_budget = self.scheduler.step_budget.seeded()  # its chunks' times include compiles
        self.scheduler.cache.clear()  # and its prompts are nobody's
        log.info("warm-up: %d requests in %.1f s (Triton kernels compiled or loaded from the cache)",
                 sum(map(len, waves)), time.perf_counter() - started)

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting requests (new ones get EngineDeadError), let the live ones run for up to `timeout_s`, then
        abort the rest: each stream's last output has finish_reason "abort"."""
        self._draining = True
        if self.steps is None:  # never started: nothing to drain
            return
        deadline = time.monotonic() + timeout_s
        while self.requests and time.monotonic() < deadline and self.steps.dead is None:
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if self.requests:
            log.info("aborting %d requests still running after %.1f s", len(self.requests), timeout_s)
        self.steps.finish_all("abort")

    async def close(self) -> None:
        self._closing = True
        if self._stats_task is not None:
            self._stats_task.cancel()
            self._stats_task = None
        if self.steps is not None:
            await self.steps.close(self.args.step_timeout_s)
            self.steps.finish_all("abort", error="the engine shut down")
        if self.replica is not None:
            await self.replica.close()
            self.replica = None
        self._text_pool.shutdown(wait=False, cancel_futures=True)
        if self.grammars is not None:
            self.grammars.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self._frozen:
            self._frozen = False
            _StartupObjects.thaw()

    @property
    def shutting_down(self) -> bool:
        return self._closing or self._draining

    @property
    def healthy(self) -> bool:
        return self.steps is not None and self.steps.dead is None and self.steps.task is not None \
            and not self.shutting_down

    @property
    def requests(self) -> dict[str, Request]:
        """The live requests, by id."""
        return self.steps.requests if self.steps is not None else {}

    @property
    def died(self) -> asyncio.Event:
        """Set once a device failure (or a bug in the step loop) stopped the engine serving; the cause is logged."""
        return self.steps.died

    @property
    def speculation(self) -> SpeculationPolicy:
        return self.steps.speculation

    # Requests -------------------------------------------------------------------------------------------------------
    def resolve_params(self, prompt_len: int, params: SamplingParams | None) -> SamplingParams:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # again: its fields may have been set after it was made
        params.check_model(self.cfg.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.args.max_logprobs:
                raise ValueError(f"{name} {asked} is above this server's max_logprobs ({self.args.max_logprobs})")
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
        dead = self.steps.dead if self.steps is not None else None
        if dead is not None or self.shutting_down or self.scheduler is None:
            raise EngineDeadError(dead or ("the engine is shutting down" if self.shutting_down
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
            logit_bias=tuple(sorted((params.logit_bias or {}).items())),
        )
        # CapacityError if it can never fit: checked once, as every choice needs the same.
        self.scheduler.check_fits(len(prompt_ids), params.max_tokens)
        keys = self.scheduler.prefix_keys(prompt_ids)
        spec, compiling = params.structured_outputs, None
        if spec is not None:
            after_reasoning = self._opens_reasoning(prompt)
            if not self.grammars.compiled(spec, after_reasoning):  # the choices queue once it is compiled
                compiling = asyncio.ensure_future(self.grammars.compile(spec, after_reasoning))
        streams = []
        for j in range(n):
            choice_params, choice_sampling = params, sampling
            if j and params.seed is not None:
                seed = (params.seed + j) % 2**63
                choice_params, choice_sampling = copy.copy(params), replace(sampling, seed=seed)
                choice_params.seed = seed  # a copy, not `replace`: its fields were validated once above
            if spec is not None and compiling is None:  # each choice its own matcher
                choice_sampling = replace(choice_sampling, grammar=self.grammars.matcher(spec, after_reasoning))
            rid = request_id if n == 1 and request_id else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
            req = self._request(rid, prompt_ids, choice_params, choice_sampling, stop_ids)
            if compiling is None:
                self.steps.add(req, keys)
            else:
                self.steps.add_when_compiled(req, keys, compiling,
                                             lambda a=after_reasoning: self.grammars.matcher(spec, a))
            streams.append(RequestStream(self, req))
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.steps.wake()
        return streams

    def chat(
        self, messages: list[dict], params: SamplingParams | None = None, chat_template_kwargs: dict | None = None,
        request_id: str | None = None, tools: list[dict] | None = None,
    ) -> "RequestStream":
        """`generate` on the checkpoint's chat template rendered with a generation prompt (and `tools`, OpenAI's
        function tools, for the template to describe)."""
        return self.generate(self.render_chat(messages, chat_template_kwargs, tools), params, request_id)

    def render_chat(self, messages: list[dict], chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            if not isinstance(m.get("content", ""), (str, type(None))):
                raise ValueError(f"messages[{i}].content must be a string")
        kwargs = dict(chat_template_kwargs or {})
        for own in ("messages", "tools"):
            if own in kwargs:
                raise ValueError(f"chat_template_kwargs must not set {own!r} (the request's own)")
        add = kwargs.pop("add_generation_prompt", True)  # vLLM's field, which a client may pass here too
        if not isinstance(add, bool):
            raise ValueError(f"chat_template_kwargs.add_generation_prompt must be a boolean, got {add!r}")
        return self.tokenizer.render_chat(messages, add_generation_prompt=add, tools=tools, **kwargs)

    def _request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sampling: RowSampling,
                 stop_ids: frozenset[int]) -> Request:
        return Request.new(request_id, prompt_ids, params, sampling, stop_ids,
                           IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                           StopMatcher(params.stop, params.include_stop_str_in_output))

    async def compile_constraint(self, prompt: str | list[int], params: SamplingParams) -> None:
        """Compile the request's constraint (`params.structured_outputs`) ahead of `generate`, off the event loop,
        so that one that cannot compile raises its ValueError here (the server's 400) rather than ending the
        stream; `generate` then finds it compiled."""
        spec = params.structured_outputs
        if spec is not None:
            await self.grammars.compile(spec, self._opens_reasoning(prompt))

    def _opens_reasoning(self, prompt: str | list[int]) -> bool:
        """Whether the prompt (its text or its ids) ends inside an open reasoning block: a constraint starts after
        it closes."""
        if isinstance(prompt, str):
            return prompt_opens_reasoning(prompt)
        return self.tokenizer.ids_open_reasoning(prompt)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.steps.finish(req, "abort")

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
