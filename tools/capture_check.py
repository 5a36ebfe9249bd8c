"""Diagnostics for the CUDA graphs: capture every step shape (decode rows, speculative rows, prompt tokens, and
decode rows beside prompt tokens) and compare each replay with the same forward run eagerly.

    python -m deltaserve.tools.capture_check --model DIR [--device cuda|cpu] [--tp N] [--buckets 1,2,4,...]
        [--load-format safetensors|random] [--context 512] [--dot DIR] [--speculative-tokens K]

Per shape: graph nodes, graph memory (private pool growth), capture time, max |replay - eager| over its outputs
(the live rows' logits, the chunk's last logits, a speculative step's drafts exactly), eager and replay step
times and the speed-up. The rows are live (random state and KV near --context; with speculation, as after a
verify step that kept a random number of its tokens, so a one-token step rolls back); the prompt is one fresh
chunk of 7/8 of the shape's tokens, padded to them. Exit status 1 on any capture failure or mismatch. On the CPU
there are no graphs: it says so and checks each shape's padded fixed-input forward against the step computed
another way: one-token rows one at a time, the chunk alone unpadded, a mixed step's rows then its chunk (a
speculative step, with nothing independent to check it against, against itself run again from the same state).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

import torch

from deltaserve.devices.backend import StepShape
from deltaserve.model.batch import PrefillChunk, PromptChunks, StepBatch, TokenRows
from deltaserve.devices.replica import mixed_graph_buckets
from deltaserve.runtime import AsyncEngine, EngineArgs
from deltaserve.tools.live_rows import fill_live_rows

log = logging.getLogger("capture_check")


def time_per_call(fn, device, iters: int = 20) -> float:
    """Seconds per call (CUDA events on the current stream; wall clock on the CPU)."""
    fn()
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def check_shape(rank_objs, shape: StepShape, context: int, dot_dir: str | None, rank: int) -> dict:
    """One shape's replay (on the CPU: its program) against its forward run eagerly (on the CPU: computed
    another way, see the module's text), from the same state; the outputs' largest difference and scale."""
    backend, model, runtime = rank_objs.backend, rank_objs.model, rank_objs.runtime
    state, spec, k = runtime.state, runtime.speculation, runtime.state.speculative_tokens
    graphs = runtime.graphs
    result = {"shape": shape}
    if graphs is not None and not graphs.captured(shape):
        result["failed"] = True
        return result
    if graphs is None and shape.prompt_tokens:  # the CPU: fixed prompt inputs for this shape
        runtime.programs([shape])
    program = runtime.program(shape)
    rows, tokens = shape.rows, shape.prompt_tokens
    seed = rows * 1000 + tokens
    pools = [state.conv[:, :rows], state.ssm[:, :rows]]
    if rows:
        fill_live_rows(runtime, rows, rows, context, seed=seed, lookahead=k)
        if spec:
            spec.use_override[:rows] = False
            pools = rows_after_a_verify_step(runtime, rows, seed=seed)
    chunk = following = None
    if tokens:
        slot, n = runtime.max_batch, max(1, tokens * 7 // 8)  # the first prefill slot
        held = set(runtime.inputs.table_host[:rows].flatten().tolist())
        free = [p for p in range(state.num_pages) if p not in held]
        ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        chunk = PrefillChunk(ids, 0, slot, free[: -(-n // state.page_size)])
        following = ids[1:] + [0]
        pools = pools + [state.conv[:, slot], state.ssm[:, slot]]
    saved = [pool.clone() for pool in pools]

    def put_back():
        for pool, copy in zip(pools, saved):
            pool.copy_(copy)
        if tokens:
            runtime.prefill_inputs.fill([chunk], tokens, *((following, [slot]) if spec else ()))

    def outputs(out) -> list[torch.Tensor]:
        """The outputs a step reads: live rows' logits (a speculative step's others and drafts), the chunk's."""
        got = []
        if rows:
            got.append(out.row_logits[:rows])
            if shape.tokens_per_row > 1:
                got += [out.draft_logits[:rows], out.drafts[:rows]]
        if tokens:
            got.append(out.chunk_logits[:1])
        return [t.float().clone() for t in got]

    def reference() -> list[torch.Tensor]:
        """The CPU's other way: one-token rows one at a time (with no roll-back to make), then the chunk alone,
        unpadded; a speculative step, or a speculative engine's rows, its own program run again."""
        put_back()
        if rows and (spec or shape.tokens_per_row > 1):
            want = outputs(program())[: 3 if shape.tokens_per_row > 1 else 1]
        elif rows:
            batch = runtime.inputs.batch(rows)
            want = [torch.cat([model.logits(model.forward(state, StepBatch.of(TokenRows(
                batch.input_ids[r:r + 1], batch.positions[r:r + 1], batch.slots[r:r + 1],
                batch.page_table[r:r + 1], batch.seq_lens[r:r + 1], batch.slot_mapping[r:r + 1]))))
                for r in range(rows)]).float()]
        else:
            want = []
        if tokens:
            state.reset_slot(slot)
            alone = PromptChunks.build([chunk], state.page_size, state.trash_page, backend.device)
            want.append(model.logits(model.forward(state, StepBatch.of(chunks=alone))[alone.last_token]).float())
        return want

    def replay():
        if tokens:
            state.reset_slot(slot)
        return graphs(shape) if graphs is not None else program()

    if graphs is None:
        want = reference()
    else:
        put_back()
        if tokens:
            state.reset_slot(slot)
        want = outputs(program())
    put_back()
    got = outputs(replay())
    put_back()
    diffs = [(g - w).abs().max().item() for g, w in zip(got, want) if g.dtype.is_floating_point]
    result["diff"] = max(diffs)
    result["scale"] = max(w.abs().max().item() for w in want if w.dtype.is_floating_point)
    if any(not torch.equal(g, w) for g, w in zip(got, want) if not g.dtype.is_floating_point):
        result["diff"] = float("inf")  # other drafts: a mismatch whatever the logits
    result["eager_s"] = time_per_call(program, backend.device, 3 if graphs is None else 10)
    put_back()
    if graphs is not None:
        result.update(graphs.stats[shape])
        result["replay_s"] = time_per_call(lambda: graphs(shape), backend.device)
        if dot_dir and rank == 0:
            os.makedirs(dot_dir, exist_ok=True)
            graphs.dot(shape, os.path.join(dot_dir, f"{shape.kind}_{shape}.dot"))
    put_back()
    return result


def rows_after_a_verify_step(runtime, rows: int, seed: int) -> list[torch.Tensor]:
    """Live rows `rows` as after a verify step that kept a random number of its tokens (row 0 one: it rolls back),
    with random step states, hidden states and drafts. Returns the rows' entries of every pool a speculative or
    one-token step reads and writes (layers first in the GDN pools)."""
    state, spec, k = runtime.state, runtime.speculation, runtime.state.speculative_tokens
    kept = torch.randint(1, k + 2, (rows,), generator=torch.Generator().manual_seed(seed))
    kept[0] = 1
    spec.accepted[:rows].copy_(kept)
    spec.keep[:rows].copy_(kept)
    pools = [state.conv[:, :rows], state.ssm[:, :rows], state.conv_steps[:, :rows], state.ssm_steps[:, :rows],
             state.verify_hidden[:rows], state.drafts[:rows]]
    for pool in pools[2:]:
        pool.copy_(torch.randint_like(pool, 0, runtime.vocab) if pool.dtype == torch.long
                   else torch.randn_like(pool) * 0.1)
    return pools


def report(shape: StepShape, r: dict, tolerance: float) -> bool:
    """Print a shape's row; True when it failed (capture refused, or a mismatch)."""
    if r.get("failed"):
        print(f"{shape.kind:>11} {shape!s:>8}  CAPTURE FAILED (the shape runs eagerly)")
        return True
    rel = r["diff"] / max(r["scale"], 1e-12)
    bad = rel > tolerance
    nodes = r.get("nodes", "-")
    mib = f"{r['pool_bytes'] / 2**20:.1f}" if "pool_bytes" in r else "-"
    cap = f"{r['capture_s']:.3f}" if "capture_s" in r else "-"
    replay = f"{r['replay_s'] * 1e3:.3f}" if "replay_s" in r else "-"
    speed = f"{r['eager_s'] / r['replay_s']:.2f}x" if "replay_s" in r else "-"
    print(f"{shape.kind:>11} {shape!s:>8} {nodes!s:>6} {mib:>9} {cap:>9} {r['diff']:>10.3g} {rel:>8.2g} "
          f"{r['eager_s'] * 1e3:>9.3f} {replay:>9} {speed:>8}{'  MISMATCH' if bad else ''}")
    return bad


async def run(ns) -> int:
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    buckets = [int(b) for b in ns.buckets.split(",")] if ns.buckets else None
    args = EngineArgs(model=ns.model, device=device, tp=ns.tp, cuda_graph=True, buckets=buckets,
                      max_batch=max(buckets) if buckets else ns.max_batch, max_model_len=ns.context * 2,
                      load_format=ns.load_format, dtype=ns.dtype, prefill_slots=1,
                      prefill_graph_tokens=ns.prefill_tokens, enable_prefix_caching=False,
                      speculative_tokens=ns.speculative_tokens,
                      fused_mixed_steps=True if device != "cuda" and ns.prefill_tokens else None)
    if device != "cuda":
        print("CUDA graphs need a CUDA device: checking each shape's eager forward against another way only.")
    async with AsyncEngine(args) as engine:
        replica = engine.replica
        failures = 0
        print(f"{'kind':>11} {'shape':>8} {'nodes':>6} {'graph MiB':>9} {'capture s':>9} {'max|diff|':>10} "
              f"{'rel':>8} {'eager ms':>9} {'replay ms':>9} {'speed-up':>8}")
        for shape in check_shapes(replica, bool(ns.prefill_tokens)):
            results = await replica.group.call(
                lambda rank: _on_rank(replica, rank, check_shape, shape, ns.context, ns.dot), timeout_s=600)
            failures += report(shape, results[0], ns.tolerance)
    print("OK" if failures == 0 else f"FAILED: {failures} shape(s)")
    return 1 if failures else 0


def check_shapes(replica, prompts: bool) -> list[StepShape]:
    """Each decode bucket's one-token step and, where it may speculate, its speculative step; with `prompts`, each
    prefill bucket and, where steps fuse, each mixed prompt-token bucket once, beside the decode buckets in turn."""
    runtime, k = replica.ranks[0].runtime, replica.spec.args.speculative_tokens
    shapes = [StepShape(b, t) for b in replica.buckets for t in sorted({1, k + 1})
              if t == 1 or runtime.can_speculate(b)]
    if prompts:
        shapes += [StepShape(0, 1, t) for t in replica.prefill_bucket_sizes]
        if replica.spec.fused_mixed_steps:
            mixed = mixed_graph_buckets(replica.prefill_bucket_sizes)
            shapes += [StepShape(replica.buckets[i % len(replica.buckets)], 1, t) for i, t in enumerate(mixed)]
    return shapes


def _on_rank(replica, rank, check, *args):
    r = replica.ranks[rank]
    with r.backend.context(), torch.inference_mode():
        return check(r, *args, rank)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--buckets", default=None, help="comma-separated (default: the engine's buckets)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512, help="positions of the live rows are near this")
    parser.add_argument("--prefill-tokens", type=int, default=EngineArgs.prefill_graph_tokens,
                        help="prefill buckets up to this many tokens (0: none)")
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "random"])
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max |diff| relative to max |logit|")
    parser.add_argument("--dot", default=None, help="write each bucket's graph as DOT into this folder")
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="check the speculative step (K drafts a row, the checkpoint's MTP head) of every bucket")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(ns))


if __name__ == "__main__":
    sys.exit(main())
