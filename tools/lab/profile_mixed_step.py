"""What a prompt chunk adds to a decode step: the engine serving `rows` streams, profiled while they only decode,
then while `chunks` prompts of `prompt` tokens keep arriving beside them (a prompt step every few steps, as under
load). Per window: the steps' device time (`StepResult.device_seconds`), the GPU kernels' busy time a step, and
the kernels whose time a step grew most from the first window to the second.

    python -m deltaserve.tools.lab.profile_mixed_step --size 4b [--layers N] [--rows 60] [--prompt 256]
        [--chunks 4] [--steps 40] [--fused-mixed-steps]

A window's busy time is over all its steps (the mixed window's include decode-only ones); the kernels of a prompt
step are printed apart: its device time far above them is the device waiting for the host inside the step;
kernels grown by more than the chunk's own prefill are the chunk's interference with the decode rows. Random bf16
weights on a CUDA device, tp = 1, the step budget off (each prompt step carries the whole chunks), no prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from deltaserve.model.synthetic import write_checkpoint
from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams


async def _window(engine, steps: int, feed=None) -> dict:
    """Profile the engine until `steps` steps of the window's kind ran: decode-only ones, or with `feed` (a
    coroutine function that keeps prompts arriving) ones carrying prompt tokens beside the decode rows."""
    kind: list[tuple[int, float]] = []  # (prompt tokens, device seconds) of the window's steps
    every = [0]  # all steps while profiling: the kernel totals cover them

    def record(step):
        every[0] += 1
        tokens = sum(w.length for w in step.plan.prefill)
        if step.plan.decode_ids and (tokens > 0) == (feed is not None):
            kind.append((tokens, step.device_seconds))

    engine.steps.observers.append(record)
    feeder = asyncio.get_running_loop().create_task(feed()) if feed else None
    cuda = torch.cuda.is_available() and engine.args.device == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            while len(kind) < steps:
                if feeder is not None and feeder.done():
                    feeder.result()  # its error, if it ended on one
                if not engine.scheduler.decode_slots:
                    raise RuntimeError("the decoding streams ended before the window did: fewer --steps")
                await asyncio.sleep(0.005)
            if cuda:
                torch.cuda.synchronize()
    finally:
        engine.steps.observers.remove(record)
        if feeder is not None:
            feeder.cancel()
    per_name: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            per_name[event.name] += event.device_time_total
    return {"kind": kind, "all_steps": every[0], "kernels_us": dict(per_name)}


def _report(name: str, window: dict) -> str:
    device_ms = sorted(s * 1e3 for _, s in window["kind"])
    tokens = statistics.median(t for t, _ in window["kind"])
    busy = sum(window["kernels_us"].values()) / window["all_steps"]
    return (f"{name}: {len(device_ms)} steps ({window['all_steps']} in the window), prompt tokens a step "
            f"{tokens:.0f}, device time median {statistics.median(device_ms):.2f} ms, p90 "
            f"{device_ms[int(0.9 * (len(device_ms) - 1))]:.2f} ms; kernels busy {busy / 1e3:.2f} ms a step of the "
            f"window")


async def measure(engine, rows: int, prompt: int, chunks: int, steps: int) -> tuple[dict, dict]:
    """The two windows (`_window`) on an engine with room for `rows` + `chunks` requests."""
    endless = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - 16, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = min(engine.cfg.vocab_size, 5000) - 1
    streams = [asyncio.get_running_loop().create_task(_drain(engine.generate(
        [(7 * i + j) % vocab + 1 for j in range(16)], endless))) for i in range(rows)]
    try:
        while len(engine.scheduler.decode_slots) < rows:
            await asyncio.sleep(0.01)

        async def feed():
            n = 0
            while True:  # `chunks` prompts at a time, the next ones once they are done
                n += 1
                await asyncio.gather(*[_drain(engine.generate(
                    [(n * 131 + c * 17 + j) % vocab + 1 for j in range(prompt)], one)) for c in range(chunks)])

        return await _window(engine, steps), await _window(engine, steps, feed)
    finally:
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)


async def run(ns) -> None:
    with tempfile.TemporaryDirectory(prefix="profile_mixed_") as folder:
        write_checkpoint(folder, ns.size, layers=ns.layers, weights=False)
        args = EngineArgs(model=folder, device="cuda", load_format="random", max_batch=ns.rows + ns.chunks,
                          max_model_len=8192, prefill_slots=ns.chunks, prefill_token_budget=ns.chunks * ns.prompt,
                          step_latency_ratio=0, enable_prefix_caching=False, fused_mixed_steps=ns.fused_mixed_steps)
        async with AsyncEngine(args) as engine:
            decode, mixed = await measure(engine, ns.rows, ns.prompt, ns.chunks, ns.steps)
    print(_report("decode only", decode))
    print(_report("with prompts", mixed))
    # The mixed window's kernels over what its steps would have run decoding only, charged to its prompt steps.
    per_decode_step = {k: v / decode["all_steps"] for k, v in decode["kernels_us"].items()}
    grown = sorted((((mixed["kernels_us"].get(k, 0.0) - per_decode_step.get(k, 0.0) * mixed["all_steps"])
                     / len(mixed["kind"])), k) for k in set(mixed["kernels_us"]) | set(per_decode_step))
    decode_busy, added = sum(per_decode_step.values()), sum(us for us, _ in grown)
    print(f"kernels a prompt step: {(decode_busy + added) / 1e3:.2f} ms (a decode-only step's {decode_busy / 1e3:.2f} "
          f"plus {added / 1e3:.2f} ms its prompt tokens added)")
    print(f"{'us/step':>9}  kernel (what a prompt step added, most first)")
    for us, name in reversed(grown[-ns.top:]):
        print(f"{us:>9.1f}  {name[:110]}")


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--prompt", type=int, default=256, help="tokens a prompt")
    parser.add_argument("--chunks", type=int, default=4, help="prompts arriving together (prefill slots)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fused-mixed-steps", action=argparse.BooleanOptionalAction, default=None,
                        help="prompt steps run the decode rows and chunks as one forward (EngineArgs.fused_mixed_steps; "
                             "default: the engine's)")
    parser.add_argument("--top", type=int, default=20)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        logging.error("profile_mixed_step needs a CUDA device")
        return 2
    asyncio.run(run(ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
