"""What a prefill step costs beyond its math: kernels launched, GPU busy time and wall time per prompt length.

    python -m deltaserve.tools.lab.profile_prefill --size 4b [--layers N] [--tokens 16,512,2048,8192] [--prefix N]
        [--fp8] [--prefill-attention-splits N] [--prefill-token-budget N] [--kernel FIELD=VALUE]

Random bf16 weights on a CUDA device, tp = 1, one request at a time through `engine.generate` (max_tokens 1), so
its time to first token is one prefill step plus the sampler (or, with `--prefill-token-budget` below the prompt,
its chunks' steps, as the server runs them). Per prompt length: the median TTFT (no profiler), the prefill rate as
#30 counts it (the layers' projection FLOPs over the TTFT, against a large bf16 matmul's rate measured in the same
run), then under torch.profiler the kernels per request, their summed GPU time, and the kernels launched most.
When the GPU time is far below the TTFT and the kernel count is high, the step is launch-bound (host time per
launch); when they are close, it is the math. The profiled requests' wall time is split into the host's part before
their first kernel, the GPU's idle time between their kernels, and the host's part after the last. `--timeline`
prints one request's host events on the host clock (the loop's planning and hand-over, rank 0's launches and token
reads); `--host-profile N` where rank 0's thread spends its launch of a prefill of N tokens (cProfile, by own
time).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import dataclasses
import io
import logging
import math
import pstats
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from deltaserve.devices.capacity import PREFILL_TOKEN_BUDGET
from deltaserve.kernels.config import DEFAULT, KernelConfig
from deltaserve.model.config import load_model_config
from deltaserve.model.synthetic import write_checkpoint
from deltaserve.model.weights import expected_shapes
from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.tools.bench_decode import kernel_config
from deltaserve.tools.bench_kernels import ceilings


def projection_flops_per_token(cfg) -> int:
    """The matmul FLOPs of a prompt token in the decoder layers' projections (2 per weight element): attention
    scores, the GDN scan and the lm_head (one row a prompt) left out."""
    return 2 * sum(math.prod(shape) for name, shape in expected_shapes(cfg).items()
                   if name.startswith("layers.") and len(shape) == 2)


async def first_token_s(engine: AsyncEngine, n: int, seed: int, prefix: int = 0) -> float:
    """Seconds to the first token of an n-token prompt; with `prefix`, of n tokens after a cached prefix of that
    many (a request of the prefix alone runs first, untimed, so the timed one resumes from its snapshot)."""
    def ids(count, salt):
        return [(seed * 7919 + salt * 31 + i * 104729) % (engine.cfg.vocab_size - 1) for i in range(count)]

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    head = ids(prefix, 1)
    if prefix:
        async for _ in engine.generate(head, params):
            pass
    prompt = head + ids(n, 2)  # made before the clock starts: the engine's TTFT, not this tool's list
    started = time.perf_counter()
    async for out in engine.generate(prompt, params):
        if out.num_cached_tokens < prefix // engine.scheduler.page_size * engine.scheduler.page_size:
            raise RuntimeError(f"the prefix was not cached ({out.num_cached_tokens} of {prefix} tokens hit)")
        return time.perf_counter() - started
    raise RuntimeError("no output")


def prefill_kernel_config(ns) -> KernelConfig:
    cfg = kernel_config(ns)  # the --kernel overrides
    if ns.prefill_attention_splits is not None:
        cfg = dataclasses.replace(cfg, prefill_attention_splits=ns.prefill_attention_splits)
    return cfg


async def run(ns) -> list[dict]:
    lengths = [int(t) for t in ns.tokens.split(",")]
    rows = []
    _, matmul_flops = ceilings(torch.device("cuda"))  # before the engine takes the memory
    torch.cuda.empty_cache()  # and handed back for the engine's sizing
    with tempfile.TemporaryDirectory(prefix="profile_prefill_") as folder:
        write_checkpoint(folder, ns.size, layers=ns.layers, weights=False, fp8=ns.fp8)
        per_token = projection_flops_per_token(load_model_config(folder))
        args = EngineArgs(model=folder, device="cuda", load_format="random", max_batch=1, buckets=[1],
                          max_model_len=ns.prefix + max(lengths) + 8, prefill_slots=1,
                          prefill_token_budget=ns.prefill_token_budget or max([*lengths, ns.prefix]),
                          warmup=False, stats_interval_s=0,
                          enable_prefix_caching=ns.enable_prefix_caching or ns.prefix > 0,
                          prefill_graph_tokens=ns.prefill_graph_tokens, fp8_kernels=ns.fp8,
                          kernel_config=prefill_kernel_config(ns))
        async with AsyncEngine(args) as engine:
            for n in lengths:
                for i in range(2):  # compiles
                    await first_token_s(engine, n, i, ns.prefix)
                ttft = statistics.median([await first_token_s(engine, n, 10 + i, ns.prefix)
                                          for i in range(ns.repeats)])
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for i in range(3):  # the prefix's own requests count too: the timed ones' share is below
                        with record_function("timed request"):
                            await first_token_s(engine, n, 20 + i, ns.prefix)
                kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                timeline = _timeline(prof.events(), kernels)
                names = collections.Counter(e.name for e in kernels)
                busy = collections.Counter()
                for e in kernels:
                    busy[e.name[:60]] += e.time_range.elapsed_us() / 3
                rows.append({
                    "tokens": n, "ttft_ms": ttft * 1e3, "kernels": len(kernels) / 3,
                    "tflops": n * per_token / ttft / 1e12, "of_matmul": n * per_token / ttft / matmul_flops,
                    "gpu_ms": sum(e.time_range.elapsed_us() for e in kernels) / 3 / 1e3,
                    "top": [(name[:60], count // 3) for name, count in names.most_common(ns.top)],
                    "busiest": busy.most_common(ns.top), **timeline,
                })
            if ns.timeline:
                print(await request_timeline(engine, lengths[-1], ns))
            if ns.host_profile:
                print(await host_profile(engine, ns.host_profile))
    return rows


def _timeline(events, kernels) -> dict:
    """Where a request's wall time goes, medians over the profiled requests (us): the host before its first kernel
    starts, the span of its kernels less their own time (the GPU idle between them), and after its last kernel ends
    until the token is out."""
    before, between, after = [], [], []
    for request in (e for e in events if e.name == "timed request"):
        start, end = request.time_range.start, request.time_range.end
        mine = sorted((k.time_range.start, k.time_range.end) for k in kernels if start <= k.time_range.start <= end)
        if not mine:
            continue
        last_end = max(e for _, e in mine)
        before.append(mine[0][0] - start)
        after.append(end - last_end)
        between.append(last_end - mine[0][0] - sum(e - s for s, e in mine))
    med = statistics.median
    return {"host_before_us": med(before), "gpu_idle_us": med(between), "host_after_us": med(after)} if before else {}


async def request_timeline(engine: AsyncEngine, n: int, ns) -> str:
    """One request's host events in order, us from when it is queued (no profiler: it slows the host several times
    over): the loop's planning and hand-over, rank 0's step launches (its forward's launches within) and result
    reads, and when the loop got each result, so a first token that waits for more than its own step shows where."""
    runtime = engine.replica.ranks[0].runtime
    events = [(engine, "_add", "the request is checked and queued"),
              (engine, "_emit", "the loop hands outputs to their streams"),
              (engine.scheduler, "schedule", "the loop plans a step"),
              (engine, "_command", "the loop builds the step's command"),
              (engine.replica, "start_step", "the loop hands it over (waits for the ranks' launch, 2 ms at most)"),
              (runtime, "launch", "rank 0 launches a step"),
              (runtime.model, "prefill", "rank 0 launches a prefill forward"),
              (runtime, "finish", "rank 0 reads its tokens"),
              (engine, "_apply", "the loop applies a step's tokens")]
    rows = []

    def timed(name, fn):
        def call(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                rows.append((began, time.perf_counter(), name))
        return call

    originals = [(owner, attribute, getattr(owner, attribute)) for owner, attribute, _ in events]
    for (owner, attribute, name), (_, _, fn) in zip(events, originals):
        setattr(owner, attribute, timed(name, fn))
    try:
        for i in range(3):
            rows.clear()
            ttft = await first_token_s(engine, n, 40 + i, ns.prefix)
    finally:
        for owner, attribute, fn in originals:
            setattr(owner, attribute, fn)
    # The clock starts where the timed request is queued (its last `_add`), as first_token_s' own does, after the
    # prompt's list is made (and a prefix's request has run).
    started = max(began for began, _, name in rows if name == events[0][2])
    rows.append((started, started + ttft, "the request, to its first token"))
    return "\n".join(f"{(a - started) * 1e6:9.0f} {(b - started) * 1e6:9.0f}  {name}" for a, b, name in sorted(rows))


async def host_profile(engine: AsyncEngine, n: int) -> str:
    """cProfile of rank 0's launches of prefill steps (its thread only: the step's set-up, then its forward's
    launches; no wait for the GPU) over three prefills of n tokens."""
    runtime = engine.replica.ranks[0].runtime
    launch, profiler = runtime.launch, cProfile.Profile()

    def profiled(cmd, *args, **kwargs):
        if not cmd.prefill:
            return launch(cmd, *args, **kwargs)
        profiler.enable()
        try:
            return launch(cmd, *args, **kwargs)
        finally:
            profiler.disable()

    runtime.launch = profiled
    try:
        for i in range(3):
            await first_token_s(engine, n, 30 + i)
    finally:
        runtime.launch = launch
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", default="16,512,2048,8192")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="kernel names to list, by launches")
    parser.add_argument("--prefill-token-budget", type=int, default=0, metavar="N",
                        help=f"prompt tokens a step carries at most (0: the longest prompt's, one step a prompt; "
                             f"the server's is {PREFILL_TOKEN_BUDGET} where memory allows: a longer prompt runs in "
                             f"chunks)")
    parser.add_argument("--prefill-graph-tokens", type=int, default=EngineArgs.prefill_graph_tokens,
                        help="prefill steps of up to this many tokens replay a captured graph (0: none)")
    parser.add_argument("--prefix", type=int, default=0, metavar="N",
                        help="time each prompt after a cached prefix of N tokens (a chat's later turn); the "
                             "profile's kernels include the prefix's own prefill")
    parser.add_argument("--prefill-attention-splits", type=int, default=None, metavar="N",
                        help="most programs a query block's keys are shared over after a cached prefix "
                             f"(KernelConfig.prefill_attention_splits, {DEFAULT.prefill_attention_splits})")
    parser.add_argument("--kernel", action="append", default=[], metavar="FIELD=VALUE",
                        help="any KernelConfig field, VALUE a Python literal (a tile as a tuple, None); repeatable")
    parser.add_argument("--fp8", action="store_true",
                        help="an FP8 checkpoint's projections in FP8 (random, block-scaled) on the FP8 kernels")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="with the prefix cache on (every prompt differs: what a miss costs)")
    parser.add_argument("--timeline", action="store_true",
                        help="print one request's step launches and result reads (host clock) in time order")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also profile rank 0's host time in a prefill of N tokens")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        print("profile_prefill needs a CUDA device")
        return 2
    rows = asyncio.run(run(ns))
    print("| prompt tokens | TTFT ms (engine) | tokens/s | projection TFLOP/s (of the matmul rate) | kernels per "
          "request | GPU busy ms | GPU / TTFT | host before / GPU idle between kernels / host after, us (profiled) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        split = (f"{r['host_before_us']:.0f} / {r['gpu_idle_us']:.0f} / {r['host_after_us']:.0f}"
                 if "host_before_us" in r else "-")
        print(f"| {r['tokens']} | {r['ttft_ms']:.2f} | {r['tokens'] / r['ttft_ms'] * 1e3:.0f} | "
              f"{r['tflops']:.0f} ({r['of_matmul']:.0%}) | {r['kernels']:.0f} | {r['gpu_ms']:.2f} | "
              f"{r['gpu_ms'] / r['ttft_ms']:.2f} | {split} |")
    for r in rows:
        print(f"\n{r['tokens']} tokens, most launched: " + ", ".join(f"{n} x{c}" for n, c in r["top"]))
        print(f"{r['tokens']} tokens, most GPU time (us a request): "
              + ", ".join(f"{n} {us:.0f}" for n, us in r["busiest"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
