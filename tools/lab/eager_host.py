"""Where an eager decode step's time goes on the host: the Python time to launch it, the GPU time it queues, the
kernels it launches, and the functions that take the launch time (cProfile), at one batch size.

    python -m deltaserve.tools.lab.eager_host --size 27b --layers 16 --fp8 [--batches 1]

An eager step costs the larger of its launch time and its GPU time, plus any wait for the device inside it (a
host sync shows as a launch time above the GPU time). Runs on trees before the one-forward step too (they had
`model.decode`), so two trees can be compared in one device call.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from deltaserve.tools.bench_decode import add_engine_args, kernel_config, open_engine
from deltaserve.tools.live_rows import live_decode_batch


def _eager_step(r, batch):
    model, state = r.model, r.runtime.state
    if hasattr(model, "decode"):  # the older tree's entry point
        return lambda: model.decode(state, batch)
    from deltaserve.model.batch import StepBatch
    step = batch if isinstance(batch, StepBatch) else StepBatch.of(batch)
    return lambda: model.logits(model.forward(state, step))


def _measure(replica, rows: int, context: int) -> str:
    with live_decode_batch(replica, 0, rows, context) as (r, batch):
        step = _eager_step(r, batch)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        launch, total = [], []
        for _ in range(10):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            launch.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(e.device_time for e in kernels)
        profiler = cProfile.Profile()
        profiler.enable()
        step()
        profiler.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    return (f"batch {rows}: launch {min(launch) * 1e3:.2f} ms, launch + wait {min(total) * 1e3:.2f} ms, "
            f"GPU {gpu_us / 1e3:.2f} ms in {len(kernels)} kernels\n{out.getvalue()}")


async def main(ns) -> None:
    batches = [int(b) for b in ns.batches.split(",")]
    async with open_engine(ns.size, ns.layers, batches, ns.context, ns.tp, kernel_config(ns),
                           fp8=ns.fp8) as engine:
        replica = engine.replica
        for rows in batches:
            print(await replica.group.call(lambda rank: _measure(replica, rows, ns.context) if rank == 0 else None)
                  [0])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser, batches="1")
    asyncio.run(main(parser.parse_args()))
