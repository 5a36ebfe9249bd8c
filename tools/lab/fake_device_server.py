"""The server's host path alone: an OpenAI server whose device takes a modelled time a step and answers a token
for every row, no model run. Point `deltaserve bench serve` at it to see what the host (engine, HTTP, the client on
the same machine) adds to a step: TPOT above `--step-ms` at a concurrency, or TTFT above it at one.

    python -m deltaserve.tools.lab.fake_device_server [--step-ms 7] [--port 8011] [--max-num-seqs 64]
        [--max-model-len 4096] [--step-ms-full BATCH_MS] [--prefill-us-per-token US] [--prefill-ms-fixed MS]
        [--step-latency-ratio R] [--graph-tokens N] [--launch-ms MS]

A step takes `--step-ms`; with `--step-ms-full`, a decode step's time grows linearly from `--step-ms` at one row to
that at `--max-num-seqs` rows, and with `--prefill-us-per-token` a step's prompt tokens add `--prefill-ms-fixed`
plus that much a token (a chunk costs what it costs alone beside decode rows, its own pass over the weights
included, as `profile_mixed_step` measures on a GPU). Feed it a GPU's measured step
times to see what the scheduler and the benchmark's ramp and tail make of them: the throughput a concurrency can
reach with that device and this host path. Each step reports its modelled time as the device's, so the step
budget learns it as it would on the GPU. With `--graph-tokens N` the scheduler rounds a step's prompt tokens down
to the sizes a CUDA engine with prefill graphs up to N tokens and fused mixed steps captures (the CPU engine has
none).

The engine is the tiny CPU checkpoint's (its 512-token vocabulary), with overlap scheduling as served; a step
starts when it is handed over and after the one before it, as on a GPU stream. Steps with nothing to compute
(retiring requests) take no time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from deltaserve.devices.commands import SampledToken, StepResult
from deltaserve.model.synthetic import write_checkpoint
from deltaserve.runtime import AsyncEngine, EngineArgs
from deltaserve.runtime.cli import run


@dataclass
class StepCost:
    """A step's modelled device time: a decode step linear in its rows between `one_row_s` and `full_s` (at
    `max_rows`), plus, with prompt tokens, `prefill_s` and `token_s` a token."""

    one_row_s: float
    full_s: float | None = None
    max_rows: int = 1
    token_s: float = 0.0
    prefill_s: float = 0.0

    def seconds(self, rows: int, prompt_tokens: int) -> float:
        decode = 0.0
        if rows:
            linear = self.full_s is not None and self.max_rows > 1
            per_row = (self.full_s - self.one_row_s) / (self.max_rows - 1) if linear else 0.0
            decode = self.one_row_s + per_row * (rows - 1)
        if not prompt_tokens:
            return decode
        if not self.token_s:
            return max(decode, self.one_row_s)
        return decode + self.prefill_s + prompt_tokens * self.token_s


class FakeDevice:
    """Stands in for the replica's steps: each takes its `StepCost` once the step before it is done, then draws a
    token for every row (cycling through 50 ids, so the text changes); everything else goes to the real replica.
    `launch_s`: how long a hand-over holds the caller, as `Replica.start_step` holds the loop while rank 0 launches
    (about a millisecond a step on a GPU)."""

    def __init__(self, real, cost: StepCost, launch_s: float = 0.0) -> None:
        self.real, self.cost, self.launch_s, self.steps = real, cost, launch_s, 0
        self._last: asyncio.Future | None = None
        self._free_at = 0.0  # when the device finishes the steps handed over so far (time.perf_counter)

    def start_step(self, cmd, overlapped: bool = False):
        if self.launch_s:
            time.sleep(self.launch_s)
        # The device's timeline is kept apart from the loop's: a step starts when handed over or when the one before
        # it ends, whichever is later, however late the loop (busy with the host path it measures) notices an end.
        seconds = self.cost.seconds(len(cmd.decode_tokens), sum(len(p.token_ids) for p in cmd.prefill))
        self._free_at = max(time.perf_counter(), self._free_at) + seconds
        step = self._last = asyncio.ensure_future(self._run(cmd, self._last, self._free_at, seconds))
        return self._result(step)  # a coroutine, as the replica returns: the engine closes one it won't await

    @staticmethod
    async def _result(step: asyncio.Future) -> StepResult:
        return await step

    async def _run(self, cmd, before: asyncio.Future | None, end: float, seconds: float) -> StepResult:
        if before is not None:
            await asyncio.shield(before)
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        self.steps += 1
        token = 7 + self.steps % 50
        return StepResult([SampledToken(token, -0.1) for _ in cmd.decode_tokens],
                          [SampledToken(token, -0.1) if p.last else None for p in cmd.prefill],
                          device_seconds=seconds)

    def __getattr__(self, name):
        return getattr(self.real, name)


async def fake_engine(step_ms: float, max_batch: int, max_model_len: int = 4096, step_ms_full: float | None = None,
                      prefill_us_per_token: float = 0.0, prefill_ms_fixed: float = 0.0,
                      step_latency_ratio: float | None = None, graph_tokens: int = 0,
                      launch_ms: float = 0.0) -> AsyncEngine:
    """A started engine on the tiny checkpoint whose replica is a `FakeDevice` (times as `StepCost`'s), its step
    budget taught the modelled times as a GPU engine's warm-up teaches it; with `graph_tokens`, its scheduler keeps
    to a CUDA engine's prefill and mixed graph sizes."""
    from deltaserve.devices.replica import mixed_graph_buckets, prefill_graph_buckets

    folder = write_checkpoint(tempfile.mkdtemp(prefix="fake_device_"), "tiny")
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    text = config.get("text_config", config)  # the tiny model's 4096 positions, raised for long prompts
    text["max_position_embeddings"] = max(text["max_position_embeddings"], max_model_len)
    with open(path, "w") as f:
        json.dump(config, f)
    served = {} if step_latency_ratio is None else {"step_latency_ratio": step_latency_ratio}
    engine = AsyncEngine(EngineArgs(model=folder, max_batch=max_batch, max_model_len=max_model_len,
                                    cpu_memory_bytes=512 << 20, prefill_slots=4, **served))
    await engine.start()
    cost = StepCost(step_ms / 1e3, None if step_ms_full is None else step_ms_full / 1e3, max_batch,
                    prefill_us_per_token / 1e6, prefill_ms_fixed / 1e3)
    engine.steps.replica = FakeDevice(engine.replica, cost, launch_ms / 1e3)  # where the step loop hands steps
    # What a GPU engine's warm-up teaches the step budget before the first request: each bucket's decode step and
    # prefill chunks of two sizes (without it a burst's first mixed steps would carry whole chunks).
    for bucket in engine.scheduler.buckets:
        engine.scheduler.step_budget.observe(bucket, 0, cost.seconds(bucket, 0))
    for tokens in (256, 2048):
        engine.scheduler.step_budget.observe(0, tokens, cost.seconds(0, tokens))
    if graph_tokens:
        engine.scheduler.prefill_graph_sizes = prefill_graph_buckets(graph_tokens)
        engine.scheduler.mixed_graph_sizes = mixed_graph_buckets(engine.scheduler.prefill_graph_sizes)
    return engine


async def serve_forever(ns) -> None:
    from deltaserve.runtime.server import serve

    engine = await fake_engine(ns.step_ms, ns.max_num_seqs, ns.max_model_len, ns.step_ms_full,
                               ns.prefill_us_per_token, ns.prefill_ms_fixed, ns.step_latency_ratio, ns.graph_tokens,
                               ns.launch_ms)
    await serve(engine, "127.0.0.1", ns.port)
    logging.getLogger(__name__).info("fake device (%.1f ms a step) serving on http://127.0.0.1:%d", ns.step_ms,
                                     ns.port)
    await asyncio.Event().wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=7.0)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096, help="long prompts: a chat's later turns")
    parser.add_argument("--step-ms-full", type=float, default=None,
                        help="a decode step's time at --max-num-seqs rows (none: every step takes --step-ms)")
    parser.add_argument("--prefill-us-per-token", type=float, default=0.0,
                        help="what each prompt token adds to a step (0: a step with prompt tokens takes --step-ms)")
    parser.add_argument("--prefill-ms-fixed", type=float, default=0.0,
                        help="what a step's prompt tokens add besides theirs (a pass over the weights)")
    parser.add_argument("--step-latency-ratio", type=float, default=None, help="the engine's (none: its default)")
    parser.add_argument("--graph-tokens", type=int, default=0,
                        help="round steps' prompt tokens to the graph sizes of a CUDA engine with prefill graphs up "
                             "to N tokens and fused mixed steps (0: none, as the CPU engine)")
    parser.add_argument("--launch-ms", type=float, default=0.0,
                        help="how long a step's hand-over holds the event loop (rank 0's launch on a GPU: ~1 ms)")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(serve_forever(ns))  # on uvloop, as the server runs
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
