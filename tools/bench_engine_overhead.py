"""Host overhead of the engine per decode step: scheduler, command building, token routing, detokenisation and
stop checks, with a device that answers instantly (no model runs).

    python -m deltaserve.tools.bench_engine_overhead [--batches 1,64] [--steps 400]

Reported as microseconds of event-loop time per decode step; a GPU step is milliseconds, so this must stay far
below it (target: at most 300 us at batch 64). The critical path is the part of it between a step's result and
the next step's hand-off to the ranks: with real devices the GPU idles for that long (the rest runs while it
works).

It also times a hand-off: how long after `WorkerGroup.submit` a rank's thread starts the step while the loop
thread keeps running Python (as it does making the last step's outputs), with the process's GIL switch interval
as the workers set it and as CPython leaves it; and a launch of 40 small torch calls (each gives the GIL up and
waits to get it back, as a step's launch does) beside a loop busy for 4 ms, then with the loop waiting for the
launch first, as `Replica.start_step` does.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time

from deltaserve.devices import worker
from deltaserve.devices.commands import SampledToken, StepResult
from deltaserve.devices.worker import WorkerGroup
from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.runtime.cli import run
from deltaserve.model.synthetic import write_checkpoint


class InstantReplica:
    """Stands in for the device ranks: every step returns at once with token 7 for every row. Records the time
    from each result to the next step's hand-off (the critical path)."""

    def __init__(self, real) -> None:
        self.real = real
        self.answered: float | None = None
        self.critical: list[float] = []

    def start_step(self, cmd, overlapped: bool = False):
        if self.answered is not None:
            self.critical.append(time.perf_counter() - self.answered)
        return self._answer(cmd)

    async def _answer(self, cmd) -> StepResult:
        await asyncio.sleep(0)  # the engine's other tasks run while a step is out, as with real devices
        decode = [SampledToken(7, -0.1) for _ in cmd.decode_tokens]
        prefill = [SampledToken(7, -0.1) if p.last else None for p in cmd.prefill]
        self.answered = time.perf_counter()
        return StepResult(decode, prefill)

    def __getattr__(self, name):
        return getattr(self.real, name)


async def measure(ckpt: str, batch: int, steps: int) -> float:
    args = EngineArgs(model=ckpt, max_batch=batch, max_model_len=steps + 64, cpu_memory_bytes=64 << 20,
                      prefill_slots=batch)
    async with AsyncEngine(args) as engine:
        loop = engine.steps  # the step loop hands its steps to a replica that answers at once
        loop.replica = InstantReplica(loop.replica)
        params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        streams = [engine.generate([5, 6, 7, 8], params) for _ in range(batch)]

        async def drain(s):
            async for out in s:
                pass
            return out

        started = time.perf_counter()
        outs = await asyncio.gather(*[drain(s) for s in streams])
        elapsed = time.perf_counter() - started
        critical = sorted(loop.replica.critical)
        loop.replica = loop.replica.real
        assert all(len(o.token_ids) == steps for o in outs)
    RESULTS.append((elapsed / steps * 1e6, critical[len(critical) // 2] * 1e6))


RESULTS: list[tuple[float, float]] = []


async def handoff_delay(busy_s: float = 0.02, trials: int = 7, statistic=statistics.median) -> float:
    """Seconds from a hand-off to the rank's start while the loop thread stays busy for busy_s: the median of
    `trials` (or another `statistic` of them)."""
    group = WorkerGroup(1)
    delays = []
    for _ in range(trials):
        handed = time.perf_counter()
        futures = group.submit(lambda rank: time.perf_counter())
        while time.perf_counter() - handed < busy_s:  # pure Python, holding the GIL
            pass
        delays.append((await group.gather(futures))[0] - handed)
    group.stop()
    return statistic(delays)


async def launch_time(wait_first: bool, calls: int = 40, busy_s: float = 0.004, trials: int = 7) -> float:
    """Median seconds from a hand-off to the end of a launch of `calls` torch calls, the loop thread busy for
    busy_s after the hand-off, or first waiting (GIL released, as start_step does) until the launch is done."""
    import threading

    import torch

    group, x, times = WorkerGroup(1), torch.zeros(16), []

    def launch(rank, done):
        for _ in range(calls):
            x.add_(1)
        done.set()
        return time.perf_counter()

    for _ in range(trials):
        done = threading.Event()
        handed = time.perf_counter()
        futures = group.submit(lambda rank: launch(rank, done))
        if wait_first:
            done.wait(0.002)
        while time.perf_counter() - handed < busy_s:  # the loop's outputs: pure Python, holding the GIL
            pass
        times.append((await group.gather(futures))[0] - handed)
    group.stop()
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=400)
    ns = parser.parse_args(argv)
    ckpt = write_checkpoint(tempfile.mkdtemp(prefix="overhead_"), "tiny", weights=True)
    print("| batch | host us per decode step | per row us | critical path us per step (median) |")
    print("|---:|---:|---:|---:|")
    for b in (int(x) for x in ns.batches.split(",")):
        run(measure(ckpt, b, ns.steps))  # on uvloop, as the server runs
        us, critical = RESULTS.pop()
        print(f"| {b} | {us:.0f} | {us / b:.1f} | {critical:.0f} |")
    ours = worker.WORKER_SWITCH_INTERVAL_S
    for interval in (ours, None):
        worker.WORKER_SWITCH_INTERVAL_S = interval
        delay = asyncio.run(handoff_delay())
        setting = f"{interval * 1e3:g} ms" if interval else f"CPython's {sys.getswitchinterval() * 1e3:g} ms"
        print(f"hand-off to a rank, loop thread busy 20 ms, switch interval {setting}: rank starts after "
              f"{delay * 1e3:.2f} ms (median of 7)")
    worker.WORKER_SWITCH_INTERVAL_S = ours
    for wait_first in (False, True):
        took = asyncio.run(launch_time(wait_first))
        print(f"a launch of 40 torch calls beside a loop busy 4 ms, {'the loop waiting for it first' if wait_first else 'the loop busy at once'}: "
              f"done {took * 1e3:.2f} ms after the hand-off (median of 7)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
