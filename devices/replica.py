"""A replica: the ranks of one tensor-parallel model, started, sized, stepped and stopped together.

Start-up order (every rank, on its own thread): refuse a bad tp before any weight is read; load this rank's
weight slices; measure free memory; size slots and pages from the smallest rank's free memory; allocate the
state; on CUDA, warm up and capture the decode graphs. Shutdown destroys graphs, then the communicators.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import torch

from deltaserve.args import EngineArgs
from deltaserve.kernels.config import KernelConfig
from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.model.config import ModelConfig
from deltaserve.model.forward import Qwen35Shard
from deltaserve.model.sharding import LocalSizes
from deltaserve.model.state import ModelState, StateSizes, decode_activation_bytes, prefill_activation_bytes
from deltaserve.model.weights import bytes_by_dtype, bytes_by_kind, load_rank_weights, random_rank_weights

from .backend import StepShape, device_backend
from .capacity import (PREFILL_SCRATCH_SHARE, PREFILL_TOKEN_BUDGET, CapacityPlan, default_prefill_token_budget,
                       plan_capacity)
from .commands import StepCommand, StepResult, positions_past_end
from .rank import RankRuntime
from .speculation import draft_head
from .worker import WorkerGroup

log = logging.getLogger(__name__)

# The longest start_step waits for the ranks to launch: their host work before a graph's launch (slot changes, the
# inputs' copies) takes a fraction of a millisecond; a step that takes longer (a bucket the capability gate left
# eager) no longer holds up the loop.
LAUNCH_WAIT_S = 2e-3


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica runs: the engine's arguments as given (not copied), and what the engine resolved from them
    and the checkpoint."""

    args: EngineArgs
    cfg: ModelConfig
    max_model_len: int
    buckets: list[int]  # decode buckets, ascending
    fused_mixed_steps: bool  # EngineArgs.fused_mixed_steps, resolved (None: where its steps are graphed)
    speculative_acceptance: tuple[float, ...] | None = None  # benchmarks: SpeculationOverride.acceptance

    @property
    def snapshot_bytes(self) -> int | None:
        """Per rank, for the prefix cache's state snapshots: 0 with the cache off; None: SNAPSHOT_FRACTION of the
        memory after the weights."""
        args = self.args
        if not args.enable_prefix_caching:
            return 0
        return None if args.prefix_cache_state_gib is None else int(args.prefix_cache_state_gib * 2**30)


SNAPSHOT_FRACTION = 0.1


def prefill_graph_buckets(most_tokens: int) -> list[int]:
    """Powers of two from 16 to 128, then every 64 tokens to 512, then every 128 up to `most_tokens`: a chunk of n
    tokens replays the smallest bucket of at least n, so padding stays under 64 tokens up to 512 and under 128
    above (doubling would nearly double the work of a 1088-token chunk, or of a 300-token chunk that a step budget
    sized beside the decode rows). The scheduler rounds a step's budget down to a bucket (`Scheduler.prompt_budget`)."""
    buckets, b = [], 16
    while b <= most_tokens:
        buckets.append(b)
        b = b * 2 if b < 128 else b + 64 if b < 512 else b + 128
    return buckets


def mixed_graph_buckets(prefill_buckets: list[int]) -> list[int]:
    """Prompt-token buckets of fused mixed steps: 64, then each about 1.5x the last (128, 192, 256, 384, ...),
    those among the prefill buckets. Every decode bucket is captured with each, so the list is coarser than the
    prefill graphs'; a step's budget is rounded down to one of them, so only a prompt's last chunk pads."""
    buckets, b = [], 64
    while b <= max(prefill_buckets, default=0):
        if b in prefill_buckets:
            buckets.append(b)
        b = b * 2 if b < 128 else b + b // 2 if (b & (b - 1)) == 0 else b // 3 * 4
    return buckets


def _describe(shapes: list[StepShape]) -> str:
    """Shapes for the log: mixed ones as their decode rows by their prompt tokens."""
    if shapes and shapes[0].rows and shapes[0].prompt_tokens:
        return (f"{sorted({s.rows for s in shapes})} decode rows x {sorted({s.prompt_tokens for s in shapes})} "
                "prompt tokens")
    return "[" + ", ".join(map(str, shapes)) + "]"


class _Rank:
    """Objects one rank's thread owns (touched only from that thread)."""

    def __init__(self) -> None:
        self.backend = None
        self.model: Qwen35Shard | None = None
        self.draft_head = None  # what the MTP head's drafts read in place of lm_head (`rank.draft_head`)
        self.runtime: RankRuntime | None = None


class _Launched:
    """Rank 0's launched step as the worker holds it: finished inside the rank's device context (a flagged row is
    drawn again on the rank's stream)."""

    def __init__(self, step, context) -> None:
        self.step, self.context = step, context

    def ready(self) -> bool:
        return self.step.ready()

    def finish(self) -> StepResult:
        with self.context():
            return self.step.finish()


class Replica:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.backend = device_backend(spec.args.device, cpu_memory_bytes=spec.args.cpu_memory_bytes,
                                      kernel_config=spec.args.kernel_config or KernelConfig())
        self.backend.check_devices(spec.args.tp)
        # Refuses a tp the heads do not split, before any weight is read.
        if spec.args.enable_expert_parallel and not spec.cfg.is_moe:
            raise ValueError("enable_expert_parallel needs a mixture-of-experts checkpoint; this one is dense")
        self.local = LocalSizes.of(spec.cfg, spec.args.tp, spec.args.enable_expert_parallel)
        self.dtype: torch.dtype = getattr(torch, spec.args.dtype)
        self.ranks = [_Rank() for _ in range(spec.args.tp)]
        self.collective = None
        self.group: WorkerGroup | None = None
        self.plan: CapacityPlan | None = None
        self.prefill_token_budget: int | None = None  # prompt tokens a step carries at most: set by `start`
        self.sizes = StateSizes.of(spec.cfg, self.local, self.dtype, speculative_tokens=spec.args.speculative_tokens)

    # Start-up -------------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        spec = self.spec
        self.collective = self.backend.make_collective(spec.args.tp, spec.args.use_nccl, spec.args.step_timeout_s)
        self.group = WorkerGroup(spec.args.tp, spec.args.step_timeout_s, on_abort=self._abort_collective)
        started = time.perf_counter()
        free = await self.group.call(self._load, timeout_s=3600)
        log.info("weights loaded on %d rank(s) in %.1f s", spec.args.tp, time.perf_counter() - started)
        snapshot_bytes = int(SNAPSHOT_FRACTION * min(free)) if spec.snapshot_bytes is None else spec.snapshot_bytes
        self.prefill_token_budget = self._prefill_token_budget(min(free))
        self.plan = plan_capacity(
            free_bytes=min(free),
            bytes_per_slot=self.sizes.bytes_per_request_slot,
            bytes_per_snapshot=self.sizes.bytes_per_snapshot,
            bytes_per_page=self.sizes.kv_bytes_per_page,
            page_size=self.sizes.page_size,
            max_model_len=spec.max_model_len + positions_past_end(spec.args.speculative_tokens),
            requested_batch=spec.args.max_batch,
            prefill_slots=spec.args.prefill_slots,
            # The CPU budget counts state only; on a GPU the prefill activations come out of the same memory.
            prefill_scratch_bytes=prefill_activation_bytes(spec.cfg, self.local, self.dtype, self.prefill_token_budget)
            if spec.args.device == "cuda" else 0,
            buckets=spec.buckets,
            # A pool each: one-token decode steps, speculative ones, prefill steps (mixed steps in the prefill
            # pool, with a decode bucket's rows more).
            graph_reserve=lambda b: decode_activation_bytes(spec.cfg, self.local, self.dtype, b) + (
                decode_activation_bytes(spec.cfg, self.local, self.dtype, self._speculative_rows(b))
                if self._speculative_rows(b) else 0) + (
                prefill_activation_bytes(spec.cfg, self.local, self.dtype,
                                         max(self.prefill_buckets) + (b if self.mixed_token_buckets else 0))
                if self.prefill_buckets else 0) if self._graphs else 0,
            snapshot_bytes=snapshot_bytes,
        )
        if self.plan.max_batch < spec.args.max_batch:
            log.warning("max_batch lowered from %d to %d to fit memory", spec.args.max_batch, self.plan.max_batch)
        log.info(
            "per rank: %.1f MiB state per slot (conv %.2f + recurrent %.2f + speculative %.2f), %.3f MiB per KV "
            "page of %d tokens; %d decode slots + %d prefill slots, %d KV pages (%d tokens), largest graph bucket %d",
            self.sizes.bytes_per_request_slot / 2**20, self.sizes.conv_bytes_per_slot / 2**20,
            self.sizes.ssm_bytes_per_slot / 2**20, self.sizes.verify_bytes_per_slot / 2**20,
            self.sizes.kv_bytes_per_page / 2**20, self.plan.page_size,
            self.plan.max_batch, self.plan.prefill_slots, self.plan.num_pages, self.plan.num_pages * self.plan.page_size,
            self.plan.largest_bucket,
        )
        longest = spec.max_model_len + positions_past_end(spec.args.speculative_tokens)
        full_length = self.plan.num_pages // -(-longest // self.plan.page_size)
        if full_length < self.plan.max_batch:
            log.info("the KV pages hold %d requests of max_model_len %d at once; shorter ones share them (admission "
                     "reserves each request's prompt + max_tokens)", full_length, spec.max_model_len)
        if snapshot_bytes:
            log.info("prefix cache: %d state snapshots per rank (%.2f GiB)", self.plan.snapshots,
                     self.plan.snapshots * self.sizes.bytes_per_snapshot / 2**30)
        await self.group.call(self._allocate, timeout_s=3600)
        if self._graphs:
            started = time.perf_counter()
            try:
                await self.group.call(self._capture, timeout_s=spec.args.capture_timeout_s)
            except Exception as exc:
                raise RuntimeError(
                    f"CUDA graph capture did not complete (watchdog {spec.args.capture_timeout_s:.0f} s): {exc}; "
                    "start with --no-cuda-graph to serve eagerly") from exc
            # A prompt shape replayed on one rank only would pad its chunks (and fuse its step) there alone: the
            # ranks would all-reduce other sizes. Each rank keeps those that every rank captured.
            prompt_shapes = [{s for s in r.runtime.graphs.shapes if s.prompt_tokens} for r in self.ranks]
            common = set.intersection(*prompt_shapes)
            if any(shapes != common for shapes in prompt_shapes):
                log.warning("prompt steps captured for different shapes on different ranks: %s run without graphs",
                            ", ".join(map(str, sorted(set.union(*prompt_shapes) - common))))
                for r, shapes in zip(self.ranks, prompt_shapes):
                    r.runtime.graphs.drop(shapes - common)
            stats = self.ranks[0].runtime.graphs.stats
            for kind in ("decode", "speculative", "prefill", "mixed"):
                shapes = sorted(s for s in stats if s.kind == kind)
                if shapes:
                    log.info("%d %s graphs per rank (shapes %s; %d nodes in the largest, %.0f MiB of pool)",
                             len(shapes), kind, _describe(shapes), stats[shapes[-1]]["nodes"],
                             sum(stats[s]["pool_bytes"] for s in shapes) / 2**20)
            log.info("graphs captured in %.1f s", time.perf_counter() - started)

    def _speculative_rows(self, bucket: int) -> int:
        """Token rows of the largest speculative step up to `bucket` rows (k + 1 a row; 0 without speculation)."""
        k, most = self.spec.args.speculative_tokens, self.spec.args.speculative_max_batch
        return min(bucket, bucket if most is None else most) * (k + 1) if k else 0

    @property
    def _graphs(self) -> bool:
        return self.backend.has_graphs and self.spec.args.cuda_graph

    @property
    def buckets(self) -> list[int]:
        """Decode buckets up to the plan's largest, clamped to its batch: where memory lowered the batch below the
        largest bucket's size, that bucket holds exactly the batch (the fixed inputs have a row per decode slot)."""
        most = self.plan.max_batch
        return sorted({min(b, most) for b in self.spec.buckets if b <= self.plan.largest_bucket})

    def _prefill_token_budget(self, free_bytes: int) -> int:
        """The spec's budget, or where it sets none the default that fits the memory left after the weights (on
        the CPU, whose budget counts state only, the default)."""
        if self.spec.args.prefill_token_budget is not None:
            return self.spec.args.prefill_token_budget
        if self.spec.args.device != "cuda":
            return PREFILL_TOKEN_BUDGET
        tokens = default_prefill_token_budget(
            free_bytes, lambda t: prefill_activation_bytes(self.spec.cfg, self.local, self.dtype, t))
        if tokens < PREFILL_TOKEN_BUDGET:
            log.info("max_num_batched_tokens %d (not %d): its prefill activations take at most 1/%d of the %.1f "
                     "GiB left after the weights", tokens, PREFILL_TOKEN_BUDGET, PREFILL_SCRATCH_SHARE,
                     free_bytes / 2**30)
        return tokens

    @property
    def prefill_bucket_sizes(self) -> list[int]:
        """The prefill steps' padded sizes in tokens, captured or not: at most a step's prompt tokens and at most
        the context, so a bucket's chunk always fits the page table's width (pages for max_model_len)."""
        return prefill_graph_buckets(min(self.spec.args.prefill_graph_tokens, self.prefill_token_budget,
                                         self.spec.max_model_len))

    @property
    def graph_shapes(self) -> list[StepShape]:
        """The shapes captured at start-up (none without graphs; read once the ranks are allocated): each decode
        bucket's one-token step, and its speculative step where it may speculate (`RankRuntime.can_speculate`); each
        prefill bucket; each decode bucket beside each mixed prompt-token bucket."""
        if not self._graphs:
            return []
        runtime, k = self.ranks[0].runtime, self.spec.args.speculative_tokens
        speculative = [StepShape(b, k + 1) for b in self.buckets if runtime.can_speculate(b)]
        return ([StepShape(b) for b in self.buckets] + speculative
                + [StepShape(0, 1, t) for t in self.prefill_buckets]
                + [StepShape(b, 1, t) for b in self.buckets for t in self.mixed_token_buckets])

    @property
    def prefill_buckets(self) -> list[int]:
        """Captured prefill sizes in tokens (none without graphs)."""
        return self.prefill_bucket_sizes if self._graphs else []

    @property
    def mixed_token_buckets(self) -> list[int]:
        """Prompt-token buckets of the captured fused mixed steps (none unless fused and graphed)."""
        return mixed_graph_buckets(self.prefill_buckets) if self.spec.fused_mixed_steps else []

    def _abort_collective(self) -> None:
        if self.collective is not None:
            self.collective.abort()

    def _load(self, rank: int) -> int:
        spec, r = self.spec, self.ranks[rank]
        r.backend = self.backend.open_rank(rank, self.collective)
        with r.backend.context():
            mtp = spec.args.speculative_tokens > 0
            fp8 = spec.args.fp8_kernels and bool(spec.cfg.fp8_block)
            ep = spec.args.enable_expert_parallel
            if fp8:
                r.backend.check_fp8_ops()
            if spec.args.load_format == "random":
                weights = random_rank_weights(spec.cfg, rank=rank, tp=spec.args.tp, device=r.backend.device,
                                              dtype=self.dtype, seed=spec.args.seed, progress=rank == 0, mtp=mtp,
                                              fp8_block=spec.cfg.fp8_block if fp8 else 0, expert_parallel=ep)
            else:
                weights = load_rank_weights(spec.args.model, spec.cfg, rank=rank, tp=spec.args.tp,
                                            device=r.backend.device,
                                            dtype=self.dtype, progress=rank == 0, mtp=mtp, keep_fp8=fp8,
                                            expert_parallel=ep)
            held, kinds = bytes_by_dtype(weights), bytes_by_kind(weights)
            r.model = Qwen35Shard(spec.cfg, weights, self.local, ops=r.backend.ops, all_reduce=r.backend.all_reduce,
                                  expert_start=rank * self.local.experts if ep else 0)
            log.info("rank %d/%d: %.1f MiB of weights on %s (%s; %s)", rank, spec.args.tp, sum(held.values()) / 2**20,
                     r.backend.device, ", ".join(f"{d} {b / 2**20:.1f} MiB" for d, b in sorted(held.items())),
                     ", ".join(f"{k} {b / 2**20:.1f} MiB" for k, b in sorted(kinds.items())))
            if mtp:  # before the free memory is measured: a copy counts against it
                r.draft_head = draft_head(r.model.w["lm_head.weight"], spec.args.speculative_draft_vocab,
                                          spec.args.speculative_fp8_draft_head)
                if isinstance(r.draft_head, Fp8Weight):
                    log.info("rank %d: the drafts read an FP8 copy of lm_head's first %d rows (%.1f MiB)", rank,
                             r.draft_head.shape[0], r.draft_head.nbytes / 2**20)
            return r.backend.free_memory(spec.args.memory_fraction)

    def _allocate(self, rank: int) -> None:
        spec, r, plan = self.spec, self.ranks[rank], self.plan
        with r.backend.context():
            k = spec.args.speculative_tokens
            state = ModelState(spec.cfg, self.local, plan.max_batch + plan.prefill_slots, plan.num_pages,
                               self.dtype, r.backend.device, page_size=plan.page_size, num_snapshots=plan.snapshots,
                               mtp=k > 0, speculative_tokens=k)
            r.runtime = RankRuntime(
                r.model, state, rank=rank, max_batch=plan.max_batch,
                max_pages_per_seq=-(-(spec.max_model_len + positions_past_end(k)) // plan.page_size),
                device=r.backend.device,
                tp=spec.args.tp, acceptance=spec.speculative_acceptance,
                speculate_up_to=spec.args.speculative_max_batch,
                draft_head=r.draft_head, fuse_mixed_steps=spec.fused_mixed_steps,
            )
            log.info("rank %d: %.1f MiB of state allocated", rank, state.nbytes() / 2**20)
            if r.runtime.sampling:  # a speculative step draws k rows a request after the first
                r.runtime.sampling.compile_kernels(plan.max_batch * (k + 1), self.dtype)

    def _capture(self, rank: int) -> None:
        r = self.ranks[rank]
        with r.backend.context():
            r.backend.warm_up_collective()
            programs = r.runtime.programs(self.graph_shapes, self.plan.prefill_slots)
            r.runtime.graphs = r.backend.capture(programs, progress=rank == 0, prepare=r.runtime.prepare)

    # Steps ----------------------------------------------------------------------------------------------------------
    def start_step(self, cmd: StepCommand, overlapped: bool = False) -> Awaitable[StepResult]:
        """Hand `cmd` to every rank now, and return once each has launched it (at most LAUNCH_WAIT_S later); await
        the result (rank 0's). The caller's work after the hand-off (the last step's outputs and the streams'
        writes, in Python) would otherwise hold the GIL while the ranks launch: each torch call of a launch gives
        the GIL up and waits a switch interval to get it back, so a launch of a few dozen calls would last as long
        as the loop's work beside it, and the GPU would wait for it.

        `overlapped` (overlap scheduling: the caller hands over the next step before it awaits this one): each
        rank launches it while the step before still runs on the GPU, before it reads that one's tokens
        (DeviceWorker's pipelined commands); a CPU rank is still computing the step before, so nothing is waited
        for there."""
        launched = [threading.Event() for _ in self.ranks]
        if overlapped:
            futures = self.group.submit(lambda rank: self._launch(rank, cmd, launched[rank].set), pipelined=True)
            if self.spec.args.device != "cuda":  # a CPU rank computes the step before as it launched it: still busy
                return self._result(futures)
        else:
            futures = self.group.submit(lambda rank: self._execute(rank, cmd, launched[rank].set))
        deadline = time.monotonic() + LAUNCH_WAIT_S
        for event in launched:  # releases the GIL while it waits
            event.wait(max(0.0, deadline - time.monotonic()))
        return self._result(futures)

    async def _result(self, futures) -> StepResult:
        return (await self.group.gather(futures))[0]

    def _launch(self, rank: int, cmd: StepCommand, on_launched) -> "_Launched | None":
        r = self.ranks[rank]
        try:
            with r.backend.context():
                step = r.runtime.launch(cmd, on_launched)
        finally:
            on_launched()  # a step that failed releases the caller too
        return None if step is None else _Launched(step, r.backend.context)

    def _execute(self, rank: int, cmd: StepCommand, on_launched) -> StepResult | None:
        r = self.ranks[rank]
        try:
            with r.backend.context():
                return r.runtime.execute(cmd, on_launched)
        finally:
            on_launched()  # a step that failed, or launched nothing, releases the caller too

    # Shutdown -------------------------------------------------------------------------------------------------------
    async def close(self) -> None:
        if self.group is None:
            return
        if self.group.poisoned is None:
            try:
                await self.group.call(self._teardown, timeout_s=60)
            except Exception:  # already logged as poison; keep shutting down
                pass
        else:  # no rank runs a command now; a stuck one keeps what its own frame holds
            for r in self.ranks:  # the weights and state go with the last reference (an embedding process lives on)
                r.runtime = r.model = None
        self.group.stop()
        self.group = None
        if self.collective is not None:
            self.collective.close()  # after every rank destroyed its graphs
            self.collective = None

    def _teardown(self, rank: int) -> None:
        r = self.ranks[rank]
        if r.backend is not None:
            r.backend.close()  # graphs first, then the stream (the communicator goes after every rank)
        r.runtime = r.model = None
        if r.backend is not None:
            r.backend.release_memory()

