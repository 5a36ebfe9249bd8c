"""Where a decode step's wall time goes when it runs through the engine, against the step on the GPU.

    python -m deltaserve.tools.lab.profile_engine_step --size 4b [--layers N] [--batches 1,64] [--context 1024]
        [--speculative-tokens K [--acceptance P1,...]]

Random bf16 weights on a CUDA device (`tools.bench_decode`'s engine), tp = 1. For each batch size, `rows` greedy
requests stream through `engine.generate` (as in bench_decode's engine column, but without overlap scheduling: one
`execute` a step) while rank 0's `execute` and `SlotSampling.draw` + `collect` are timed. Printed per batch: the
engine's step; `execute`, the device thread's whole step (inputs, the graph's launch, sampling, the read-back);
`sample`, the part of it from the sampler's launch to the read-back
(it includes waiting for the forward); and the gap between two `execute`s, during which the GPU has nothing
queued. The gap is split in two: from a step's end to the next step's hand-off (the event loop routes the
results and plans the step) and from the hand-off to rank 0's start (its thread waking and taking the GIL).
All are means over the window in which every request decodes, so `execute` and the gap add up to the engine's
step. `--host-profile` then runs the first batch size again with cProfile on rank 0's thread (inside `execute`)
and prints its functions by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from deltaserve.devices.rank import RankRuntime
from deltaserve.devices.replica import Replica
from deltaserve.devices.sampling import SlotSampling
from deltaserve.tools.bench_decode import add_engine_args, kernel_config, engine_step_time, open_engine


class StepTimer:
    """While entered, wraps Replica.start_step, RankRuntime.execute and SlotSampling.draw and collect to record, for
    each of rank 0's steps, when it was handed to the ranks, when it started and ended, and how long its sampling
    took (from the sampler's launch to the tokens on the host)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float, float]] = []  # (handed, start, end, seconds sampling)
        self._handed = 0.0
        self._sampling = 0.0
        self._wrapped = (Replica.start_step, RankRuntime.execute, SlotSampling.draw, SlotSampling.collect)

    def __enter__(self) -> "StepTimer":
        start_step, execute, draw, collect = self._wrapped
        timer = self

        def timed_start_step(replica, cmd, *args, **kwargs):
            timer._handed = time.perf_counter()  # the ranks cannot start before it, nor the next hand-off come
            return start_step(replica, cmd, *args, **kwargs)

        def timed_execute(runtime, cmd, *args):
            if runtime.rank == 0:  # only rank 0 samples
                timer._sampling = 0.0
            started = time.perf_counter()
            try:
                return execute(runtime, cmd, *args)
            finally:
                if runtime.rank == 0:
                    timer.steps.append((timer._handed, started, time.perf_counter(), timer._sampling))

        def timed(method):
            def wrapper(*args):
                started = time.perf_counter()
                try:
                    return method(*args)
                finally:
                    timer._sampling += time.perf_counter() - started
            return wrapper

        Replica.start_step, RankRuntime.execute = timed_start_step, timed_execute
        SlotSampling.draw, SlotSampling.collect = timed(draw), timed(collect)
        return self

    def __exit__(self, *exc) -> None:
        Replica.start_step, RankRuntime.execute, SlotSampling.draw, SlotSampling.collect = self._wrapped

    def summary(self, start: float, end: float) -> dict:
        """Means over the steps inside [start, end]: the window in which every request decodes (before it the
        batch fills up, after it the batch drains). Means, as the engine step is one: execute + gap add up to it,
        and the gap is the time to the hand-off plus the hand-off to the start."""
        spans = [s for s in self.steps if start <= s[1] and s[2] <= end]
        pairs = list(zip(spans, spans[1:]))
        return {
            "execute_s": statistics.fmean(e - b for _, b, e, _ in spans),
            "sample_s": statistics.fmean(s for *_, s in spans),
            "gap_s": statistics.fmean(nxt[1] - cur[2] for cur, nxt in pairs),
            "to_handoff_s": statistics.fmean(nxt[0] - cur[2] for cur, nxt in pairs),
            "handoff_to_start_s": statistics.fmean(nxt[1] - nxt[0] for _, nxt in pairs),
        }


async def run(ns) -> None:
    batches = [int(b) for b in ns.batches.split(",")]
    acceptance = tuple(float(p) for p in ns.acceptance.split(",")) if ns.acceptance else None
    async with open_engine(ns.size, ns.layers, batches, ns.context, ns.tp, kernel_config(ns),
                           async_scheduling=False, speculative_tokens=ns.speculative_tokens,
                           speculative_acceptance=acceptance, fp8=ns.fp8) as engine:
        print("| batch | engine step ms | execute ms | sample ms (launch to read-back) | gap between executes ms "
              "| of it, to the hand-off ms | of it, hand-off to rank 0's start ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for rows in batches:
            with StepTimer() as timer:
                step, start, end = await engine_step_time(engine, rows, ns.context)
            s = timer.summary(start, end)
            print(f"| {rows} | {step * 1e3:.3f} | {s['execute_s'] * 1e3:.3f} | {s['sample_s'] * 1e3:.3f} | "
                  f"{s['gap_s'] * 1e3:.3f} | {s['to_handoff_s'] * 1e3:.3f} | {s['handoff_to_start_s'] * 1e3:.3f} |",
                  flush=True)
        if ns.host_profile:
            print(await host_profile(engine, batches[0], ns.context, top=28))


async def host_profile(engine, rows: int, context: int, top: int) -> str:
    """cProfile of rank 0's `execute` calls (its thread) over one engine_step_time (Python 3.12 allows one
    profiler at a time, so the loop's thread is not profiled with it)."""
    execute, on_rank = RankRuntime.execute, cProfile.Profile()

    def profiled(runtime, cmd, *args):
        if runtime.rank != 0:
            return execute(runtime, cmd, *args)
        on_rank.enable()
        try:
            return execute(runtime, cmd, *args)
        finally:
            on_rank.disable()

    RankRuntime.execute = profiled
    try:
        await engine_step_time(engine, rows, context)
    finally:
        RankRuntime.execute = execute
    text = io.StringIO()
    pstats.Stats(on_rank, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, batches="1,64")
    parser.add_argument("--host-profile", action="store_true", help="also cProfile rank 0's thread at the first batch")
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="the speculative step of K drafts a row (steps then yield up to K + 1 tokens a row)")
    parser.add_argument("--acceptance", default=None, metavar="P1,...",
                        help="with --speculative-tokens: emulate a trained head's acceptance per draft position")
    ns = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_engine_step needs a CUDA device")
        return 2
    asyncio.run(run(ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
