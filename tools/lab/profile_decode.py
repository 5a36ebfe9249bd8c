"""Where a decode step's GPU time goes: per-kernel time of the graph replay, and the gaps between kernels.

    python -m deltaserve.tools.lab.profile_decode --size 4b [--layers N] [--batches 1,64] [--context 1024] [--top 25] [--pdl off]
        [--speculative-tokens K]

Random bf16 weights (generated on the device), tp = 1. For each batch size the decode graph is replayed under
the torch profiler; kernels are grouped by name, with calls and GPU microseconds per step. "busy" is the sum of
kernel times of one step, "step" the replay time from CUDA events, and their difference the time the GPU spends
between kernels (launch latency, ramp and tail), which fusing kernels removes. With programmatic dependent launch
on (the default on sm90), each kernel starts while the one before drains and waits for it inside: its time then
holds that wait, and "between kernels" can turn negative (-872 us for the 4B batch-1 step: decode.md, "What bounds the 4B batch-1 step").
`--pdl off` gives each kernel's own time. With `--speculative-tokens K` the replayed graph is the speculative step
(the MTP head's K drafts, then the verify forward of K + 1 rows a request).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from deltaserve.devices.backend import StepShape
from deltaserve.tools.bench_decode import add_engine_args, kernel_config, open_engine
from deltaserve.tools.capture_check import rows_after_a_verify_step, time_per_call
from deltaserve.tools.live_rows import live_decode_batch


def _profile(replica, rank: int, rows: int, context: int, speculative: bool, steps: int = 5) -> dict:
    lookahead = replica.ranks[rank].runtime.state.speculative_tokens if speculative else 0
    with live_decode_batch(replica, rank, rows, context, lookahead) as (r, batch):
        runtime = r.runtime
        if speculative:  # the rows as after a verify step; its graph runs the drafts, then the verify forward
            rows_after_a_verify_step(runtime, rows, seed=rows)
        shape = StepShape(rows, runtime.state.speculative_tokens + 1 if speculative else 1)
        graphs, eager = runtime.graphs, runtime.program(shape)
        step_s = time_per_call(lambda: graphs(shape), r.backend.device, iters=50)
        per_name = _kernel_times(lambda: graphs(shape), steps)
        source = "speculative graph replay" if speculative else "graph replay"
        if not per_name:  # a profiler that cannot see inside graphs: the same kernels, launched eagerly
            per_name = _kernel_times(eager, steps)
            source = "eager step (the profiler saw no kernels inside the graph)"
    return {"rows": rows, "step_s": step_s, "kernels": per_name, "steps": steps, "source": source}


def _kernel_times(step, steps: int) -> dict[str, list[float]]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            per_name[event.name].append(event.device_time_total)
    return dict(per_name)


def report(result: dict, top: int) -> str:
    steps = result["steps"]
    rows = sorted(((sum(t) / steps, len(t) / steps, name) for name, t in result["kernels"].items()), reverse=True)
    busy_us = sum(t for t, _, _ in rows)
    calls = sum(c for _, c, _ in rows)
    step_us = result["step_s"] * 1e6
    lines = [f"batch {result['rows']} ({result['source']}): step {step_us:.0f} us, kernels busy {busy_us:.0f} us "
             f"({calls:.0f} kernels), between kernels {step_us - busy_us:.0f} us "
             f"({(step_us - busy_us) / max(calls, 1):.2f} us per kernel)",
             f"{'us/step':>9} {'calls':>6} {'us/call':>8}  kernel"]
    for t, c, name in rows[:top]:
        lines.append(f"{t:>9.1f} {c:>6.0f} {t / max(c, 1e-9):>8.2f}  {name[:110]}")
    return "\n".join(lines)


async def run(ns) -> list[dict]:
    batches = [int(b) for b in ns.batches.split(",")]
    async with open_engine(ns.size, ns.layers, batches, ns.context, ns.tp, kernel_config(ns),
                           speculative_tokens=ns.speculative_tokens, fp8=ns.fp8) as engine:
        replica = engine.replica
        out = []
        for rows in batches:
            per_rank = await replica.group.call(
                lambda rank: _profile(replica, rank, rows, ns.context, ns.speculative_tokens > 0))
            out.append(per_rank[0])
        return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, batches="1,64")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="profile the speculative step of K drafts a row")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        logging.error("profile_decode needs a CUDA device")
        return 2
    for result in asyncio.run(run(ns)):
        print(report(result, ns.top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
