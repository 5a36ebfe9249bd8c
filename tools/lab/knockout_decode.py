"""What each small kernel costs the decode step: the graph step with every launch of one kernel skipped.

    python -m deltaserve.tools.lab.knockout_decode --size 4b [--batches 1] [--context 1024] [--kernels NAME,NAME] [--pdl off]

A kernel's own time (`tools.profile_decode --pdl off`) is not what it costs the step: under programmatic
dependent launch its launch hides behind the kernel before it, while its wait, its loads' latency and its tail
stay on the step's path. This tool measures that cost directly. For each named Triton kernel of
the kernel modules (`kernels.norm`, `kernels.gemv`, ...) it opens an engine whose launches of that kernel do nothing, captures the decode graph and
times its replay; a baseline engine with every kernel is timed before and after the knockouts. The outputs are
wrong by design (the skipped kernel's output buffers stay unwritten), so only the times mean anything. Random
bf16 weights, tp = 1.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import sys

import torch

from deltaserve.devices.backend import StepShape
from deltaserve.kernels import attention, conv1d, gdn, gemv, norm
from deltaserve.tools.bench_decode import add_engine_args, kernel_config, open_engine
from deltaserve.tools.capture_check import time_per_call
from deltaserve.tools.live_rows import live_decode_batch

# The decode step's kernels other than the projections (a GEMV's cost is mostly its weights' bytes).
SMALL_KERNELS = ("_conv1d_decode_kernel", "_gdn_decode_kernel", "_gated_rms_norm_kernel",
                 "_qk_norm_rope_cache_kernel", "_decode_attn_kernel", "_merge_splits_kernel", "_rms_norm_kernel")


class SkippedLaunches:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches nothing and counts the call."""

    def __init__(self) -> None:
        self.calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls += 1

        return launch


def _step_time(replica, rank: int, rows: int, context: int, stand_in: SkippedLaunches | None) -> tuple[float, int]:
    """(seconds per graph replay, the stand-in's launches in one eager step, or 0 without one)."""
    with live_decode_batch(replica, rank, rows, context) as (r, batch):
        seconds = time_per_call(lambda: r.runtime.graphs(StepShape(rows)), r.backend.device, iters=100)
        calls = 0
        if stand_in is not None:
            stand_in.calls = 0
            r.model.logits(r.model.forward(r.runtime.state, batch))
            calls = stand_in.calls
        return seconds, calls


def _home(name: str):
    """The kernel module that defines the Triton kernel `name`."""
    for module in (norm, gemv, conv1d, gdn, attention):
        if hasattr(module, name):
            return module
    raise ValueError(f"--kernels: no kernel module has a kernel {name!r}")


async def _measure(ns, rows: int, knocked_out: str | None) -> tuple[float, int]:
    """The graph step of `rows` rows, with every launch of the kernel named `knocked_out` skipped (if given)."""
    original = getattr(_home(knocked_out), knocked_out) if knocked_out else None
    stand_in = SkippedLaunches() if knocked_out else None
    if knocked_out:
        setattr(_home(knocked_out), knocked_out, stand_in)
    try:
        async with open_engine(ns.size, ns.layers, [rows], ns.context, ns.tp, kernel_config(ns), fp8=ns.fp8) as engine:
            replica = engine.replica
            return (await replica.group.call(lambda rank: _step_time(replica, rank, rows, ns.context, stand_in)))[0]
    finally:
        if knocked_out:
            setattr(_home(knocked_out), knocked_out, original)


async def run(ns) -> list[str]:
    kernels = [k for k in ns.kernels.split(",") if k]
    for name in kernels:
        _home(name)
    lines = []
    for rows in (int(b) for b in ns.batches.split(",")):
        before, _ = await _measure(ns, rows, None)
        knocked = [(name, *await _measure(ns, rows, name)) for name in kernels]
        after, _ = await _measure(ns, rows, None)
        base = (before + after) / 2
        lines += [f"batch {rows}: step with every kernel {before * 1e3:.3f} ms before the knockouts, "
                  f"{after * 1e3:.3f} ms after", "",
                  "| kernel skipped | launches a step | step ms | step saved µs | saved a launch µs |",
                  "|---|---:|---:|---:|---:|"]
        for name, seconds, calls in knocked:
            saved = (base - seconds) * 1e6
            lines.append(f"| `{name}` | {calls} | {seconds * 1e3:.3f} | {saved:.1f} | "
                         f"{saved / calls if calls else float('nan'):.2f} |")
        lines.append("")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, batches="1")
    parser.add_argument("--kernels", default=",".join(SMALL_KERNELS),
                        help="Triton kernels of the kernel modules to skip, one at a time")
    ns = parser.parse_args(argv)
    if ns.tp != 1:  # the stand-in's launch count is one rank's
        parser.error("--tp: knockout_decode times one rank's step; run it with --tp 1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        logging.error("knockout_decode needs a CUDA device")
        return 2
    lines = asyncio.run(run(ns))
    print(f"{datetime.date.today()} {torch.cuda.get_device_name()} `python -m deltaserve.tools.lab.knockout_decode "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
