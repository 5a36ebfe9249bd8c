"""The server's host path alone: an OpenAI server whose device takes a fixed time a step and answers a token for
every row, no model run. Point `deltaserve bench serve` at it to see what the host (engine, HTTP, the client on
the same machine) adds to a step: TPOT above `--step-ms` at a concurrency, or TTFT above it at one.

    python -m deltaserve.tools.lab.fake_device_server [--step-ms 7] [--port 8011] [--max-num-seqs 64]
        [--max-model-len 4096]

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

from deltaserve.devices.commands import SampledToken, StepResult
from deltaserve.model.synthetic import write_checkpoint
from deltaserve.runtime import AsyncEngine, EngineArgs
from deltaserve.runtime.cli import run


class FakeDevice:
    """Stands in for the replica's steps: each takes `step_s` once the step before it is done, then draws a token
    for every row (cycling through 50 ids, so the text changes); everything else goes to the real replica."""

    def __init__(self, real, step_s: float) -> None:
        self.real, self.step_s, self.steps = real, step_s, 0
        self._last: asyncio.Future | None = None

    def start_step(self, cmd, overlapped: bool = False):
        step = self._last = asyncio.ensure_future(self._run(cmd, self._last))
        return self._result(step)  # a coroutine, as the replica returns: the engine closes one it won't await

    @staticmethod
    async def _result(step: asyncio.Future) -> StepResult:
        return await step

    async def _run(self, cmd, before: asyncio.Future | None) -> StepResult:
        if before is not None:
            await asyncio.shield(before)
        if cmd.decode_tokens or cmd.prefill:
            await asyncio.sleep(self.step_s)
        self.steps += 1
        token = 7 + self.steps % 50
        return StepResult([SampledToken(token, -0.1) for _ in cmd.decode_tokens],
                          [SampledToken(token, -0.1) if p.last else None for p in cmd.prefill])

    def __getattr__(self, name):
        return getattr(self.real, name)


async def fake_engine(step_ms: float, max_batch: int, max_model_len: int = 4096) -> AsyncEngine:
    """A started engine on the tiny checkpoint whose replica is a `FakeDevice`."""
    folder = write_checkpoint(tempfile.mkdtemp(prefix="fake_device_"), "tiny")
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    text = config.get("text_config", config)  # the tiny model's 4096 positions, raised for long prompts
    text["max_position_embeddings"] = max(text["max_position_embeddings"], max_model_len)
    with open(path, "w") as f:
        json.dump(config, f)
    engine = AsyncEngine(EngineArgs(model=folder, max_batch=max_batch,
                                    max_model_len=max_model_len, cpu_memory_bytes=512 << 20, prefill_slots=4))
    await engine.start()
    engine.replica = FakeDevice(engine.replica, step_ms / 1e3)
    return engine


async def serve_forever(ns) -> None:
    from deltaserve.runtime.server import serve

    engine = await fake_engine(ns.step_ms, ns.max_num_seqs, ns.max_model_len)
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
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(serve_forever(ns))  # on uvloop, as the server runs
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
