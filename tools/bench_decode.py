"""Decode step benchmark on a GPU: CUDA-graph replay and eager step per batch size, against the HBM floor.

    python -m deltaserve.tools.bench_decode --size 4b [--layers N] [--batches 1,8,32,64] [--context 1024] [--tp 1]
        [--speculative-tokens K [--acceptance P1,...] [--draft-vocab N]]

Weights are random (generated on the device). The floor of a step is the bytes it must move (every weight
read once, the lm_head in full, the embedding rows of the batch; GDN conv and recurrent state read and
written; the KV of every live token read, the new token's K/V written) over the device-to-device copy
bandwidth measured in the same run. Step = embedding to logits (sampling is timed separately). The engine
column is what users get: the time per decode step of `rows` concurrent greedy requests streamed through
`engine.generate` (scheduler, graph replay, sampling, token routing, detokenisation), while all of them decode.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import dataclasses
import datetime
import logging
import sys
import tempfile
import time

import torch

from deltaserve.devices.backend import StepShape
from deltaserve.kernels.config import DEFAULT, KernelConfig
from deltaserve.kernels.sampling import SamplingTensors
from deltaserve.kernels.triton_sampling import draw
from deltaserve.model.sharding import LocalSizes
from deltaserve.model.state import StateSizes
from deltaserve.model.weights import weight_bytes
from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.runtime.speculation import SpeculationOverride
from deltaserve.tools.capture_check import time_per_call
from deltaserve.tools.live_rows import live_decode_batch
from deltaserve.model.synthetic import write_checkpoint


def copy_bandwidth(device, gib: float = 4.0) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = time_per_call(lambda: dst.copy_(src), device, iters=10)
    return 2 * n * 2 / seconds


def step_bytes(cfg, weights, tp: int, dtype, rows: int, context: int) -> int:
    sizes = StateSizes.of(cfg, LocalSizes.of(cfg, tp), dtype)
    read = weight_bytes(weights)
    if cfg.is_moe:  # a layer reads only the experts its rows chose: with random routing, E (1 - (1 - k/E)^rows)
        experts = [t for name, t in weights.items() if ".mlp.experts." in name]
        held = sum(t.numel() * t.element_size() for t in experts)
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        read -= held - held * (1 - (1 - k / E) ** rows)
    embed = weights["embed_tokens.weight"]
    if not cfg.tie_word_embeddings:  # only the batch's rows of the embedding are read
        read -= embed.numel() * embed.element_size() - rows * embed.shape[1] * embed.element_size()
    state = 2 * rows * sizes.bytes_per_slot
    kv_per_token = sizes.kv_bytes_per_page // 16
    kv = rows * context * kv_per_token + rows * kv_per_token
    return read + state + kv


@contextlib.asynccontextmanager
async def open_engine(size: str, layers: int | None, batches: list[int], context: int, tp: int,
                      kernel_config: KernelConfig | None = None, async_scheduling: bool = True,
                      speculative_tokens: int = 0, speculative_acceptance: tuple[float, ...] | None = None,
                      draft_vocab: int = 0, fp8: bool = False, fp8_draft_head: bool = True):
    """An engine on random bf16 weights of a `size`-shaped config, with a graph bucket for each batch size; fp8:
    the projections an FP8 checkpoint holds in FP8 random FP8, on the FP8 kernels."""
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as folder:
        write_checkpoint(folder, size, layers=layers, weights=False, fp8=fp8)
        args = EngineArgs(model=folder, device="cuda", tp=tp, load_format="random", max_batch=max(batches),
                          # the engine column's requests: a prompt of `context` and up to ~1k tokens out
                          max_model_len=context + 1280, buckets=sorted(set(batches)), prefill_slots=1,
                          prefill_token_budget=512, kernel_config=kernel_config,
                          async_scheduling=async_scheduling, speculative_tokens=speculative_tokens,
                          speculative_adaptive=False, speculative_draft_vocab=draft_vocab, fp8_kernels=fp8,
                          speculative_fp8_draft_head=fp8_draft_head)
        override = SpeculationOverride(acceptance=speculative_acceptance)
        async with AsyncEngine(args, speculation_override=override) as engine:
            yield engine


async def run(ns) -> list[dict]:
    batches = [int(b) for b in ns.batches.split(",")]
    results = []
    async with open_engine(ns.size, ns.layers, batches, ns.context, ns.tp, kernel_config(ns),
                           ns.async_scheduling, fp8=ns.fp8) as engine:
        replica = engine.replica
        bw = await replica.group.call(lambda rank: copy_bandwidth(replica.ranks[rank].backend.device))
        engine_steps = {rows: (await engine_step_time(engine, rows, ns.context))[0] for rows in batches}
        for rows in batches:
            per_rank = await replica.group.call(lambda rank: _measure(replica, rank, rows, ns.context))
            r = dict(per_rank[0])
            weights = replica.ranks[0].model.w
            r["floor_s"] = step_bytes(engine.cfg, weights, ns.tp, torch.bfloat16, rows, ns.context) / min(bw)
            r["copy_tbps"] = min(bw) / 1e12
            r["engine_s"] = engine_steps[rows]
            results.append(r)
    return results


async def engine_step_time(engine, rows: int, context: int,
                           window_tokens: int = 128) -> tuple[float, float, float]:
    """Seconds per decode step seen through `engine.generate` by `rows` concurrent greedy requests with prompts
    of `context` tokens, over the window in which all of them decode (from the last one's first token to the
    first one's last token), and that window's start and end (`time.perf_counter`)."""
    prefill_steps = rows * -(-context // engine.replica.prefill_token_budget)  # admissions come one after another
    params = SamplingParams(max_tokens=prefill_steps + window_tokens, temperature=0, ignore_eos=True)
    prompt = [5 + i % 1000 for i in range(context)]

    async def marks(stream):
        seen = []
        async for out in stream:
            seen.append((time.perf_counter(), out.num_tokens))
        return seen

    runs = await asyncio.gather(*[marks(engine.generate(prompt, params)) for _ in range(rows)])
    start, end = max(r[0][0] for r in runs), min(r[-1][0] for r in runs)

    def tokens_at(seen, t):
        return max((n for when, n in seen if when <= t), default=0)

    steps = sorted(tokens_at(r, end) - tokens_at(r, start) for r in runs)[rows // 2]
    if steps < window_tokens // 2:
        raise RuntimeError(f"batch {rows}: only {steps} steps with every request decoding; raise window_tokens")
    return (end - start) / steps, start, end


async def speculative_run(ns) -> str:
    """`--speculative-tokens K`: the engine column (seconds per decode step through `generate`) of an engine
    drafting K tokens a step with the MTP head against one without, per batch size. With random weights the head's
    drafts are all but never accepted, so a speculative step yields one token: the ratio is what verifying K + 1
    tokens a row (and drafting) costs over a one-token step. `--acceptance P1,...` emulates a trained head's
    acceptance (`SpeculationOverride.acceptance`): the TPOT column is then what such a head gives, beside the
    step time over the expected tokens a step (1 + P1 + ... + PK: the Pj are per-position rates)."""
    batches = [int(b) for b in ns.batches.split(",")]
    steps, kept, tpot = {}, {}, {}
    acceptance = tuple(float(p) for p in ns.acceptance.split(",")) if ns.acceptance else None
    for k in (0, ns.speculative_tokens):
        async with open_engine(ns.size, ns.layers, batches, ns.context, ns.tp, kernel_config(ns),
                               ns.async_scheduling, speculative_tokens=k,
                               speculative_acceptance=acceptance if k else None,
                               draft_vocab=ns.draft_vocab if k else 0, fp8=ns.fp8,
                               fp8_draft_head=ns.fp8_draft_head) as engine:
            for rows in batches:
                m = engine.metrics
                drafted, accepted = m.spec_drafts._value.get(), m.spec_accepted._value.get()
                # An emulated acceptance keeps a random number of tokens a step (sd about 1.3): over 128 tokens,
                # some 32 steps, their mean has a standard error of 0.23 (6%); over 1024, 2%.
                window = 1024 if acceptance and k else 128
                per_token = (await engine_step_time(engine, rows, ns.context, window))[0]
                drafted, accepted = m.spec_drafts._value.get() - drafted, m.spec_accepted._value.get() - accepted
                tokens_per_step = 1 + (accepted * k / drafted if drafted else 0)
                steps[rows, k], kept[rows, k] = per_token * tokens_per_step, tokens_per_step
                tpot[rows, k] = per_token
    k = ns.speculative_tokens
    expected = 1.0 + sum(acceptance or ())
    source = f"emulated {ns.acceptance}" if acceptance else "the random head's"
    lines = [f"{ns.size} ({ns.layers or 'all'} layers), tp={ns.tp}, bf16, context {ns.context}, random weights; "
             f"engine step through generate, greedy; acceptance {source}"
             + (f"; drafts among the first {ns.draft_vocab} token ids" if ns.draft_vocab else "")
             + f"; draft head {'FP8' if ns.fp8_draft_head else 'bf16'}", "",
             f"| batch | step ms, plain | step ms, {k} drafts | speculative / plain | tokens a speculative step "
             f"| TPOT ms, plain | TPOT ms, speculative | step / expected tokens ({expected:.3f}) ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rows in batches:
        lines.append(f"| {rows} | {steps[rows, 0] * 1e3:.3f} | {steps[rows, k] * 1e3:.3f} | "
                     f"{steps[rows, k] / steps[rows, 0]:.2f}x | {kept[rows, k]:.2f} | {tpot[rows, 0] * 1e3:.3f} | "
                     f"{tpot[rows, k] * 1e3:.3f} | {steps[rows, k] / expected * 1e3:.3f} |")
    return "\n".join(lines)


def _measure(replica, rank, rows, context):
    with live_decode_batch(replica, rank, rows, context) as (r, batch):
        runtime, model, graphs, shape = r.runtime, r.model, r.runtime.graphs, StepShape(rows)
        eager = time_per_call(lambda: model.logits(model.forward(runtime.state, batch)), r.backend.device, iters=10)
        replay = time_per_call(lambda: graphs(shape), r.backend.device, iters=50)
        logits = graphs(shape).row_logits
        # What the engine runs after the replay: the Triton sampler (Qwen's default filters, and greedy).
        p = SamplingTensors.filled(rows, logits.device, temperature=0.7, top_k=20, top_p=0.8, seeds=1)
        # No row has top-p without top-k, so, as in the engine, no top-p race rounds.
        sampled = time_per_call(lambda: draw(logits, p, top_p_rounds=0), r.backend.device, iters=20)
        p = SamplingTensors.filled(rows, logits.device, temperature=0.0)
        greedy = time_per_call(lambda: draw(logits, p, top_p_rounds=0), r.backend.device, iters=20)
        return {"batch": rows, "eager_s": eager, "replay_s": replay, "sample_s": sampled, "greedy_s": greedy}


def table(ns, results) -> str:
    k = kernel_config(ns)
    lines = [
        f"{ns.size} ({ns.layers or 'all'} layers), tp={ns.tp}, bf16{', FP8 projections' if ns.fp8 else ''}, "
        f"context {ns.context}, "
        f"copy bandwidth {results[0]['copy_tbps']:.2f} TB/s; one-row projections by "
        f"{'the Triton GEMV' if k.gemv_one_row else 'cuBLAS'}; input add-and-norms "
        f"{'fused into the one-row projections' if k.gemv_one_row and k.fused_norm else 'by their own kernel'}; "
        f"one-row GEMVs {'over whole weight rows where K splits' if k.whole_rows else 'by K tiles'}; "
        f"decode kernels launched {'with' if k.pdl else 'without'} programmatic dependent launch",
        "",
        "| batch | graph step ms | eager step ms | graph/eager speed-up | tokens/s (graph) | HBM floor ms "
        "| graph / floor | sampling ms (T 0.7, top-k 20, top-p 0.8) | greedy ms | engine step ms (generate, greedy) "
        "| engine / graph |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['batch']} | {r['replay_s'] * 1e3:.3f} | {r['eager_s'] * 1e3:.3f} | "
            f"{r['eager_s'] / r['replay_s']:.2f}x | {r['batch'] / r['replay_s']:.0f} | {r['floor_s'] * 1e3:.3f} | "
            f"{r['replay_s'] / r['floor_s']:.2f}x | {r['sample_s'] * 1e3:.3f} | {r['greedy_s'] * 1e3:.3f} | "
            f"{r['engine_s'] * 1e3:.3f} | {r['engine_s'] / r['replay_s']:.2f}x |")
    return "\n".join(lines)


def add_engine_args(parser: argparse.ArgumentParser, batches: str) -> None:
    """The flags of `open_engine` (model size and layers, batch sizes (graph buckets), context, tp) and the kernel
    switches, which `kernel_config` turns into the engine's KernelConfig."""
    parser.add_argument("--size", default="4b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batches", default=batches)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tp", type=int, default=1)
    on_off = {"choices": ["on", "off"], "default": None}
    parser.add_argument("--pdl", **on_off, help="launch the decode kernels with programmatic dependent launch (sm90+) "
                        f"(default {'on' if DEFAULT.pdl else 'off'})")
    parser.add_argument("--gemv", **on_off, help="one-row projections by the Triton GEMV, or all by cuBLAS "
                        f"(default {'on' if DEFAULT.gemv_one_row else 'off'}); off also unfuses the norms")
    parser.add_argument("--fused-norm", **on_off, help="each block's add-and-norm fused into its one-row input "
                        f"projection, or a kernel of its own (default {'on' if DEFAULT.fused_norm else 'off'})")
    parser.add_argument("--whole-rows", **on_off, help="one-row GEMVs over whole weight rows a program where K "
                        f"splits into two spans, or all by the loop over K tiles (default "
                        f"{'on' if DEFAULT.whole_rows else 'off'})")
    parser.add_argument("--fp8", action="store_true",
                        help="the projections an FP8 checkpoint holds in FP8 (random, block-scaled) on the FP8 "
                             "kernels; the floor counts their bytes")
    parser.add_argument("--kernel", action="append", default=[], metavar="FIELD=VALUE",
                        help="any KernelConfig field, VALUE a Python literal (a tile as a tuple, None); repeatable")


def kernel_config(ns) -> KernelConfig:
    """The KernelConfig the flags of `add_engine_args` ask for (the defaults where a flag is not given)."""
    changes = {field: getattr(ns, flag) == "on" for flag, field in
               (("pdl", "pdl"), ("gemv", "gemv_one_row"), ("fused_norm", "fused_norm"), ("whole_rows", "whole_rows"))
               if getattr(ns, flag, None) is not None}
    fields = {f.name: f for f in dataclasses.fields(KernelConfig)}
    for item in getattr(ns, "kernel", []):
        name, _, value = item.partition("=")
        if name not in fields:
            raise SystemExit(f"--kernel: KernelConfig has no field {name!r}")
        parsed = ast.literal_eval(value)
        default = getattr(DEFAULT, name)
        changes[name] = type(default)(*parsed) if isinstance(default, tuple) and hasattr(default, "_fields") \
            and parsed is not None else parsed
    return KernelConfig(**changes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, batches="1,8,32,64")
    parser.add_argument("--out", default=None, help="append the markdown table to this file")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine column with overlap scheduling (the engine's default) or without")
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="instead of the table: the engine step with K tokens drafted by the MTP head against "
                             "one without")
    parser.add_argument("--acceptance", default=None, metavar="P1,...,PK",
                        help="with --speculative-tokens: emulate a trained head's acceptance per draft position")
    parser.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                        help="with --speculative-tokens: the head drafts among the first N token ids "
                             "(EngineArgs.speculative_draft_vocab)")
    parser.add_argument("--fp8-draft-head", action=argparse.BooleanOptionalAction, default=True,
                        help="with --speculative-tokens: the drafts read an FP8 copy of lm_head "
                             "(EngineArgs.speculative_fp8_draft_head)")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA device")
        return 2
    text = asyncio.run(speculative_run(ns)) if ns.speculative_tokens else table(ns, asyncio.run(run(ns)))
    stamp = f"{datetime.date.today()} {torch.cuda.get_device_name()} `python -m deltaserve.tools.bench_decode {' '.join(argv or sys.argv[1:])}`"
    print(stamp + "\n\n" + text)
    if ns.out:
        with open(ns.out, "a") as f:
            f.write(f"\n### {stamp}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
