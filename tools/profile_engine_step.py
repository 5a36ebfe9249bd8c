"""Where a decode step's wall time goes when it runs through the engine, against the step on the GPU.

    python -m tools.profile_engine_step --size 4b [--layers N] [--batches 1,64] [--context 1024]

Random bf16 weights on a CUDA device (`tools.bench_decode`'s engine), tp = 1. For each batch size, `rows` greedy
requests stream through `engine.generate` (as in bench_decode's engine column) while rank 0's `execute` and
`_sample` are timed. Printed per batch: the engine's step; `execute`, the device thread's whole step (inputs, the
graph's launch, sampling, the read-back); `sample`, the part of it from the sampler's launch to the read-back
(it includes waiting for the forward); and the gap between two `execute`s, the host time on the event loop
(results routed, the next step scheduled) during which the GPU has nothing queued. All are means over the
window in which every request decodes, so `execute` and the gap add up to the engine's step.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import torch

from devices.rank import RankRuntime
from tools.bench_decode import add_engine_args, engine_step_time, open_engine


class StepTimer:
    """Wraps RankRuntime.execute and _sample to record, for each of rank 0's steps, when it started and ended and
    how long its sampling took."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float]] = []  # (start, end, seconds in _sample)
        self._sampling = 0.0
        execute, sample = RankRuntime.execute, RankRuntime._sample
        timer = self

        def timed_execute(runtime, cmd):
            if runtime.rank == 0:  # only rank 0 samples
                timer._sampling = 0.0
            started = time.perf_counter()
            try:
                return execute(runtime, cmd)
            finally:
                if runtime.rank == 0:
                    timer.steps.append((started, time.perf_counter(), timer._sampling))

        def timed_sample(runtime, logits, setup):
            started = time.perf_counter()
            try:
                return sample(runtime, logits, setup)
            finally:
                timer._sampling += time.perf_counter() - started

        RankRuntime.execute, RankRuntime._sample = timed_execute, timed_sample

    def summary(self, start: float, end: float) -> dict:
        """Means over the steps inside [start, end]: the window in which every request decodes (before it the
        batch fills up, after it the batch drains). Means, as the engine step is one: execute + gap add up to it."""
        spans = [s for s in self.steps if start <= s[0] and s[1] <= end]
        return {
            "execute_s": statistics.fmean(b - a for a, b, _ in spans),
            "gap_s": statistics.fmean(spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)),
            "sample_s": statistics.fmean(s for _, _, s in spans),
        }


async def run(ns) -> None:
    batches = [int(b) for b in ns.batches.split(",")]
    timer = StepTimer()
    async with open_engine(ns.size, ns.layers, batches, ns.context, ns.tp) as engine:
        print("| batch | engine step ms | execute ms | sample ms (launch to read-back) | gap between executes ms |")
        print("|---:|---:|---:|---:|---:|")
        for rows in batches:
            timer.steps.clear()
            step, start, end = await engine_step_time(engine, rows, ns.context)
            s = timer.summary(start, end)
            print(f"| {rows} | {step * 1e3:.3f} | {s['execute_s'] * 1e3:.3f} | {s['sample_s'] * 1e3:.3f} | "
                  f"{s['gap_s'] * 1e3:.3f} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, batches="1,64")
    ns = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_engine_step needs a CUDA device")
        return 2
    asyncio.run(run(ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
